"""KV compaction: a cartridge of ``p`` tokens from a corpus of ``T`` tokens in seconds, by attention matching.

The whole corpus is read once. For every layer and KV head, the compact cache keeps the attention sink and the
``p - 1`` keys that reference queries attend to most, then refits the kept tokens' values by ridge least squares so
that the attention outputs over the kept keys match those over all ``T`` keys on the same queries. Reference
queries are the corpus's own (rotated to sit just after the corpus, where a user's tokens will be) and those of a
few probe questions about it and of the model's greedy answers to them: generic ones (`probe_questions`), or the
chunk's own (`chunk_questions`: the model, with the chunk before it, asks questions about it as self-study's question
seeds prompt it to, and answers them).

The kept keys are then rotated back by ``T - p`` positions: a user token at position ``p + i`` after the cartridge
sees every kept key at the distance it would see it at position ``T + i`` after the whole corpus. The result is an
ordinary post-RoPE KV cache that every runtime serves as is (nothing in it needs a runtime to do anything new).

A corpus longer than the model's context is compacted chunk by chunk, each chunk's share of ``p`` in proportion to
its length, and the parts are composed one after another with their keys repositioned (`Cartridge.compose`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..cartridge import Cartridge
from ..errors import ConfigError, UnsupportedModelError
from ..fileformat import CartridgeMeta
from ..identity import token_fingerprint
from ..lm import rope_inv_freq
from ..rope import shift_keys
from . import seeds
from .recording import Recorder, recording
from .report import check_report, corpus_ids, reported
from .settings import CompactionConfig, ReportConfig

if TYPE_CHECKING:
    from ..lm import LM

# questions a user might ask about any document; their queries (and those of the model's answers) stand in for
# the questions the cartridge will be asked
PROBE_QUESTIONS = (
    "Summarize the document above in a few sentences.",
    "What are the main findings or results reported in the document?",
    "Which methods, data sets or sources does the document describe?",
    "List the specific names, numbers and facts the document mentions.",
    "What problem does the document address, and why does it matter?",
    "What are the limitations or open questions the document points out?",
)


_SEEDS = seeds.QUESTION_PROMPTS  # what the model is asked, to ask its own question about a chunk
# its question: at most this many tokens, sampled (greedy would ask one question per seed prompt, and there are three)
QUESTION_TOKENS, QUESTION_TEMPERATURE = 48, 0.8
# the longest word `keep_surprising` keeps whole, in tokens (a name is a few; text without spaces is one long "word")
MAX_WORD = 8

# the longest chunk read in one pass by default: one forward pass holds the chunk's KV and recorded queries
MAX_CHUNK = 16384
# reference queries whose logits against the whole chunk are in memory at once (1024 x 16k floats = 64 MiB)
QUERY_BLOCK = 1024


def compact_corpus(lm: LM, corpus: Any, num_tokens: int, *, num_frozen: int = 1, config: CompactionConfig | None = None,
                   progress: bool = False, report: bool | ReportConfig = False) -> Cartridge:
    """`Cartridge.compact`: `corpus` is a text, a path, a `Corpus` or token ids; `report` adds the quality report."""
    check_report(report)
    ids, _ = corpus_ids(lm, corpus)
    cart = compact(lm, ids, num_tokens, num_frozen=num_frozen, config=config, progress=progress)
    return reported(lm, ids, cart, report, progress=progress)


def compact(lm: LM, ids: Sequence[int], num_tokens: int, *, num_frozen: int = 1,
            config: CompactionConfig | None = None, progress: bool = False) -> Cartridge:
    """A `num_tokens` cartridge standing in for the corpus token ids `ids` (see the module docstring)."""
    config = (config or CompactionConfig()).for_model(lm)
    ids = [int(t) for t in ids]
    Cartridge.check_size(num_tokens, num_frozen, len(ids))
    if num_frozen > 1:
        raise ConfigError(f"num_frozen={num_frozen}: compaction keeps one attention sink per chunk; use num_frozen=1 or 0.")
    chunks = _split(len(ids), _chunk_limit(lm, config, len(ids)))
    budgets = _shares(num_tokens, [b - a for a, b in chunks])
    lm.check_context(num_tokens, f"A {num_tokens}-token cartridge", "pass a smaller num_tokens")
    parts = []
    for (a, b), budget in zip(chunks, _bar(chunks, budgets, progress)):
        kv = _compact_chunk(lm, ids[a:b], budget, config)
        meta = CartridgeMeta(model=lm.identity, num_tokens=budget, num_frozen=min(num_frozen, budget),
                             dtype=str(kv[0][0].dtype).removeprefix("torch."), init="compact")
        parts.append(Cartridge([k for k, _ in kv], [v for _, v in kv], meta, lm=lm))
    cart = parts[0] if len(parts) == 1 else Cartridge.compose(parts, reposition=True, model=lm)
    compaction = {**attrs.asdict(config), "corpus_tokens": len(ids), "chunks": [list(c) for c in chunks],
                  "chunk_tokens": budgets}
    meta = attrs.evolve(cart.meta, init="compact", num_frozen=num_frozen,
                        corpus={"fingerprint": token_fingerprint(ids), "num_tokens": len(ids)},
                        extra={**cart.meta.extra, "compaction": compaction})
    return Cartridge(cart.keys, cart.values, meta, lm=lm)


def _chunk_limit(lm: LM, config: CompactionConfig, total: int) -> int:
    """The longest chunk whose forward pass, and each probe question and answer after it, fits the model."""
    room = max((len(lm.prompt_ids([{"role": "user", "content": q}], after_cartridge=True))
                for q in config.probe_questions), default=0)
    room += config.answer_tokens if config.probe_questions else 0
    if config.chunk_questions:  # a seed prompt and the question it draws, then the question and its answer
        seed = max(len(lm.prompt_ids([{"role": "user", "content": q}], after_cartridge=True)) for q in _SEEDS)
        room = max(room, seed + QUESTION_TOKENS, QUESTION_TOKENS + 16 + config.answer_tokens)
    limit = min(lm.max_context or total + room, MAX_CHUNK) - room
    if config.max_chunk_tokens is not None:
        limit = min(limit, config.max_chunk_tokens)
    if limit < 2:
        fix = "chunk_questions=0 (compaction without its own questions), " if config.chunk_questions else ""
        raise ConfigError(f"The probe questions and answers ({room} tokens) leave no room for the corpus in "
                          f"{lm.name!r}'s context of {lm.max_context}; use {fix}shorter probes or fewer answer_tokens.")
    return limit


def _bar(chunks: list[tuple[int, int]], budgets: list[int], progress: bool) -> Iterator[int]:
    if len(chunks) == 1 or not progress:
        yield from budgets
        return
    from tqdm.auto import tqdm

    yield from tqdm(budgets, desc="compacting chunks", unit="chunk")


def _split(total: int, limit: int) -> list[tuple[int, int]]:
    """Consecutive spans of at most `limit` tokens, as equal as possible."""
    n = math.ceil(total / limit)
    edges = [round(i * total / n) for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _shares(num_tokens: int, lengths: list[int]) -> list[int]:
    """Split `num_tokens` over chunks in proportion to their lengths (largest remainders), each at least 2 tokens
    (its sink and one more) and at most its length."""
    if num_tokens < 2 * len(lengths):
        raise ConfigError(
            f"num_tokens={num_tokens} is too few for a corpus read in {len(lengths)} chunks (each keeps its sink and "
            f"at least one more token); pass num_tokens >= {2 * len(lengths)}, or a larger max_chunk_tokens."
        )
    raw = [num_tokens * n / sum(lengths) for n in lengths]
    out = [max(2, min(n, int(r))) for r, n in zip(raw, lengths)]
    while sum(out) < num_tokens:  # one token at a time to the chunk furthest below its share
        i = max((j for j in range(len(out)) if out[j] < lengths[j]), key=lambda j: raw[j] - out[j])
        out[i] += 1
    while sum(out) > num_tokens:  # or from the chunk furthest above it, never below 2
        i = max((j for j in range(len(out)) if out[j] > 2), key=lambda j: out[j] - raw[j])
        out[i] -= 1
    return out


# -- reading the reference queries ---------------------------------------------------------------------------------
@torch.inference_mode()
def _read(lm: LM, ids: list[int], config: CompactionConfig):
    """The chunk's per-layer keys and values, and per-layer reference queries ``[heads, m, head_dim]`` placed at
    positions ``>= T`` (the corpus's own, rotated there, then the probes'). `config` has the model's settings filled
    in (`CompactionConfig.for_model`), as `compact` and `attention_error` pass it."""
    from transformers import DynamicCache

    model, device, n = lm.model, lm.device, len(ids)
    inv_freq = rope_inv_freq(lm)
    cache = DynamicCache(config=model.config)
    wanted = min(config.corpus_queries, n - 1)
    # positions spread evenly over the corpus (the first few tokens' queries are mostly about the sink)
    positions = torch.linspace(min(16, n - 1), n - 1, wanted).round().long().unique() if wanted else torch.empty(0, dtype=torch.long)
    with recording(lm) as rec:
        rec.select = positions
        hidden = model.base_model(input_ids=torch.tensor([ids], device=device),
                                  position_ids=torch.arange(n, device=device)[None], past_key_values=cache,
                                  use_cache=True).last_hidden_state[0]
        surprisal = _surprisal(lm, ids, hidden) if config.keep_surprising else None
        del hidden
        kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]
        # each corpus query moves from its position to one just after the corpus (offsets spread evenly, in a fixed
        # shuffled order so that neighbouring positions do not land together)
        offsets = torch.randperm(len(positions), generator=torch.Generator().manual_seed(0)) % max(1, config.spread)
        corpus_q = {i: shift_keys(qs[0], n + offsets - positions, inv_freq) for i, qs in rec.queries.items()}
        rec.queries.clear()
        rec.select = None
        for question in config.probe_questions:
            _probe(lm, cache, n, lm.prompt_ids([{"role": "user", "content": question}], after_cartridge=True),
                   config.answer_tokens)
            cache.crop(n - cache.get_seq_length())
        for question in _own_questions(lm, cache, n, config.chunk_questions, rec):
            # the answer reads the chunk for the detail asked; the prompt's queries are mostly the chat template's
            _probe(lm, cache, n, question, config.answer_tokens, quiet_prompt=rec)
            cache.crop(n - cache.get_seq_length())
        probe_q = {i: torch.cat(qs, dim=1) for i, qs in rec.queries.items()}
    layers = range(len(kv))
    if sorted(corpus_q) != list(layers) and sorted(probe_q) != list(layers):
        raise UnsupportedModelError(
            f"Model {lm.name!r}: queries were read from layers {sorted(corpus_q)} of {len(kv)}; compaction needs an "
            "attention layer that calls transformers' attention interface in every layer."
        )
    queries = [torch.cat([q[i] for q in (corpus_q, probe_q) if i in q], dim=1) for i in layers]
    return kv, queries, rec.scaling, surprisal


def _surprisal(lm: LM, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """Each token's ``-log p`` under the model given the tokens before it (0 for the first), from the chunk's own
    forward pass; the vocabulary's logits are taken a block of positions at a time (all at once can take gigabytes)."""
    head = lm.model.get_output_embeddings()
    target = torch.tensor(ids[1:], device=hidden.device)
    out = [hidden.new_zeros(1, dtype=torch.float32)]
    for start in range(0, len(ids) - 1, QUERY_BLOCK):
        logp = head(hidden[start : start + QUERY_BLOCK][: len(target) - start]).float().log_softmax(-1)
        out.append(-logp.gather(1, target[start : start + len(logp), None])[:, 0])
    return torch.cat(out).cpu()


