"""Serving cartridges in llama.cpp: a cartridge becomes the first `p` cells of the sequence, written through
llama.cpp's own sequence-state API, and decoding continues after it as after a cached prefix of `p` tokens.

llama-cpp-python's `Llama` keeps one sequence, so requests are answered one after another (a clear limit: see
docs/llamacpp.md). Its bookkeeping (``n_tokens``, ``input_ids``) is kept in step with the cells the cartridge fills,
or its next ``eval`` would wipe them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cartridges_sdk import (
    BackendError,
    BackendUnavailableError,
    Cartridge,
    Completion,
    ConfigError,
    GenerationRequest,
    IncompatibleCartridgeError,
    Runtime,
    UnsupportedModelError,
)
from cartridges_sdk.kit import (CartridgeMeta, check_fits, ends_answer, INTERLEAVED, key_layout, Recent,
    refuse_foreign, ROTATE_HALF, sample_next, text_deltas)

from .options import LlamaCppOptions
from .state import Layout, read

DEFAULT_N_CTX = 4096  # positions when neither the option nor the model says
PLACEHOLDER_ID = 0  # what the cartridge's cells claim to hold, in the Llama object's bookkeeping
MAX_BLOB_BYTES = 256 * 2**20  # recent cartridges kept ready to load, in bytes
# llama.cpp's RoPE per GGUF architecture: Llama-family GGUFs had their Q/K rows permuted at conversion, so their
# cached keys pair adjacent dimensions; Qwen2 kept the Hugging Face layout
PAIRING = {"llama": INTERLEAVED, "qwen2": ROTATE_HALF}


class LlamaCppRuntime(Runtime):
    """Answers requests in llama.cpp (llama-cpp-python), from the student's GGUF, one request at a time."""

    Options = LlamaCppOptions

    def __init__(self, model, **options: Any):
        super().__init__(model, **options)
        self.gguf = Path(self.options.gguf) if self.options.gguf else _student_gguf(model)
        try:
            from llama_cpp import Llama
        except Exception as err:
            raise BackendUnavailableError(
                f"llama-cpp-python is not usable here ({type(err).__name__}: {err}). Install it with "
                "`./scripts/setup.sh --core --llamacpp` from the repository (it compiles llama.cpp, about 10 minutes "
                "the first time)."
            ) from err
        n_ctx = self.options.n_ctx or model.max_context or DEFAULT_N_CTX
        self.llm = Llama(model_path=str(self.gguf), n_ctx=n_ctx, n_threads=self.options.n_threads,
                         flash_attn=self.options.flash_attn, logits_all=False, verbose=self.options.verbose)
        # llama.cpp rounds its context up to a multiple of 256; llama-cpp-python's token list keeps the size asked for
        self.max_positions = min(self.llm.n_ctx(), len(self.llm.input_ids))
        self._loaded: str | None = None  # fingerprint of the cartridge the sequence's first cells hold
        self._blobs: Recent[bytes] = Recent(budget=MAX_BLOB_BYTES)  # recent cartridges in llama.cpp's layout, by content
        self._composed: Recent[Cartridge] = Recent(64)  # recent compositions, by their parts
        self._turn = 0  # counts uses of the one sequence, so a paused stream notices another request took it
        self.loads = 0  # cartridges written into the sequence (not again while they are still there)
        try:
            self.arch = self._check_model()
            self.pairing = PAIRING[self.arch]
            self.layout = self._learn_layout()
        except BaseException:
            self.close()
            raise

    # ---- the Runtime API

    @classmethod
    def serves_fast(cls, lm: Any) -> bool:
        """A GGUF reader of a family this runtime runs, on the CPU, with llama-cpp-python installed: llama.cpp's
        quantized kernels answer it faster than the HF runtime's float32 copy (docs/runtimes.md); on a GPU, HF's are
        faster."""
        import importlib.util

        return (getattr(lm, "gguf", None) is not None and lm.device.type == "cpu"
                and getattr(lm.model.config, "model_type", None) in PAIRING
                and importlib.util.find_spec("llama_cpp") is not None)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        requests = list(requests)
        refuse_foreign(self.lm, [c for r in requests for c in r.cartridges])  # before the engine sees any
        for i, r in enumerate(requests):
            self._check_length(i, r)
        return [self._answer(r) for r in requests]

    def stream(self, request: GenerationRequest) -> Generator[str, None, Completion]:
        refuse_foreign(self.lm, list(request.cartridges))
        self._check_length(None, request)
        return (yield from text_deltas((Completion.from_ids(self.lm, ids, reason, stop=request.params.stop),
                                        reason is not None) for ids, _, reason in self._decode(request)))

    def prefill(self, ids: Sequence[int]) -> Cartridge:
        """A cartridge of these tokens as llama.cpp itself computes them (its own prefill, read back from the
        sequence state), in the file format's rotate-half key layout."""
        ids = [int(i) for i in ids]
        _, positions, keys, values = read(self.state_of(ids), self.lm.identity.architecture["num_kv_heads"])
        if positions != list(range(len(ids))):
            raise BackendError(f"llama.cpp's state holds positions {positions[:4]}..., not 0..{len(ids) - 1}.")
        import torch

        meta = CartridgeMeta(model=self.lm.identity, num_tokens=len(ids), init="prefix", key_layout=key_layout(self.pairing),
                             extra={"computed_by": "llama.cpp", "gguf": self.gguf.name})
        made = Cartridge([torch.from_numpy(k) for k in keys], [torch.from_numpy(v) for v in values], meta, lm=self.lm)
        return made.in_key_pairing(ROTATE_HALF)

    def state_of(self, ids: Sequence[int]) -> bytes:
        """llama.cpp's own sequence state after these tokens (its prefill, as `llama_state_seq_get_data` writes it)."""
        self._check_fits(len(ids), "the tokens")
        self._reset()
        self.llm.eval([int(i) for i in ids])
        return self.sequence_state()

    def next_token_logprobs(self, cartridges: Sequence[Cartridge], ids: Sequence[int]) -> np.ndarray:
        """After the cartridges, the log-probs of the next token after each of `ids` (``[len(ids), vocab]``,
        float64): what engines are compared on (KL to another runtime)."""
        from llama_cpp import llama_cpp as C

        refuse_foreign(self.lm, list(cartridges))
        self._check_fits(sum(c.num_tokens for c in cartridges) + len(ids), "the cartridges and tokens")
        self._load(cartridges)
        rows = []
        for token in ids:  # one token per step: llama.cpp keeps only the last position's logits here
            self.llm.eval([int(token)])
            logits = np.ctypeslib.as_array(C.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
            rows.append(_log_softmax(logits.astype(np.float64)))
        return np.stack(rows)

    def state_blob(self, cartridge: Cartridge) -> bytes:
        """The cartridge as this context's sequence state (what `llama_state_seq_set_data` takes)."""
        refuse_foreign(self.lm, [cartridge])
        return _blob(self.layout, cartridge, self.pairing)

    def close(self) -> None:
        for held in (getattr(self, "_blobs", None), getattr(self, "_composed", None)):  # None: __init__ failed early
            if held is not None:
                held.clear()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()

    # ---- internals

    def _check_model(self) -> str:
        """The GGUF's architecture, refused unless it is the student's (layers, heads, dims, vocabulary, RoPE base)."""
        meta = self.llm.metadata
        arch = meta.get("general.architecture", "?")
        if arch not in PAIRING:
            raise UnsupportedModelError(f"The llama.cpp runtime writes cartridges for {sorted(PAIRING)} GGUFs; "
                                        f"{self.gguf.name} is {arch!r}. Serve it with runtime='hf'.")
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        gguf = {"num_layers": int(meta[f"{arch}.block_count"]),
                "num_kv_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
                "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
                "hidden_size": hidden, "vocab_size": int(self.llm.n_vocab())}
        mine = self.lm.identity.architecture
        wrong = [f"{k} {v} vs {mine.get(k)}" for k, v in gguf.items() if mine.get(k) is not None and mine[k] != v]
        theta = meta.get(f"{arch}.rope.freq_base")
        want = (mine.get("rope") or {}).get("rope_theta")
        if theta is not None and want is not None and abs(float(theta) - float(want)) > 1e-3 * abs(float(want)):
            wrong.append(f"RoPE base {float(theta):g} vs {float(want):g}")
        if mine.get("model_type") not in (None, arch):
            wrong.append(f"architecture {arch} vs {mine['model_type']}")
        if wrong:
            raise IncompatibleCartridgeError(
                f"{self.gguf.name} is not the student's model {self.lm.name!r} ({'; '.join(wrong)}, GGUF vs student); "
                "pass the option gguf= with the student's own GGUF."
            )
        return arch

    def _learn_layout(self) -> Layout:
        """What this context's sequence state looks like, read from a blob it writes for two placeholder tokens."""
        self._reset()
        self.llm.eval([PLACEHOLDER_ID] * 2)
        layout = Layout.learn(self.sequence_state())
        arch = self.lm.identity.architecture
        if layout.num_layers != arch["num_layers"] or layout.width != arch["num_kv_heads"] * arch["head_dim"]:
            raise UnsupportedModelError(
                f"llama.cpp's cache for {self.gguf.name} has {layout.num_layers} layers of {layout.width} values per "
                f"token, not the model's {arch['num_layers']} of {arch['num_kv_heads'] * arch['head_dim']}."
            )
        self._reset()
        return layout

    def _reset(self) -> None:
        self.llm.n_tokens = 0  # the next eval removes every cell from position 0
        self._loaded = None
        self._turn += 1

    def sequence_state(self) -> bytes:
        """The sequence's state as llama.cpp writes it now (`llama_state_seq_get_data`)."""
        from llama_cpp import llama_cpp as C

        size = C.llama_state_seq_get_size(self.llm.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = C.llama_state_seq_get_data(self.llm.ctx, buf, size, 0)
        return bytes(buf[:n])

    def _load(self, cartridges: Sequence[Cartridge]) -> int:
        """Fill the sequence's first cells with the request's cartridges (composed in order); their token count."""
        if not cartridges:
            self._reset()
            return 0
        self._turn += 1
        whole = cartridges[0] if len(cartridges) == 1 else self._composed.get(
            tuple(c.fingerprint for c in cartridges), lambda: Cartridge.compose(list(cartridges)))
        key = whole.fingerprint
        p = whole.num_tokens
        if self._loaded != key:
            blob = self._blobs.get(key, lambda: _blob(self.layout, whole, self.pairing))
            from llama_cpp import llama_cpp as C

            self._loaded = None
            buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
            n = C.llama_state_seq_set_data(self.llm.ctx, buf, len(blob), 0)
            if n != len(blob):
                raise BackendError(f"llama.cpp did not take the cartridge's sequence state (read {n} of {len(blob)} "
                                   "bytes); build the runtime with the option verbose=True to see llama.cpp's reason.")
            self.llm.input_ids[:p] = PLACEHOLDER_ID
            self._loaded = key
            self.loads += 1
        self.llm.n_tokens = p  # the cells 0..p-1 hold the cartridge; the next eval keeps them and removes the rest
        return p

    @property
    def installs(self) -> int:
        """Cartridge contents turned into llama.cpp's layout so far (each once while it stays)."""
        return self._blobs.made

    def _prompt(self, request: GenerationRequest) -> list[int]:
        return self.lm.prompt_ids(request.messages, prefix_ids=request.prefix_ids, after_cartridge=bool(request.cartridges))

    def _check_length(self, i: int | None, request: GenerationRequest) -> None:
        check_fits(request, len(self._prompt(request)), self.max_positions, f"the runtime's n_ctx={self.max_positions}",
                   index=i, fix=", or start the runtime with a larger n_ctx")

    def _check_fits(self, need: int, what: str, fix: str = "") -> None:
        if need > self.max_positions:
            raise ConfigError(f"{what} needs {need} positions, more than the runtime's n_ctx={self.max_positions}; "
                              f"{fix}start the runtime with a larger n_ctx.")

    def _decode(self, request: GenerationRequest) -> Iterator[tuple[list[int], list[np.ndarray], str | None]]:
        """The answer so far after each new token: its ids, each token's log-probs, and why it ended ("stop",
        "length") or None while it goes on."""
        import torch
        from llama_cpp import llama_cpp as C

        params = request.params
        prompt = self._prompt(request)[len(request.prefix_ids):]  # the document goes in first, on its own (below)
        self._load(request.cartridges)
        if request.prefix_ids:
            # the document first, in a batch of its own, as llama.cpp's prompt cache holds a prefix: llama.cpp's
            # numbers depend on how a prompt is split into batches (with flash attention, 0.22 nats between the
            # text and question in one batch or two, measured), and a cartridge is that split
            self.llm.eval(list(request.prefix_ids))
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        eos = self.lm.eos_token_ids
        n_vocab = self.llm.n_vocab()
        ids: list[int] = []
        logps: list[np.ndarray] = []
        step = prompt
        turn = self._turn
        for n in range(params.max_new_tokens):
            if self._turn != turn:
                raise BackendError("Another request used llama.cpp's sequence while this stream was paused; it keeps "
                                   "one sequence, so read a stream to its end before sending the next request.")
            self.llm.eval(step)
            logits = torch.from_numpy(np.ctypeslib.as_array(C.llama_get_logits_ith(self.llm.ctx, -1),
                                                            shape=(n_vocab,)).copy())
            token = int(sample_next(logits[None], params, generator)[0])
            ids.append(token)
            logps.append(logits.double().log_softmax(-1).numpy())
            stopped = ends_answer(self.lm, ids, params.stop, eos)
            reason = "stop" if stopped else "length" if n + 1 == params.max_new_tokens else None
            yield ids, logps, reason
            if reason:
                return
            step = [token]

    def _answer(self, request: GenerationRequest) -> Completion:
        ids, logps, reason = [], [], None
        for ids, logps, reason in self._decode(request):
            pass
        k = request.params.top_logprobs
        top_ids = top_lps = None
        if k:
            rows = np.stack(logps)
            top_ids = np.argsort(-rows, axis=1, kind="stable")[:, :k]
            top_lps = np.take_along_axis(rows, top_ids, axis=1).astype(np.float32)
        return Completion.from_ids(self.lm, ids, reason, stop=request.params.stop,
                                   top_ids=top_ids, top_logprobs=top_lps)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _blob(layout: Layout, cartridge: Cartridge, pairing: str) -> bytes:
    c = cartridge.in_key_pairing(pairing)
    return layout.blob([k.detach().float().cpu().numpy() for k in c.keys],
                       [v.detach().float().cpu().numpy() for v in c.values])


def _student_gguf(lm: Any) -> Path:
    """The GGUF the student's weights were read from (`load_model` keeps it), so the runtime runs the same model."""
    gguf = getattr(lm, "gguf", None)
    if gguf is None:
        raise ConfigError(f"{lm.name!r} was not loaded from a GGUF file, so llama.cpp has no model to run: pass the "
                          "option gguf= with its GGUF, or load the model from one (load_model('model.gguf')).")
    return Path(gguf)
