"""The contract suite: checks that a runtime or synthesizer computes what the student model computes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ..cartridge import Cartridge
from ..errors import CartridgeError, ContractViolation, IncompatibleCartridgeError
from ..fileformat import CartridgeMeta
from ..generation import Completion, GenerationParams, GenerationRequest, SynthesisRequest
from ..plugins import Runtime, Synthesizer, SynthesizerCapabilities
from ..probe import check_same_model

if TYPE_CHECKING:
    from ..lm import LM


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


def fail(check: str, detail: str) -> None:
    raise ContractViolation(f"[{check}] {detail}")


# ------------------------------------------------------------------------------------------------------------
# tiny models, built in memory in seconds


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
        fail(check, f"{what}: greedy tokens differ: {list(a.token_ids)} vs {list(b.token_ids)}.")
    if a.top_logprobs is not None and b.top_logprobs is not None:
        diff = float(np.abs(np.asarray(a.top_logprobs, np.float64) - np.asarray(b.top_logprobs, np.float64)).max())
        if diff > tolerance:
            fail(check, f"{what}: top-k log-probs differ by {diff:.2e} (tolerance {tolerance:.0e}).")


def _has_topk(check: str, completion: Completion, k: int) -> None:
    n = len(completion.token_ids)
    for name in ("top_ids", "top_logprobs"):
        arr = getattr(completion, name)
        if arr is None or np.asarray(arr).shape != (n, k):
            got = None if arr is None else np.asarray(arr).shape
            fail(check, f"asked for top_logprobs={k} but {name} has shape {got}, not ({n}, {k}).")


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
            fail(check, f"size {p} exceeds the contract text's {len(ids)} tokens; pass smaller sizes.")
        cartridge = prefix(ids[:p])
        with_cart, in_context, bare = runtime.generate([
            GenerationRequest(messages, [cartridge], _greedy(top_k, max_new_tokens)),
            GenerationRequest(messages, [], _greedy(top_k, max_new_tokens), prefix_ids=ids[:p]),
            GenerationRequest(messages, [], _greedy(top_k, max_new_tokens)),
        ])
        for c in (with_cart, in_context):
            _has_topk(check, c, top_k)
        _compare_completions(check, f"p={p}, cartridge vs the same tokens in context", with_cart, in_context, tolerance)
        prompt = lm.prompt_ids(messages, prefix_ids=ids[:p])
        diff, gap = _topk_gap(_reference_logp(lm, prompt, with_cart.token_ids), with_cart.top_ids, with_cart.top_logprobs)
        if diff > reference_tolerance or gap > reference_tolerance:
            fail(check, f"p={p}: with the cartridge, top-k log-probs differ from the model's own forward pass with the "
                  f"text in context by {diff:.2e} (first-choice gap {gap:.2e}; tolerance {reference_tolerance:.0e}).")
        change = float(np.abs(np.asarray(bare.top_logprobs[0]) - np.asarray(with_cart.top_logprobs[0])).max()) \
            if bare.top_logprobs is not None else 0.0
        if bare.token_ids == with_cart.token_ids and change <= 10 * reference_tolerance:
            fail(check, f"p={p}: the answer with the cartridge equals the answer with no context at all; "
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
        fail(check, f"{len(requests)} requests gave {len(together)} completions.")
    for i, (request, got) in enumerate(zip(requests, together)):
        (alone,) = runtime.generate([request])
        _compare_completions(check, f"request {i} in a batch vs alone", got, alone, tolerance)
    distinct = {tuple(np.round(np.asarray(c.top_logprobs[0], np.float64), 3)) for c in together[:5]}
    if len(distinct) < 3:
        fail(check, "requests with different cartridges got the same first-token distribution; cartridges are mixed up "
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
            fail(check, f"the error does not name the cartridge's model: {err}")
        return
    except Exception as err:  # noqa: BLE001 - any other failure is the wrong one
        fail(check, f"expected IncompatibleCartridgeError, got {type(err).__name__}: {err}")
    fail(check, "a cartridge made for another model was served.")


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
        fail("stream", f"streamed text {''.join(pieces)!r} differs from the generated text {whole.text!r}.")
    if not isinstance(final, Completion) or (final.text, final.token_ids, final.finish_reason) != \
            (whole.text, whole.token_ids, whole.finish_reason):
        fail("stream", f"the stream returned {final!r}, not the Completion generate gives ({whole!r}).")


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
    caps = synthesizer.capabilities
    if not isinstance(caps, SynthesizerCapabilities):
        fail("capabilities", f"capabilities is {caps!r}, not a SynthesizerCapabilities.")
    try:
        check_same_model(lm, synthesizer)
    except CartridgeError as err:
        fail("same model", str(err))
    k = min(5, caps.max_top_logprobs)
    contexts = [lm.encode(t) for t in CONTRACT_TEXTS[:2]]
    _check_sampling(synthesizer, lm, contexts, k, tolerance, max_tokens)
    _check_scoring(synthesizer, lm, contexts[0], k, tolerance)


def _check_sampling(synthesizer: Synthesizer, lm: LM, contexts: list[list[int]], k: int, tolerance: float,
                    max_tokens: int) -> None:
    """Sampled tokens end as the request says and carry the teacher's own top-k for exactly those tokens."""
    stop_ids = tuple(sorted(lm.eos_token_ids))
    requests = [
        SynthesisRequest(lm.prompt_ids([{"role": "user", "content": q}], prefix_ids=contexts[g]), stop_ids, max_tokens,
                         temperature=0.7, top_logprobs=k, group=g, seed=10 * g + i)
        for g in range(2) for i, q in enumerate(QUESTIONS[:2])
    ]
    outs = synthesizer.complete(requests)
    if len(outs) != len(requests):
        fail("sampling", f"{len(requests)} requests gave {len(outs)} completions.")
    for i, (r, out) in enumerate(zip(requests, outs)):
        ids = list(out.token_ids)
        if not ids or len(ids) > max_tokens:
            fail("sampling", f"request {i}: {len(ids)} tokens for max_tokens={max_tokens}.")
        if out.finish_reason == "stop" and ids[-1] not in stop_ids:
            fail("sampling", f"request {i}: finish_reason 'stop' but the last token {ids[-1]} is not a stop id {stop_ids}.")
        if out.finish_reason == "length" and len(ids) != max_tokens:
            fail("sampling", f"request {i}: finish_reason 'length' after {len(ids)} of {max_tokens} tokens.")
        if k:
            _has_topk("teacher top-k", out, k)
            diff, gap = _topk_gap(_reference_logp(lm, r.prompt_ids, ids), out.top_ids, out.top_logprobs)
            if diff > tolerance or gap > tolerance:
                fail("teacher top-k", f"request {i}: top-{k} log-probs differ from the student model's own forward by "
                      f"{diff:.2e} (first-choice gap {gap:.2e}; tolerance {tolerance:.0e}).")


