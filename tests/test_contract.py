"""The contract suite (`cartridges_sdk.testing`) on the built-in HF backend, and on backends broken on purpose:
each break must be caught with a message that names it."""

from __future__ import annotations

import numpy as np
import pytest

from cartridges_sdk import Cartridge, testing
from cartridges_sdk.hf import HFRuntime, HFSynthesizer
from cartridges_sdk.generation import Completion, GenerationRequest
from cartridges_sdk.testing import ContractViolation


def test_hf_runtime_keeps_the_contract(tiny_lm):
    with HFRuntime.create(tiny_lm) as runtime:
        testing.check_runtime(runtime, tiny_lm)


def test_hf_synthesizer_keeps_the_contract(tiny_lm):
    testing.check_synthesizer(HFSynthesizer.create(tiny_lm), tiny_lm)


@pytest.mark.default_model
def test_hf_backend_keeps_the_contract_on_the_default_model(default_lm):
    testing.check_runtime(HFRuntime.create(default_lm), default_lm)
    testing.check_synthesizer(HFSynthesizer.create(default_lm), default_lm)


class IgnoresCartridges(HFRuntime):
    def generate(self, requests):
        import attrs

        return super().generate([attrs.evolve(r, cartridges=()) for r in requests])


class IgnoresEverythingBeforeTheChat(HFRuntime):
    def generate(self, requests):
        import attrs

        return super().generate([attrs.evolve(r, cartridges=(), prefix_ids=()) for r in requests])


class MixesUpBatches(HFRuntime):
    """Serves every request of a batch with the first request's cartridges."""

    def generate(self, requests):
        import attrs

        return super().generate([attrs.evolve(r, cartridges=requests[0].cartridges) for r in requests])


class ServesAnyModel(HFRuntime):
    def _check(self, requests):  # renders the prompts but refuses nothing
        return [self._prompt(r) for r in requests]

    def _install(self, cartridge):
        return list(zip(cartridge.keys, cartridge.values))


@pytest.mark.parametrize("broken, check, message", [
    (IgnoresCartridges, testing.check_runtime_exactness, "cartridge vs the same tokens in context"),
    (IgnoresEverythingBeforeTheChat, testing.check_runtime_exactness, "does not read the cartridge|differ from the model"),
    (MixesUpBatches, testing.check_no_cross_talk, r"\[no cross-talk\] request \d in a batch vs alone"),
    (ServesAnyModel, testing.check_wrong_model_refused, "served"),
])
def test_broken_runtimes_are_caught(tiny_llama, broken, check, message):
    with pytest.raises(ContractViolation, match=message):
        check(broken(tiny_llama), tiny_llama)


class OtherModelsTopK(HFSynthesizer):
    """Reports the student's identity but samples from another model (another seed of the same architecture)."""

    def __init__(self, lm, other):
        super().__init__(other)
        self.student = lm

    def identity(self):
        return self.student.identity


class LiesAboutScoring(HFSynthesizer):
    def score(self, *args, **kwargs):
        raise NotImplementedError("no scoring here")


class ShortTopK(HFSynthesizer):
    def complete(self, requests):
        return [Completion(c.text, c.token_ids, c.finish_reason, c.top_ids[:, :2] if c.top_ids is not None else None,
                           c.top_logprobs[:, :2] if c.top_logprobs is not None else None)
                for c in super().complete(requests)]


class AfterTemperature(HFSynthesizer):
    """Right model, but its log-probs are taken after temperature (a classic engine setting), renormalised over top-k."""

    def complete(self, requests):
        out = []
        for r, c in zip(requests, super().complete(requests)):
            if c.top_logprobs is not None and r.temperature > 0:
                scaled = c.top_logprobs / r.temperature
                c = Completion(c.text, c.token_ids, c.finish_reason, c.top_ids,
                               scaled - np.log(np.exp(scaled).sum(-1, keepdims=True)))
            out.append(c)
        return out


def test_a_synthesizer_with_another_models_topk_is_caught(tiny_llama):
    other = testing.tiny_lm("llama", seed=1)
    with pytest.raises(ContractViolation, match=r"\[same model\] OtherModelsTopK does not serve the student's model"):
        testing.check_synthesizer(OtherModelsTopK(tiny_llama, other), tiny_llama)
    with pytest.raises(ContractViolation, match=r"\[teacher top-k\].*differ from the student model's own forward"):
        testing.check_synthesizer(AfterTemperature(tiny_llama), tiny_llama)


def test_dishonest_capabilities_are_caught(tiny_llama):
    with pytest.raises(ContractViolation, match=r"capabilities.score is True but score\(\) failed.*no scoring here"):
        testing.check_synthesizer(LiesAboutScoring(tiny_llama), tiny_llama)
    with pytest.raises(ContractViolation, match=r"top-k arrays of shape \(\d+, 2\), not \(\d+, 5\)"):
        testing.check_synthesizer(ShortTopK(tiny_llama), tiny_llama)


def test_fakes_answer_in_order_and_record_requests(tiny_llama):
    rt = testing.FakeRuntime(tiny_llama, answers=["one", "two"])
    c = Cartridge.from_prefix(tiny_llama, testing.CONTRACT_TEXTS[0], 8)
    outs = rt.generate([GenerationRequest([{"role": "user", "content": q}], [c]) for q in "abc"])
    assert [o.text for o in outs] == ["one", "two", "one"] and len(rt.requests) == 3
    assert c.ask("x", runtime=rt) == "two"
    synth = testing.FakeSynthesizer(tiny_llama, answers=["hi there"])
    (out,) = synth.complete([testing.SynthesisRequest([1, 2, 3], max_tokens=4, top_logprobs=3)])
    assert out.text == "hi there" and out.top_ids.shape == (4, 3) and np.all(out.top_logprobs < 0)