def _probe(lm: LM, cache, start: int, prompt: list[int], answer_tokens: int,
           generator: torch.Generator | None = None, quiet_prompt: Recorder | None = None) -> list[int]:
    """Run a probe question after the corpus, then answer it for up to `answer_tokens` tokens: greedily, or sampled
    at `QUESTION_TEMPERATURE` with `generator`. With `quiet_prompt` (the recorder) the prompt's forward pass records
    no queries: only the answer's do. Returns the answer's tokens."""
    model, device = lm.model, lm.device
    ids, pos, answer = torch.tensor([prompt], device=device), start, []
    eos = lm.eos_token_ids
    for step in range(answer_tokens + 1):
        if quiet_prompt is not None:
            quiet_prompt.paused = step == 0
        out = model(input_ids=ids, position_ids=torch.arange(pos, pos + ids.shape[1], device=device)[None],
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        if quiet_prompt is not None:
            quiet_prompt.paused = False
        pos += ids.shape[1]
        logits = out.logits[0, -1].float()
        if generator is None:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial((logits / QUESTION_TEMPERATURE).softmax(-1).cpu(), 1, generator=generator))
        if step == answer_tokens or nxt in eos:
            return answer
        answer.append(nxt)
        ids = torch.tensor([[nxt]], device=device)
    return answer


