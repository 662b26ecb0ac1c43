"""For backend authors: tiny models, fakes, and the contract suite that proves a runtime or synthesizer right.

```python
from cartridges_sdk import testing

def test_my_runtime_keeps_the_contract():
    lm = testing.tiny_lm("llama")  # seconds to build, no files; or load_model() for the default model
    with MyRuntime.create(lm) as runtime:
        testing.check_runtime(runtime, lm)
```

Each check raises `ContractViolation` (an ``AssertionError``, so pytest shows it as a failure) whose message names
the check and what differed. The reference is always the student model's own forward pass in transformers: a
cartridge made from the first ``p`` tokens of a text must answer as that text in context does.
Importing this module imports transformers and tokenizers; the rest of the SDK never imports it.
"""

from __future__ import annotations

import contextlib
import itertools
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from .cartridge import Cartridge, CartridgeMeta
from .errors import CartridgeError, IncompatibleCartridgeError
from .plugins import ContinuousRuntime, Runtime, Synthesizer, SynthesizerCapabilities
from .requests import Completion, GenerationParams, GenerationRequest, SynthesisRequest

from .net import free_port  # noqa: F401  (tests and plugins start servers on it)
from .serve.background import serving  # noqa: F401

if TYPE_CHECKING:
    from .lm import LM

# makes the prefix cartridge of given token ids (see `check_runtime_exactness`)
PrefixMaker = Callable[[Sequence[int]], Cartridge]

# texts the contract suite makes cartridges from; plain ASCII so character-level tiny tokenizers can read them
CONTRACT_TEXTS = (
    "The Harrow Point lighthouse was built in 1871 by the engineer Margaret Ellison. Its granite came from the "
    "quarry at Dunmore, and its lamp burned colza oil until 1904, when a kerosene burner replaced it.",
    "Tides rise and fall twice a day because the moon pulls on the oceans; when sun and moon line up, the spring "
    "tides are the highest of the month, and at the quarter moons the neap tides are the lowest.",
    "A sourdough starter is flour and water kept warm for a week: wild yeasts and lactic bacteria settle in it, "
    "and a spoonful of it raises a whole loaf overnight, with a sour taste that plain yeast never gives.",
)
QUESTIONS = ("Who built it, and when?", "What does the text say about the moon?", "Summarise the text in one line.")


class ContractViolation(AssertionError):
    """A backend broke the contract; the message names the check and what differed."""


def _fail(check: str, detail: str) -> None:
    raise ContractViolation(f"[{check}] {detail}")


# ------------------------------------------------------------------------------------------------------------
# tiny models, built in memory in seconds


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)


def char_tokenizer(*, bos: bool, chat_template: str):
    """A character-level fast tokenizer built in memory (no files), with or without an automatic BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
    chars = sorted(set(string.printable))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>" if bos else "<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = chat_template
    return fast


def tiny_model(kind: str, vocab_size: int, seed: int = 0):
    """A random 3-layer Llama or Qwen2 with grouped-query attention (4 query heads, 2 KV heads), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=5))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0, eos_token_id=4, pad_token_id=5))
    else:
        raise ValueError(f"kind={kind!r} must be 'llama' or 'qwen2'.")
    return model.float().eval()


def tiny_lm(kind: str = "llama", seed: int = 0) -> LM:
    """A tiny random model with a character tokenizer as an `LM`: a Llama (with BOS) or a Qwen2 (ChatML, no BOS)."""
    from .models import load_model

    tok = char_tokenizer(bos=kind == "llama", chat_template=LLAMA_CHAT if kind == "llama" else CHATML)
    model = tiny_model(kind, len(tok), seed)
    model.config._name_or_path = f"tiny-{kind}-seed{seed}"
    return load_model(model, tok)


# ------------------------------------------------------------------------------------------------------------
# fakes, for unit tests of code that calls a backend


