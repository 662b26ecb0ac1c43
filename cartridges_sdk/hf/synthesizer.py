"""The built-in Hugging Face synthesizer: self-study sampling and scoring on the transformers model in an `LM`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..kit import (autocast, Cartridge, Completion, concat_layers, GenerationParams, Layers, ModelIdentity, one_of,
    prefix_cache, resolve_dtype, SynthesisRequest, Synthesizer, SynthesizerCapabilities)
from .decode import decode, prefill_rows, row_completion

if TYPE_CHECKING:
    from ..kit import LM

# logits scored in one forward pass (4 windows of 256 tokens x a 49k vocabulary; one window of a 152k one): 200 MB
# in float32, and their log-softmax as much again
SCORE_LOGITS = 64_000_000
# shared prompts whose KV is kept between calls: A's, B's and the scorer's
PREFIXES_KEPT = 3


def _dtype_name(value: Any) -> Any:
    """A torch dtype or an alias ("bf16") as its name; anything else is left for the validator to refuse."""
    if isinstance(value, torch.dtype) or value in ("bf16", "fp16"):
        return str(resolve_dtype(value)).removeprefix("torch.")
    return value


@attrs.frozen
class HFSynthesizerOptions:
    # compute dtype for sampling (bf16 pays where its matrix products are faster: GPUs, CPUs with AMX); None keeps
    # the model's dtype
    autocast_dtype: str | None = attrs.field(default=None, converter=_dtype_name,
                                             validator=one_of(None, "bfloat16", "float16"))
    # dtype of the model copy that scores given sequences (document windows): scoring is forward passes over whole
    # sequences, like training, and can gain from bf16 where decoding loses (the 135M model on 2 cores); None
    # scores with the model itself
    score_dtype: str | None = attrs.field(default=None, converter=_dtype_name,
                                          validator=one_of(None, "bfloat16", "float16", "float32"))


class HFSynthesizer(Synthesizer):
    """Samples with the transformers model in an `LM`: each group's shared prompt is prefilled once, then the
    group's completions are generated together as one batch from that KV cache."""

    Options = HFSynthesizerOptions
    capabilities = SynthesizerCapabilities(max_top_logprobs=1024, score=True, prefix_reuse=True)
    lm: LM  # an `LM`, all of it (`Backend` names only what every backend's model has)

    def __init__(self, lm: LM, *, autocast_dtype: str | torch.dtype | None = None,
                 score_dtype: str | torch.dtype | None = None):
        super().__init__(lm, autocast_dtype=autocast_dtype, score_dtype=score_dtype)
        self.autocast_dtype = resolve_dtype(self.options.autocast_dtype)
        self.scorer = lm.in_dtype(resolve_dtype(self.options.score_dtype))
        # it returns top-k up to the whole vocabulary: the class says 1024 (known before the model), the instance more
        self.capabilities = attrs.evolve(self.capabilities, max_top_logprobs=lm.identity.architecture["vocab_size"])
        self._prefixes: OrderedDict[tuple, Cartridge] = OrderedDict()

    def identity(self) -> ModelIdentity:
        return self.lm.identity

    def _prefix_cartridge(self, ids: Sequence[int], lm: LM | None = None) -> Cartridge:
        """The KV of exactly `ids` as an (unfrozen) cartridge, computed by `lm` (default: the sampling model). The
        last `PREFIXES_KEPT` are kept: A's, B's and the scorer's alternate group after group, and with
        ``b_context="document"`` B's and the scorer's are the same document for every group."""
        lm = lm or self.lm
        key = (tuple(ids), lm.dtype)
        if key not in self._prefixes:
            while len(self._prefixes) >= PREFIXES_KEPT:  # before computing: never one more than kept in memory
                self._prefixes.popitem(last=False)
            self._prefixes[key] = Cartridge.from_prefix(lm, list(ids), len(ids), num_frozen=0)
        self._prefixes.move_to_end(key)
        return self._prefixes[key]

    def _prefix_layers(self, ids: Sequence[int]) -> tuple[Layers, int]:
        """The KV of the longest start of `ids` a kept prefix holds, when that is most of `ids`, else of all of
        `ids`; and how many tokens of `ids` it covers. A group's shared prompt is its chunk or document, then the
        chat's opening and as much of the first message as the group's messages happen to share, so the kept
        document serves every group however their questions begin."""
        best, covered = None, 0
        for key in self._prefixes:
            common = _common_prefix([key[0], ids]) if key[1] == self.lm.dtype else 0
            if common > covered:
                best, covered = key, common
        if best is None or 2 * covered < len(ids):
            return concat_layers(self.lm, [self._prefix_cartridge(ids)]), len(ids)
        self._prefixes.move_to_end(best)
        layers = concat_layers(self.lm, [self._prefixes[best]])
        return [(k[:, :covered], v[:, :covered]) for k, v in layers], covered

    def close(self) -> None:
        """Frees the kept prefixes (a whole document's KV with ``b_context="document"``) before training."""
        self._prefixes.clear()

    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        batches: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            key = (r.group if r.group is not None else f"solo-{i}", r.max_tokens, r.temperature, r.top_logprobs, r.stop_ids)
            batches.setdefault(key, []).append(i)
        for (_, max_tokens, temperature, top_logprobs, stop_ids), idx in batches.items():
            prompts = [requests[i].prompt_ids for i in idx]
            shared = _common_prefix(prompts)
            shared = min(shared, min(len(p) for p in prompts) - 1)  # every row keeps at least one token to feed
            prefix, cut = self._prefix_layers(prompts[0][:shared]) if shared > 1 else (None, 0)
            params = GenerationParams(max_new_tokens=max_tokens, temperature=temperature, seed=requests[idx[0]].seed)
            stops = stop_ids or None
            with autocast(self.lm.device, self.autocast_dtype):
                rows = prefill_rows(self.lm, prefix, [p[cut:] for p in prompts])
                for state in decode(self.lm, rows, [p[-1:] for p in prompts], params,
                                    top_logprobs=top_logprobs, stop_ids=stops):
                    pass
            for row, i in enumerate(idx):
                results[i] = row_completion(self.lm, state, row, stop_ids=stops)
        return results  # type: ignore[return-value]

    def score(self, prefix_ids: Sequence[int], sequences: Sequence[Sequence[int]], top_k: int) -> list[tuple[Any, Any]]:
        """Each sequence's top-k log-probabilities after the prefix; sequences of one length (a chunk's document
        windows) go through the model together, up to `SCORE_LOGITS` logits at a time."""
        lm = self.scorer
        prefix = self._prefix_cartridge(prefix_ids, lm)
        out: list[tuple[Any, Any] | None] = [None] * len(sequences)
        by_length: dict[int, list[int]] = {}
        for i, seq in enumerate(sequences):
            by_length.setdefault(len(seq), []).append(i)
        vocab = lm.identity.architecture["vocab_size"]
        for n, rows in by_length.items():
            lm.check_context(prefix.num_tokens + n, f"Scoring {n} tokens after a {prefix.num_tokens}-token prefix",
                             "lower window_tokens or the chunk size")
            per_call = max(1, SCORE_LOGITS // (n * vocab))
            for start in range(0, len(rows), per_call):
                part = rows[start : start + per_call]
                logp = self._logits(lm, prefix, [sequences[i] for i in part])[:, :-1].log_softmax(-1)
                top = torch.topk(logp, top_k, dim=-1)
                for r, i in enumerate(part):
                    out[i] = (top.indices[r].cpu().numpy(), top.values[r].cpu().numpy())
        return out  # type: ignore[return-value]

    @staticmethod
    @torch.inference_mode()
    def _logits(lm: LM, prefix: Cartridge, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 logits ``[rows, n, vocab]`` of equally long `rows`, each after `prefix`."""
        ids = torch.tensor([list(r) for r in rows], dtype=torch.long, device=lm.device)
        cache, p = prefix_cache(lm, [prefix], batch_size=len(rows))
        n = ids.shape[1]
        return lm.model(
            input_ids=ids, attention_mask=torch.ones(len(rows), p + n, dtype=torch.long, device=lm.device),
            position_ids=torch.arange(p, p + n, device=lm.device)[None].expand(len(rows), -1),
            past_key_values=cache, use_cache=True,
        ).logits.float()


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = seqs[0][i]
        if any(s[i] != t for s in seqs):
            return i
    return n


__all__ = ["HFSynthesizer"]