def _own_questions(lm: LM, cache, start: int, count: int, rec: Recorder) -> list[list[int]]:
    """`count` questions the model asks about the chunk in `cache` (self-study's question seed prompts, in turn,
    sampled with a fixed seed), as prompt ids; asking them records no reference queries."""
    generator, questions = torch.Generator().manual_seed(0), []
    rec.paused = True
    try:
        for i in range(count):
            seed = lm.prompt_ids([{"role": "user", "content": _SEEDS[i % len(_SEEDS)]}], after_cartridge=True)
            text = lm.tokenizer.decode(_probe(lm, cache, start, seed, QUESTION_TOKENS, generator),
                                       skip_special_tokens=True).strip()
            cache.crop(start - cache.get_seq_length())
            if text:
                questions.append(lm.prompt_ids([{"role": "user", "content": text}], after_cartridge=True))
    finally:
        rec.paused = False
    return questions


# -- fitting ---------------------------------------------------------------------------------------------------------
def _compact_chunk(lm: LM, ids: list[int], budget: int, config: CompactionConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = len(ids)
    if budget >= n:  # nothing to drop: the prefix cache itself, exactly
        return [(k.clone(), v.clone()) for k, v in lm.kv(ids)]
    kv, queries, scaling, surprisal = _read(lm, ids, config)
    inv_freq = rope_inv_freq(lm)
    keep = None
    if surprisal is not None:
        keep = surprising_words(lm, ids, surprisal, min(budget - 1, round(config.keep_surprising * budget)))
    out = []
    for i, (k, v) in enumerate(kv):
        keys, values = fit_layer(k.float(), v.float(), queries[i].to(k.device), scaling[i], budget, config.ridge,
                                 mass=config.mass, select=config.select, keep=keep)
        out.append((shift_keys(keys, -(n - budget), inv_freq).to(k.dtype), values.to(v.dtype)))
    return out


def surprising_words(lm: LM, ids: list[int], surprisal: torch.Tensor, count: int) -> torch.Tensor | None:
    """Up to `count` positions (never the sink's): the words holding the tokens the model least expected, most
    surprising first, each whole. A reader copies a rare name token by token, each one found by the token before
    it, so a name missing its tail comes out misspelled ("milen" for "mil|ank|ov|itch"). A token whose text does not
    start with a space or a sign continues the word before it, and a word longer than `MAX_WORD` tokens (text
    without spaces) is its single token."""
    if count <= 0:
        return None
    decode = lm.tokenizer.decode
    # a token's own text is what it adds after the token before it (a lone SentencePiece token decodes unspaced)
    starts = [i == 0 or not decode(ids[i - 1 : i + 1])[len(decode(ids[i - 1 : i])):][:1].isalnum()
              for i in range(len(ids))]
    chosen: set[int] = set()
    for p in surprisal[1:].argsort(descending=True).add(1).tolist():
        if p in chosen:
            continue
        first, last = p, p + 1
        while first > 1 and not starts[first] and p - first < MAX_WORD - 1:
            first -= 1
        while last < len(ids) and not starts[last] and last - first < MAX_WORD:
            last += 1
        # a word whose start or end is not in sight (text without spaces, a long identifier) is its token alone
        word = range(first, last) if (first == 1 or starts[first]) and (last == len(ids) or starts[last]) else [p]
        for q in word:  # the last word may not fit whole: its first tokens then (measured: docs/compaction.md)
            if len(chosen) < count:
                chosen.add(q)
        if len(chosen) >= count:
            break
    return torch.tensor(sorted(chosen), dtype=torch.long)


def fit_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, scaling: float, budget: int,
              ridge: float, *, mass: bool = True, select: str = "max",
              keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact one layer: keys and values ``[kv_heads, T, d]``, queries ``[heads, m, d]`` (grouped by KV head as
    the model groups them). Returns ``budget`` keys (at their original positions) and refitted values per KV head;
    the positions in `keep` are among them whatever their attention.

    With `mass`, one vector ``delta`` per head is added to all its kept keys, fitted so ``q . delta`` makes up the
    log of the attention mass the dropped keys held for each reference query. The same shift for every kept key
    leaves the attention *within* the cartridge as it was, so the values' fit holds; what changes is how much the
    cartridge as a whole weighs against the tokens that follow it, which without the dropped keys would be too
    little. It is the per-key attention bias of attention matching, restricted to what a plain KV cache can hold.
    """
    kv_heads, n, d = keys.shape
    group = queries.shape[0] // kv_heads
    if kv_heads > 1:  # one KV head at a time: the logits of all heads at once can take gigabytes
        parts = [fit_layer(keys[g : g + 1], values[g : g + 1], queries[g * group : (g + 1) * group], scaling, budget,
                           ridge, mass=mass, select=select, keep=keep) for g in range(kv_heads)]
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])
    q = queries.reshape(group * queries.shape[1], d)  # query head h uses KV head h // group
    k, v = keys[0], values[0]
    # the full attention, one block of queries at a time (all of them at once can take gigabytes): each key's peak or
    # mean weight, each query's output and log-partition
    score = k.new_zeros(n)
    target, lse = [], []
    for block in q.split(QUERY_BLOCK):
        logits = (block @ k.T) * scaling
        lse.append(logits.logsumexp(-1))
        weights = (logits - lse[-1][:, None]).exp()
        score = torch.maximum(score, weights.amax(0)) if select == "max" else score + weights.sum(0)
        target.append(weights @ v)
    target, lse = torch.cat(target), torch.cat(lse)
    score[0] = float("inf")  # the attention sink always stays
    if keep is not None:
        score[keep.to(score.device)] = float("inf")
    idx = score.topk(budget).indices.sort().values
    kept_k = k[idx]
    kept_logits = (q @ kept_k.T) * scaling  # [m, budget]
    kept_w = kept_logits.softmax(-1).double()
    if mass:
        deficit = (lse - kept_logits.logsumexp(-1)).double()  # [m], >= 0
        qd = q.double() * scaling
        gram_q = qd.T @ qd
        lam_q = 1e-3 * gram_q.diagonal().mean()
        delta = torch.linalg.solve(gram_q + lam_q * torch.eye(d, dtype=qd.dtype, device=qd.device), qd.T @ deficit)
        kept_k = kept_k + delta.float()
    kept_v = v[idx].double()
    gram = kept_w.T @ kept_w  # [budget, budget]
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(budget, dtype=gram.dtype, device=gram.device)
    # ridge toward the tokens' own values: with little evidence a value stays what the model computed
    fitted = torch.linalg.solve(gram + lam * eye, kept_w.T @ target.double() + lam * kept_v)
    return kept_k[None], fitted.float()[None]


def attention_error(lm: LM, ids: Sequence[int], cartridge: Cartridge, config: CompactionConfig | None = None) -> float:
    """Mean relative error of the cartridge's attention outputs against the whole text's, over the reference
    queries of every layer (queries are the full text's: an error here is the cache's, not the model's drift)."""
    if len(cartridge.meta.parts) > 1:
        raise ConfigError("attention_error compares one chunk's cartridge with its text; this one was composed "
                          f"from {len(cartridge.meta.parts)} chunks.")
    config = (config or CompactionConfig()).for_model(lm)
    ids = [int(t) for t in ids]
    n = len(ids)
    kv, queries, scaling, _ = _read(lm, ids, config)
    inv_freq = rope_inv_freq(lm)
    errors = []
    for i, (k, v) in enumerate(kv):
        ck = shift_keys(cartridge.keys[i].float(), n - cartridge.num_tokens, inv_freq)  # back to the text's frame
        full = _attend(queries[i].to(k.device), k.float(), v.float(), scaling[i])
        comp = _attend(queries[i].to(k.device), ck, cartridge.values[i].float(), scaling[i])
        errors.append(float((comp - full).norm(dim=-1).mean() / full.norm(dim=-1).mean()))
    return sum(errors) / len(errors)


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    kv_heads, _, d = keys.shape
    q = queries.reshape(kv_heads, -1, d)
    return (torch.einsum("gmd,gnd->gmn", q, keys) * scaling).softmax(-1) @ values