class FakeRuntime(Runtime):
    """Answers with queued texts in order (cycling), and records every request it was given."""

    def __init__(self, model: LM | None = None, *, answers: Iterable[str] = ("fake answer",)):
        self.lm = model
        self._answers = itertools.cycle(list(answers))
        self.requests: list[GenerationRequest] = []
        self.closed = False

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        out = []
        for r in requests:
            self.requests.append(r)
            text = next(self._answers)
            ids = tuple(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]) if self.lm else ()
            out.append(Completion(text=text, token_ids=ids, finish_reason="stop"))
        return out

    def close(self) -> None:
        self.closed = True


class FakeSynthesizer(Synthesizer):
    """Answers with queued texts in order (cycling), tokenized by the student's tokenizer, with made-up top-k
    (the sampled token first, uniform log-probs). Reports the student's identity; cannot score."""

    capabilities = SynthesizerCapabilities(max_top_logprobs=20)

    def __init__(self, model: LM, *, answers: Iterable[str] = ("A question about the text?", "An answer from it.")):
        self.lm = model
        self._answers = itertools.cycle(list(answers))
        self.requests: list[SynthesisRequest] = []

    def identity(self):
        return self.lm.identity

    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        vocab = self.lm.identity.architecture["vocab_size"]
        out = []
        for r in requests:
            self.requests.append(r)
            text = next(self._answers)
            ids = self.lm.tokenizer(text, add_special_tokens=False)["input_ids"][: r.max_tokens]
            k = r.top_logprobs
            top_ids = np.array([[(t + j) % vocab for j in range(k)] for t in ids]).reshape(len(ids), k) if k else None
            top_lps = np.full((len(ids), k), -np.log(k + 1)) if k else None
            out.append(Completion(text=text, token_ids=tuple(ids), finish_reason="length", top_ids=top_ids,
                                  top_logprobs=top_lps))
        return out


# ------------------------------------------------------------------------------------------------------------
# comparisons


