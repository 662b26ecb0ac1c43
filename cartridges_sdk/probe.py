"""The same-model probe: does a synthesizer (an engine, a server) compute what the student model computes?

A fixed document and question are answered greedily by the synthesizer with top-k log-probabilities, and the student
scores the same tokens with its own forward; a backend with several servers compares their answers with
`probe_gap`. Self-study refuses a teacher that fails it (`check_same_model`), and backends use it to vet servers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import IncompatibleCartridgeError
from .generation import Completion, SynthesisRequest
from .lm import LM
from .plugins import Synthesizer

# the same-model probe: a fixed document and question, answered greedily by the synthesizer and scored by the student
PROBE_DOCUMENT = (
    "The Harrow Point lighthouse stands on a granite spur at the mouth of the estuary. Its lamp was first lit in "
    "1871, and three families of keepers tended it until the light was automated."
)
PROBE_QUESTION = "When was the lamp first lit, and who tended it?"
PROBE_TOKENS = 8
PROBE_TOP_K = 5
# max |teacher log-prob - student log-prob| over the probe's top-k tokens. Measured on the default model against
# its own fp32 forward: fp32 2e-5 nats, fp16 autocast 0.015, bf16 autocast 0.11, bf16 weights 0.17 (so a bf16 server
# passes); a model of the same architecture with other weights differs by whole nats (tests: tiny seeds 0 and 1)
PROBE_TOLERANCE = 0.5


def probe_model(lm: LM, synthesizer: Synthesizer, tolerance: float = PROBE_TOLERANCE) -> dict[str, Any]:
    """Ask the synthesizer for a fixed greedy answer with top-k log-probs and score the same tokens with the
    student's own forward. Returns the figures; raises `IncompatibleCartridgeError` when they disagree."""
    k = min(PROBE_TOP_K, synthesizer.capabilities.max_top_logprobs)
    name = synthesizer.describe()
    if k == 0:
        raise IncompatibleCartridgeError(
            f"{name} neither reports its model's identity nor returns log-probabilities, so nothing shows it serves "
            f"{lm.name!r}; use a synthesizer that does one of the two, or pass allow_unverified_model=True (recorded)."
        )
    request = probe_request(lm, k)
    (out,) = synthesizer.complete([request])
    return check_probe(lm, name, request, out, tolerance)


def probe_request(lm: LM, top_k: int) -> SynthesisRequest:
    """The probe's fixed greedy request (a backend with several servers sends it to each; see `check_probe`)."""
    prompt = lm.prompt_ids([{"role": "user", "content": PROBE_QUESTION}], prefix_ids=lm.encode(PROBE_DOCUMENT))
    return SynthesisRequest(prompt, tuple(sorted(lm.eos_token_ids)), PROBE_TOKENS, 0.0, top_k, None, 0)


def check_probe(lm: LM, name: str, request: SynthesisRequest, out: Completion,
                tolerance: float = PROBE_TOLERANCE) -> dict[str, Any]:
    """The probe's figures for the answer `out` of the synthesizer `name`; raises `IncompatibleCartridgeError`
    when its log-probs are not the student's."""
    prompt, k = list(request.prompt_ids), request.top_logprobs
    ids = list(out.token_ids)
    top_ids, top_lps = np.asarray(out.top_ids), np.asarray(out.top_logprobs, dtype=np.float64)
    if not ids or top_ids.shape != (len(ids), k) or top_lps.shape != (len(ids), k):
        raise IncompatibleCartridgeError(
            f"{name} answered the same-model probe with {len(ids)} token(s) and top-k arrays of shape "
            f"{top_ids.shape}, not ({len(ids)}, {k}); it does not follow the Synthesizer contract."
        )
    vocab = lm.identity.architecture["vocab_size"]
    if top_ids.min() < 0 or top_ids.max() >= vocab or min(ids) < 0 or max(ids) >= vocab:
        raise IncompatibleCartridgeError(
            f"{name} returned token ids outside the student's vocabulary [0, {vocab}): it serves another tokenizer."
        )
    student = lm.logits(prompt + ids)[len(prompt) - 1 : -1].log_softmax(-1).double().cpu().numpy()
    at_teacher_ids = np.take_along_axis(student, top_ids, axis=1)
    diff = float(np.abs(at_teacher_ids - top_lps).max())
    # the teacher's first choice must be (within tolerance) the student's first choice too
    rank_gap = float((student.max(axis=1) - at_teacher_ids[:, 0]).max())
    record = {"method": "probe", "tokens": len(ids), "top_k": k, "max_logprob_diff": round(diff, 6),
              "max_rank_gap": round(rank_gap, 6), "tolerance": tolerance}
    if diff > tolerance or rank_gap > tolerance:
        raise IncompatibleCartridgeError(
            f"{name} does not serve the student's model {lm.name!r}: on a fixed probe its top-{k} log-probabilities "
            f"differ from the student's by up to {diff:.3f} nats (first-choice gap {rank_gap:.3f}; tolerance "
            f"{tolerance}). Point it at the same model and tokenizer as the student."
        )
    return record


def probe_gap(a: Completion, b: Completion) -> float:
    """How far apart two answers to the probe are, in nats (several servers behind one synthesizer must agree).

    Compared up to the first position where the greedy tokens differ (the contexts are the same until there): the
    largest log-prob difference of a candidate both list; a first choice missing from the other's top-k is infinitely
    far."""
    if a.top_ids is None or b.top_ids is None:
        return math.inf
    n = min(len(a.token_ids), len(b.token_ids))
    upto = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), n - 1) + 1
    gap = math.inf if n == 0 else 0.0
    for row in range(min(upto, n)):
        da = dict(zip(np.asarray(a.top_ids)[row].tolist(), np.asarray(a.top_logprobs)[row].tolist()))
        db = dict(zip(np.asarray(b.top_ids)[row].tolist(), np.asarray(b.top_logprobs)[row].tolist()))
        firsts = {int(np.asarray(a.top_ids)[row][0]), int(np.asarray(b.top_ids)[row][0])}
        if not firsts <= (da.keys() & db.keys()):
            return math.inf
        gap = max(gap, max(abs(da[i] - db[i]) for i in da.keys() & db.keys()))
    return gap


def check_same_model(lm: LM, synthesizer: Synthesizer, *, allow_unverified_model: bool = False) -> dict[str, Any]:
    """Refuse a synthesizer that does not serve the student's model; return how it was checked (for the header).

    Its identity, when reported, is compared field by field, and a field both sides report that differs is always
    refused. Then, whenever it returns log-probabilities, the probe checks what it computes (a backend can report
    the right identity and still run other weights); one that cannot be probed passes on a complete identity alone.
    When nothing proves the model, only ``allow_unverified_model=True`` proceeds, and the header records why.
    """
    name = synthesizer.describe()
    identity = synthesizer.identity()
    complete = identity is not None and identity.mismatch(lm.identity, strict=True) is None
    if identity is not None and identity.mismatch(lm.identity):
        raise IncompatibleCartridgeError(
            f"The synthesizer {name} serves model {identity.name!r} but the student is {lm.name!r} "
            f"({identity.mismatch(lm.identity)}); self-study needs the same model on both sides."
        )
    try:
        if synthesizer.capabilities.max_top_logprobs == 0 and complete:
            return {"method": "identity", "fingerprint": identity.fingerprint}
        return {**probe_model(lm, synthesizer), "identity": "complete" if complete else "partial or none"}
    except IncompatibleCartridgeError as err:
        if not allow_unverified_model:
            raise
        return {"method": "override", "allow_unverified_model": True, "unverified_because": str(err)}