def _check_scoring(synthesizer: Synthesizer, lm: LM, context: list[int], k: int, tolerance: float) -> None:
    """`score` gives the teacher's own top-k for given sequences when the capabilities claim it, and refuses
    otherwise."""
    sequences = [lm.tokenizer(t, add_special_tokens=False)["input_ids"][:12] for t in CONTRACT_TEXTS[1:]]
    if not synthesizer.capabilities.score:
        try:
            synthesizer.score(context, sequences, 1)
        except CartridgeError:
            return
        fail("capabilities", "score() ran although capabilities.score is False; declare score=True.")
    try:
        scored = synthesizer.score(context, sequences, max(k, 1))
    except Exception as err:  # noqa: BLE001 - whatever it raised, the claim was false
        fail("capabilities", f"capabilities.score is True but score() failed: {type(err).__name__}: {err}")
    for seq, (top_ids, top_lps) in zip(sequences, scored):
        if np.asarray(top_ids).shape != (len(seq) - 1, max(k, 1)):
            fail("scoring", f"score() returned shape {np.asarray(top_ids).shape} for a {len(seq)}-token sequence.")
        diff, gap = _topk_gap(_reference_logp(lm, context + seq[:1], seq[1:]), top_ids, top_lps)
        if diff > tolerance or gap > tolerance:
            fail("scoring", f"score() differs from the student model's own forward by {diff:.2e} "
                  f"(first-choice gap {gap:.2e}; tolerance {tolerance:.0e}).")


# ------------------------------------------------------------------------------------------------------------
# one request never fails another, behind `cartridges serve`