def _reference_logp(lm: LM, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
    """The student's own log-probs ``[len(generated), vocab]`` at each generated position, teacher-forced."""
    ids = list(prompt) + list(generated)
    return lm.logits(ids)[len(prompt) - 1 : len(ids) - 1].log_softmax(-1).double().cpu().numpy()


def _topk_gap(reference: np.ndarray, top_ids: Any, top_lps: Any) -> tuple[float, float]:
    """(max |reference - backend| over the backend's top-k ids, max amount by which the backend's first choice
    trails the reference's best); both near 0 when the backend computes the same distribution."""
    top_ids = np.asarray(top_ids)
    at = np.take_along_axis(reference, top_ids, axis=1)
    diff = float(np.abs(at - np.asarray(top_lps, dtype=np.float64)).max())
    gap = float((reference.max(axis=1) - at[:, 0]).max())
    return diff, gap


def _compare_completions(check: str, what: str, a: Completion, b: Completion, tolerance: float) -> None:
    if tuple(a.token_ids) != tuple(b.token_ids):
        _fail(check, f"{what}: greedy tokens differ: {list(a.token_ids)} vs {list(b.token_ids)}.")
    if a.top_logprobs is not None and b.top_logprobs is not None:
        diff = float(np.abs(np.asarray(a.top_logprobs, np.float64) - np.asarray(b.top_logprobs, np.float64)).max())
        if diff > tolerance:
            _fail(check, f"{what}: top-k log-probs differ by {diff:.2e} (tolerance {tolerance:.0e}).")


def _has_topk(check: str, completion: Completion, k: int) -> None:
    n = len(completion.token_ids)
    for name in ("top_ids", "top_logprobs"):
        arr = getattr(completion, name)
        if arr is None or np.asarray(arr).shape != (n, k):
            got = None if arr is None else np.asarray(arr).shape
            _fail(check, f"asked for top_logprobs={k} but {name} has shape {got}, not ({n}, {k}).")


def _prefix_part(lm: LM, whole: Cartridge, start: int) -> Cartridge:
    """Tokens `start`.. of a prefix cartridge as a cartridge of their own (keys stay at their positions)."""
    meta = CartridgeMeta(model=whole.meta.model, num_tokens=whole.num_tokens - start, num_frozen=0)
    return Cartridge([k[:, start:] for k in whole.keys], [v[:, start:] for v in whole.values], meta, lm=lm)


def _greedy(k: int, n: int) -> GenerationParams:
    return GenerationParams(max_new_tokens=n, temperature=0.0, top_logprobs=k)


# ------------------------------------------------------------------------------------------------------------
# the runtime contract


def _prefix_maker(lm: LM, prefix: PrefixMaker | None) -> PrefixMaker:
    return prefix or (lambda ids: Cartridge.from_prefix(lm, list(ids), len(ids)))


def check_runtime_exactness(runtime: Runtime, lm: LM, *, sizes: Sequence[int] = (8, 24), top_k: int = 5,
                            max_new_tokens: int = 8, tolerance: float = 1e-4,
                            reference_tolerance: float | None = None, prefix: PrefixMaker | None = None) -> None:
    """A cartridge of a text's first p tokens answers like those tokens in context: the same greedy tokens and
    top-k log-probs (within `tolerance`) as the runtime with the tokens as plain prefix, and as the student's own
    forward pass (within `reference_tolerance`, default `tolerance`; engines with other kernels state theirs).

    `prefix` makes the cartridge of given token ids; by default the student's own forward (`Cartridge.from_prefix`).
    An engine whose numbers are not the student's (quantized weights, its own kernels) passes its own prefill, so
    exactness is checked inside the engine, and states its distance to the student in `reference_tolerance`."""
    check = "runtime exactness"
    prefix = _prefix_maker(lm, prefix)
    reference_tolerance = tolerance if reference_tolerance is None else reference_tolerance
    ids = lm.encode(CONTRACT_TEXTS[0])
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    for p in sizes:
        if p > len(ids):
            _fail(check, f"size {p} exceeds the contract text's {len(ids)} tokens; pass smaller sizes.")
        cartridge = prefix(ids[:p])
        with_cart, in_context, bare = runtime.generate([
            GenerationRequest(messages, [cartridge], _greedy(top_k, max_new_tokens)),
            GenerationRequest(messages, [], _greedy(top_k, max_new_tokens), prefix_ids=ids[:p]),
            GenerationRequest(messages, [], _greedy(top_k, max_new_tokens)),
        ])
        for c in (with_cart, in_context):
            _has_topk(check, c, top_k)
        _compare_completions(check, f"p={p}, cartridge vs the same tokens in context", with_cart, in_context, tolerance)
        prompt = ids[:p] + lm.chat_ids(messages, after_cartridge=True)
        diff, gap = _topk_gap(_reference_logp(lm, prompt, with_cart.token_ids), with_cart.top_ids, with_cart.top_logprobs)
        if diff > reference_tolerance or gap > reference_tolerance:
            _fail(check, f"p={p}: with the cartridge, top-k log-probs differ from the model's own forward pass with the "
                  f"text in context by {diff:.2e} (first-choice gap {gap:.2e}; tolerance {reference_tolerance:.0e}).")
        change = float(np.abs(np.asarray(bare.top_logprobs[0]) - np.asarray(with_cart.top_logprobs[0])).max()) \
            if bare.top_logprobs is not None else 0.0
        if bare.token_ids == with_cart.token_ids and change <= 10 * reference_tolerance:
            _fail(check, f"p={p}: the answer with the cartridge equals the answer with no context at all; "
                  "the runtime does not read the cartridge.")


def check_no_cross_talk(runtime: Runtime, lm: LM, *, top_k: int = 5, max_new_tokens: int = 8,
                        tolerance: float = 1e-4, prefix: PrefixMaker | None = None) -> None:
    """A batch whose requests carry different cartridges (and none, and two, and different lengths) answers each
    request as it is answered alone."""
    check = "no cross-talk"
    prefix = _prefix_maker(lm, prefix)
    carts = [prefix(lm.encode(text)[:n]) for text, n in zip(CONTRACT_TEXTS, (24, 9, 17))]
    params = _greedy(top_k, max_new_tokens)
    requests = [
        GenerationRequest([{"role": "user", "content": QUESTIONS[0]}], [carts[0]], params),
        GenerationRequest([{"role": "user", "content": QUESTIONS[1]}], [], params),
        GenerationRequest([{"role": "user", "content": QUESTIONS[2]}], [carts[1]], params),
        GenerationRequest([{"role": "user", "content": QUESTIONS[0]}], [carts[2]], params),
        GenerationRequest([{"role": "user", "content": QUESTIONS[1]}], [carts[1], carts[2]], params),
        GenerationRequest([{"role": "user", "content": QUESTIONS[0]}], [carts[0]], params),
    ]
    together = runtime.generate(requests)
    if len(together) != len(requests):
        _fail(check, f"{len(requests)} requests gave {len(together)} completions.")
    for i, (request, got) in enumerate(zip(requests, together)):
        (alone,) = runtime.generate([request])
        _compare_completions(check, f"request {i} in a batch vs alone", got, alone, tolerance)
    distinct = {tuple(np.round(np.asarray(c.top_logprobs[0], np.float64), 3)) for c in together[:5]}
    if len(distinct) < 3:
        _fail(check, "requests with different cartridges got the same first-token distribution; cartridges are mixed up "
              "or ignored.")


def check_composition(runtime: Runtime, lm: LM, *, top_k: int = 5, max_new_tokens: int = 8,
                      tolerance: float = 1e-4, prefix: PrefixMaker | None = None) -> None:
    """Two cartridges in one request, and `Cartridge.compose` of them, answer like their tokens in context, where
    positions allow (the second part's keys were computed after the first)."""
    check = "composition"
    prefix = _prefix_maker(lm, prefix)
    ids = lm.encode(CONTRACT_TEXTS[0] + " " + CONTRACT_TEXTS[1])
    first, total = 12, 30
    whole = prefix(ids[:total])
    head = prefix(ids[:first])
    tail = _prefix_part(lm, whole, first)
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    params = _greedy(top_k, max_new_tokens)
    two, composed, in_context = runtime.generate([
        GenerationRequest(messages, [head, tail], params),
        GenerationRequest(messages, [Cartridge.compose([head, tail])], params),
        GenerationRequest(messages, [], params, prefix_ids=ids[:total]),
    ])
    _compare_completions(check, "two cartridges vs their tokens in context", two, in_context, tolerance)
    _compare_completions(check, "Cartridge.compose vs the tokens in context", composed, in_context, tolerance)


def check_wrong_model_refused(runtime: Runtime, lm: LM) -> None:
    """A cartridge that records another model (same tensor shapes, other tokenizer) is refused with
    `IncompatibleCartridgeError` before the engine runs it."""
    check = "wrong model refused"
    good = Cartridge.from_prefix(lm, CONTRACT_TEXTS[0], 8)
    other = attrs.evolve(good.meta.model, name="another-model", tokenizer="0" * 16)
    alien = Cartridge(good.keys, good.values, attrs.evolve(good.meta, model=other))
    request = GenerationRequest([{"role": "user", "content": QUESTIONS[0]}], [alien], GenerationParams(max_new_tokens=2))
    try:
        runtime.generate([request])
    except IncompatibleCartridgeError as err:
        if "another-model" not in str(err):
            _fail(check, f"the error does not name the cartridge's model: {err}")
        return
    except Exception as err:  # noqa: BLE001 - any other failure is the wrong one
        _fail(check, f"expected IncompatibleCartridgeError, got {type(err).__name__}: {err}")
    _fail(check, "a cartridge made for another model was served.")


def check_stream(runtime: Runtime, lm: LM, *, max_new_tokens: int = 12) -> None:
    """Streamed pieces join to the answer `generate` gives, and the stream returns that answer's `Completion` (its
    tokens and finish reason, which a server reports as usage)."""
    request = GenerationRequest([{"role": "user", "content": QUESTIONS[0]}],
                                [Cartridge.from_prefix(lm, CONTRACT_TEXTS[0], 16)], GenerationParams(max_new_tokens=max_new_tokens))
    pieces, stream = [], runtime.stream(request)
    while True:
        try:
            pieces.append(next(stream))
        except StopIteration as end:
            final = end.value
            break
    (whole,) = runtime.generate([request])
    if "".join(pieces) != whole.text:
        _fail("stream", f"streamed text {''.join(pieces)!r} differs from the generated text {whole.text!r}.")
    if not isinstance(final, Completion) or (final.text, final.token_ids, final.finish_reason) != \
            (whole.text, whole.token_ids, whole.finish_reason):
        _fail("stream", f"the stream returned {final!r}, not the Completion generate gives ({whole!r}).")


def check_runtime(runtime: Runtime, lm: LM, *, tolerance: float = 1e-4, reference_tolerance: float | None = None,
                  prefix: PrefixMaker | None = None) -> None:
    """The whole runtime contract: exactness, no cross-talk, composition, a wrong-model cartridge refused, streaming.
    `prefix`: how prefix cartridges are made (see `check_runtime_exactness`)."""
    check_runtime_exactness(runtime, lm, tolerance=tolerance, reference_tolerance=reference_tolerance, prefix=prefix)
    check_no_cross_talk(runtime, lm, tolerance=tolerance, prefix=prefix)
    check_composition(runtime, lm, tolerance=tolerance, prefix=prefix)
    check_wrong_model_refused(runtime, lm)
    check_stream(runtime, lm)


# ------------------------------------------------------------------------------------------------------------
# the synthesizer contract


def check_synthesizer(synthesizer: Synthesizer, lm: LM, *, tolerance: float = 1e-4, max_tokens: int = 8) -> None:
    """The whole synthesizer contract, against the student's own forward pass (the HF teacher):

    - it serves the student's model: its identity matches field by field, or the same-model probe passes;
    - tokens sampled at temperature 0.7 come with the teacher's top-k for exactly those tokens, before temperature
      (ids and log-probs within `tolerance`), as many columns as asked, ending at a stop id or at `max_tokens`;
    - its capabilities are honest: it returns the top-k it claims, and scores given sequences exactly when it
      claims ``score`` (and refuses otherwise).
    """
    from .build.synthesis import teacher_prompt
    from .probe import check_same_model

    caps = synthesizer.capabilities
    if not isinstance(caps, SynthesizerCapabilities):
        _fail("capabilities", f"capabilities is {caps!r}, not a SynthesizerCapabilities.")
    try:
        check_same_model(lm, synthesizer)
    except CartridgeError as err:
        _fail("same model", str(err))
    k = min(5, caps.max_top_logprobs)
    stop_ids = tuple(sorted(lm.eos_token_ids))
    contexts = [lm.encode(t) for t in CONTRACT_TEXTS[:2]]
    requests = [
        SynthesisRequest(teacher_prompt(lm, contexts[g], [{"role": "user", "content": q}]), stop_ids, max_tokens,
                         temperature=0.7, top_logprobs=k, group=g, seed=10 * g + i)
        for g in range(2) for i, q in enumerate(QUESTIONS[:2])
    ]
    outs = synthesizer.complete(requests)
    if len(outs) != len(requests):
        _fail("sampling", f"{len(requests)} requests gave {len(outs)} completions.")
    for i, (r, out) in enumerate(zip(requests, outs)):
        ids = list(out.token_ids)
        if not ids or len(ids) > max_tokens:
            _fail("sampling", f"request {i}: {len(ids)} tokens for max_tokens={max_tokens}.")
        if out.finish_reason == "stop" and ids[-1] not in stop_ids:
            _fail("sampling", f"request {i}: finish_reason 'stop' but the last token {ids[-1]} is not a stop id {stop_ids}.")
        if out.finish_reason == "length" and len(ids) != max_tokens:
            _fail("sampling", f"request {i}: finish_reason 'length' after {len(ids)} of {max_tokens} tokens.")
        if k:
            _has_topk("teacher top-k", out, k)
            diff, gap = _topk_gap(_reference_logp(lm, r.prompt_ids, ids), out.top_ids, out.top_logprobs)
            if diff > tolerance or gap > tolerance:
                _fail("teacher top-k", f"request {i}: top-{k} log-probs differ from the student model's own forward by "
                      f"{diff:.2e} (first-choice gap {gap:.2e}; tolerance {tolerance:.0e}).")
    sequences = [lm.tokenizer(t, add_special_tokens=False)["input_ids"][:12] for t in CONTRACT_TEXTS[1:]]
    if caps.score:
        try:
            scored = synthesizer.score(contexts[0], sequences, max(k, 1))
        except Exception as err:  # noqa: BLE001 - whatever it raised, the claim was false
            _fail("capabilities", f"capabilities.score is True but score() failed: {type(err).__name__}: {err}")
        for seq, (top_ids, top_lps) in zip(sequences, scored):
            if np.asarray(top_ids).shape != (len(seq) - 1, max(k, 1)):
                _fail("scoring", f"score() returned shape {np.asarray(top_ids).shape} for a {len(seq)}-token sequence.")
            diff, gap = _topk_gap(_reference_logp(lm, contexts[0] + seq[:1], seq[1:]), top_ids, top_lps)
            if diff > tolerance or gap > tolerance:
                _fail("scoring", f"score() differs from the student model's own forward by {diff:.2e} "
                      f"(first-choice gap {gap:.2e}; tolerance {tolerance:.0e}).")
    else:
        try:
            synthesizer.score(contexts[0], sequences, 1)
        except CartridgeError:
            pass
        else:
            _fail("capabilities", "score() ran although capabilities.score is False; declare score=True.")


# ------------------------------------------------------------------------------------------------------------
# one request never fails another, behind `cartridges serve`

POISON = "POISON"  # a request whose last message holds this word makes a `Failing` runtime fail its batch


class _Gate:
    """Holds the engine thread in its next runtime call until `until()` holds, so the requests sent meanwhile queue
    up and go to the runtime as one batch (arrival timing must not decide what a check sees)."""

    def __init__(self) -> None:
        import threading

        self.until: Callable[[], bool] | None = None
        self.holding = threading.Event()

    def __call__(self) -> None:
        import time

        until, self.until = self.until, None
        if until is not None:
            self.holding.set()
            deadline = time.monotonic() + 60
            while not until() and time.monotonic() < deadline:
                time.sleep(0.01)


def _poisoned(request: GenerationRequest) -> bool:
    return POISON in request.messages[-1]["content"]


class FailingRuntime(Runtime):
    """A real runtime whose `generate` fails any batch holding a POISON request: an engine failure that one request
    triggers, for checking that the server fails that request alone."""

    def __init__(self, inner: Runtime):
        self.inner, self.gate = inner, _Gate()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        self.gate()
        if any(_poisoned(r) for r in requests):
            raise RuntimeError("the engine choked on a poisoned request")
        return self.inner.generate(requests)

    def stream(self, request: GenerationRequest):
        self.gate()
        pieces = self.inner.stream(request)
        if _poisoned(request):  # after its first piece: a failure mid-way
            yield next(pieces)
            pieces.close()
            raise RuntimeError("the engine choked on a poisoned request")
        return (yield from pieces)


class FailingContinuousRuntime(ContinuousRuntime):
    """A real continuous runtime whose every third `step` fails while a POISON request is in the engine (after the
    step ran, so streams have shown text and the others' progress is lost with it)."""

    def __init__(self, inner: ContinuousRuntime):
        self.inner, self.gate, self.poisoned, self.steps = inner, _Gate(), set(), 0

    def add(self, request: GenerationRequest) -> str:
        handle = self.inner.add(request)
        if _poisoned(request):
            self.poisoned.add(handle)
        return handle

    def step(self) -> list[tuple[str, Completion, bool]]:
        self.gate()
        progress = self.inner.step()
        if self.poisoned & {h for h, _, _ in progress}:  # decoding now, with whatever shares its batch
            self.steps += 1
            if self.steps % 3 == 0:
                raise RuntimeError("the engine choked on a poisoned request")
        self.poisoned -= {h for h, _, ended in progress if ended}
        return progress

    def abort(self, handle: str) -> None:
        self.poisoned.discard(handle)
        self.inner.abort(handle)


def failing(runtime: Runtime) -> Runtime:
    """`runtime`, failing whatever batch a POISON request is in (`FailingContinuousRuntime` or `FailingRuntime`)."""
    return FailingContinuousRuntime(runtime) if isinstance(runtime, ContinuousRuntime) else FailingRuntime(runtime)


def chat_answer(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, answer text or error message) of one chat completion from the server at `url` (its ``/v1`` base),
    streamed or not as `body` says; a stream must end with ``[DONE]``, failed ones too."""
    import json

    import httpx

    if not body.get("stream"):
        r = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=300)
        data = r.json()
        return r.status_code, data["choices"][0]["message"]["content"] if r.status_code == 200 else \
            data["error"]["message"]
    text, error, done = "", None, False
    with httpx.stream("POST", f"{url}/chat/completions", json=body, headers=headers, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(r.read())["error"]["message"]
        for line in r.iter_lines():
            done = done or line == "data: [DONE]"
            event = json.loads(line[6:]) if line.startswith("data: {") else {}
            if "error" in event:
                error = event["error"]["message"]
            elif event.get("choices"):
                text += event["choices"][0]["delta"].get("content") or ""
    if not done:
        _fail("stream", "a stream ended without [DONE]")
    return (500, error) if error is not None else (200, text)


def check_one_request_fails_alone(runtime: Runtime, store: Any, names: Sequence[str], *, max_new_tokens: int = 12,
                                  poison: dict[str, Any] | None = None) -> None:
    """Behind `cartridges serve` on 127.0.0.1: 8 concurrent requests over the store's cartridges `names` (every
    third one streamed, on a continuous runtime, whose batches hold streams; a plain runtime answers each stream
    alone), sent while the engine is held so they reach the runtime as one batch; one of them is
    `poison` (a request body), or else one that makes `failing(runtime)` fail its batch. That one gets an error
    (400 for a body the server refuses, 500 for a failed engine) and every other gets the answer it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from .serve.server import ServeConfig, create_app

    served = failing(runtime) if poison is None else runtime
    app = create_app(store, served, ServeConfig(max_batch=16))
    questions = [f"What does the text say? ({i})" for i in range(8)]
    streams = isinstance(runtime, ContinuousRuntime)
    jobs = [{"model": names[i % len(names)], "messages": [{"role": "user", "content": q}], "temperature": 0,
             "max_tokens": max_new_tokens, "stream": streams and i % 3 == 0} for i, q in enumerate(questions)]
    want = [store.model.ask(j["messages"][0]["content"], cartridges=[store.get(j["model"])], runtime=runtime,
                            max_new_tokens=max_new_tokens) for j in jobs]
    jobs[3] = poison or {**jobs[3], "messages": [{"role": "user", "content": f"Tell me about {POISON}."}]}

    with serving(app) as url, ThreadPoolExecutor(len(jobs) + 1) as pool:
        gate = getattr(served, "gate", None)
        if gate is not None:  # a first request holds the engine while the 8 queue up
            gate.until = lambda: app.state.engine.jobs.qsize() >= len(jobs)
            first = pool.submit(chat_answer, url, {**jobs[1], "stream": False})
            if not gate.holding.wait(120):
                _fail("isolation", "the engine never called the runtime")
        got = list(pool.map(lambda j: chat_answer(url, j), jobs))
        for i, ((status, text), expected) in enumerate(zip(got, want)):
            if i == 3 and (status < 400 or (poison is None and "poisoned" not in text)):
                _fail("isolation", f"the poisoned request got {status}: {text[:200]!r}")
            if i != 3 and (status, text) != (200, expected):
                _fail("isolation", f"request {i} got {status} {text[:200]!r}, alone it gets {expected!r}")
        if gate is not None:
            if first.result()[0] != 200:
                _fail("isolation", f"the first request failed: {first.result()}")
            if app.state.engine.replayed < 2:
                _fail("isolation", "the poisoned batch was never answered again in smaller batches")
        if chat_answer(url, {**jobs[0], "stream": False}) != (200, want[0]):
            _fail("isolation", "the server did not answer the next request")
