"""Bad inputs, as a demanding user makes them: each is refused before any work with an error that names the setting,
the value and the fix (CLI: one `error:` line, exit 2), or succeeds without losing or mixing data."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from cartridges_sdk import Cartridge, CartridgeFormatError, ConfigError, Corpus
from cartridges_sdk.cli import main
from cartridges_sdk.making.dataset import SelfStudyDataset
from cartridges_sdk.hf import HFSynthesizer

from conftest import TEXT

TINY = dict(num_conversations=2, conversations_per_chunk=2, min_chunk=60, max_chunk=100, max_tokens_a=6,
            max_tokens_b=6, document_windows=2, window_tokens=16, top_k=4, progress=False)


class Spy(HFSynthesizer):
    """The HF synthesizer, counting the calls that reach it."""

    def __init__(self, lm):
        super().__init__(lm)
        self.calls = 0

    def complete(self, requests):
        self.calls += 1
        return super().complete(requests)


def _build(lm, folder, **kw):
    return Cartridge.from_corpus(TEXT, lm, **{"num_tokens": 16, **TINY, "output_dir": folder, **kw})


# -- 1. every setting of every stage, before synthesis -----------------------------------------------------------

@pytest.mark.parametrize("setting, message", [
    ({"lr": 0}, "lr=0 must be > 0"),
    ({"lr": "abc"}, "lr='abc' must be a finite number"),
    ({"lr": float("nan")}, "lr=nan must be a finite number"),
    ({"epochs": 0}, "epochs=0 must be >= 1"),
    ({"epochs": 1.5}, "epochs=1.5 must be an integer"),
    ({"batch_tokens": -1}, "batch_tokens=-1 must be >= 1"),
    ({"schedule": "linear"}, "schedule='linear' must be one of"),
    ({"conversation_weight": -1}, "conversation_weight=-1 must be >= 0"),
    ({"num_tokens": 0}, "num_tokens=0 must be an int greater than num_frozen=1"),
    ({"num_tokens": -1}, "num_tokens=-1 must be an int"),
    ({"num_tokens": 8, "num_frozen": 9}, "num_tokens=8 must be an int greater than num_frozen=9"),
    ({"top_k": 10**6}, r"top_k=1000000 but Spy returns at most \d+ log-probabilities.*set top_k <= \d+"),
    ({"init": "zeros"}, "init='zeros' must be one of"),
    ({"temperature_b": -0.5}, "temperature_b=-0.5 must be >= 0"),
    ({"max_chunk": 10, "min_chunk": 20}, "max_chunk=10 must be >= min_chunk=20"),
    ({"learning_rate": 0.1}, r"Unknown setting\(s\) \['learning_rate'\]"),
    ({"work_dtype": "int4"}, "dtype='int4' is not supported"),
])
def test_bad_settings_are_refused_before_synthesis(tiny_llama, tmp_path, setting, message):
    spy = Spy(tiny_llama)
    with pytest.raises(ConfigError, match=message):
        _build(tiny_llama, tmp_path / "w", synthesizer=spy, **setting)
    assert spy.calls == 0 and not (tmp_path / "w" / "data" / "header.json").exists()


def test_a_synthesizer_by_name_that_narrows_its_top_k_is_checked_as_built(tiny_llama, tmp_path):
    """The HF synthesizer's class declares 1024 log-probs; the one built for a model of a smaller vocabulary caps
    top-k at that vocabulary, and a top_k between the two is refused before synthesis, not inside it."""
    vocab = tiny_llama.identity.architecture["vocab_size"]
    assert vocab < 1024
    with pytest.raises(ConfigError, match=rf"top_k={vocab + 1} but synthesizer 'hf' returns at most {vocab}"):
        _build(tiny_llama, tmp_path / "w", synthesizer="hf", top_k=vocab + 1)
    assert not (tmp_path / "w" / "data" / "header.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--set", "lr=abc"], "lr='abc' must be a finite number"),
    (["--set", "lr"], "--set 'lr' must look like key=value"),
    (["--epochs", "0"], "epochs=0 must be >= 1"),
    (["--set", "epochs=2"], r"\['epochs'\] are arguments of their own \(--epochs on the command line\)"),
    (["--tokens", "0"], "num_tokens=0 must be an int greater than num_frozen=1"),
    (["--set", "nope=1"], r"Unknown setting\(s\) \['nope'\]"),
    (["--backend-option", "colour=red"], "not an option of any backend"),
    (["--synthesizer", "nope"], "No synthesizer named 'nope'"),
    (["--set", "top_k=21", "--synthesizer", "hf", "--backend-option", "synthesizer.autocast_dtype=int8"],
     "autocast_dtype='int8' must be one of"),
])
def test_cli_refuses_bad_settings_before_loading_a_model(tmp_path, capsys, monkeypatch, args, message):
    import re

    import cartridges_sdk.cli.common as cli

    monkeypatch.setattr(cli, "model_for", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    corpus = tmp_path / "doc.txt"
    corpus.write_text(TEXT)
    base = ["build", str(corpus), "-o", str(tmp_path / "c.safetensors"), "--tokens", "16"]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), err


# -- 2. the corpus is never guessed ----------------------------------------------------------------------------

def test_the_corpus_is_never_guessed(tmp_path):
    with pytest.raises(ConfigError, match="'harow_point.txt' looks like a path, but no file or folder is there.*from_texts"):
        Corpus.coerce("harow_point.txt")
    with pytest.raises(ConfigError, match="looks like a path"):
        Corpus.coerce("docs/intro.md")
    for empty in ("", "   \n"):
        with pytest.raises(ConfigError, match="The corpus is empty"):
            Corpus.coerce(empty)
    with pytest.raises(ConfigError, match="No file or folder at"):
        Corpus.coerce(tmp_path / "missing")
    for wrong in (None, 42, [], [1, 2]):
        with pytest.raises(ConfigError, match="Cannot make a corpus"):
            Corpus.coerce(wrong)
    (tmp_path / "real.txt").write_text("A real file.")
    assert Corpus.coerce(str(tmp_path / "real.txt")).documents[0].text == "A real file."
    assert Corpus.coerce("The lamp was lit in 1871.").text == "The lamp was lit in 1871."
    assert Corpus.coerce(Corpus.from_texts("harow_point.txt")).text == "harow_point.txt"  # said outright: text


def test_from_corpus_with_a_mistyped_path_does_no_work(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="looks like a path"):
        Cartridge.from_corpus("harow_point.txt", tiny_llama, num_tokens=8, output_dir=tmp_path / "w")
    assert not (tmp_path / "w").exists()


# -- 3. resume is safe by construction --------------------------------------------------------------------------

def test_resume_refuses_other_settings_by_name_and_restart_starts_over(tiny_llama, tmp_path):
    first = _build(tiny_llama, tmp_path / "w")
    again = _build(tiny_llama, tmp_path / "w")  # same settings: the finished run is reused, not mixed
    assert all(torch.equal(a, b) for a, b in zip(first.keys, again.keys))
    for changed, named in [
        ({"init": "random_text"}, "start.init: 'compact' -> 'random_text'"),
        ({"num_tokens": 24}, "start.num_tokens: 16 -> 24"),
        ({"lr": 0.1}, "config.lr: 0.003 -> 0.1"),
        ({"max_tokens_b": 7}, "config.max_tokens_b: 6 -> 7"),
    ]:
        with pytest.raises(ConfigError, match=f"other settings.*{named}.*restart=True"):
            _build(tiny_llama, tmp_path / "w", **changed)
    restarted = _build(tiny_llama, tmp_path / "w", lr=0.1, restart=True)
    fresh = _build(tiny_llama, tmp_path / "fresh", lr=0.1)
    assert all(torch.equal(a, b) for a, b in zip(restarted.keys, fresh.keys))
    assert restarted.meta.training["config"]["lr"] == 0.1


def test_a_damaged_part_is_made_again(tiny_llama, tmp_path):
    from cartridges_sdk.making.settings import SynthesisConfig
    from cartridges_sdk.making.synthesis import synthesize

    config = SynthesisConfig(**{k: v for k, v in TINY.items() if k != "progress"}, seed=1)
    whole = synthesize(TEXT, tiny_llama, tmp_path / "d", config, progress=False)
    want = {c.conv_id: c.input_ids.tolist() for c in whole}
    part = tmp_path / "d" / "group-000000.parquet"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # a copy cut short
    with pytest.warns(UserWarning, match="Making 1 damaged part.*group-000000.parquet"):
        again = synthesize(TEXT, tiny_llama, tmp_path / "d", config, progress=False)
    assert {c.conv_id: c.input_ids.tolist() for c in again} == want


def test_a_second_process_on_the_same_folder_fails_at_once(tiny_llama, tmp_path):
    folder = tmp_path / "w" / "data"
    ready, release = tmp_path / "ready", tmp_path / "release"
    holder = subprocess.Popen([sys.executable, "-c", (  # holds the lock until killed, or for 2 minutes at most
        "import time, pathlib\nfrom cartridges_sdk.files import folder_lock\n"
        f"with folder_lock({str(folder)!r}):\n    pathlib.Path({str(ready)!r}).touch()\n"
        f"    deadline = time.monotonic() + 120\n"
        f"    while not pathlib.Path({str(release)!r}).exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n")])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the lock holder did not start"
            time.sleep(0.05)
        spy = Spy(tiny_llama)
        with pytest.raises(ConfigError, match="is in use by another process.*wait for it to finish"):
            _build(tiny_llama, tmp_path / "w", synthesizer=spy)
        assert not (folder / "header.json").exists()
    finally:
        holder.kill()  # as a crash would: the operating system drops the lock with the process
        holder.wait(timeout=60)
        release.touch()
    _build(tiny_llama, tmp_path / "w")


def test_a_kill_before_the_step_checkpoint_keeps_the_timed_one(tiny_llama, tmp_path, kill_at_step):
    from cartridges_sdk.making.training import TorchTrainer
    from cartridges_sdk.trainer_inputs import TrainConfig

    init = Cartridge.from_prefix(tiny_llama, TEXT, 12)
    convs = list(SelfStudyDataset(_build_data(tiny_llama, tmp_path)))
    cfg = TrainConfig(epochs=6, batch_tokens=64, checkpoint_every=1000, checkpoint_seconds=1e-9, eval_fraction=0.0)
    straight = TorchTrainer().fit(init, convs, tiny_llama, cfg, progress=False)
    revive = kill_at_step(4)
    with pytest.raises(KeyboardInterrupt):
        TorchTrainer().fit(init, convs, tiny_llama, cfg, output_dir=tmp_path / "t", progress=False)
    revive()
    resumed = TorchTrainer()
    out = resumed.fit(init, convs, tiny_llama, cfg, output_dir=tmp_path / "t", progress=False)
    assert resumed.history[2]["step"] == 3  # steps 1-3 were kept although checkpoint_every is 1000
    assert all(torch.equal(a, b) for a, b in zip(out.keys, straight.keys))


def _build_data(lm, tmp_path):
    from cartridges_sdk.making.settings import SynthesisConfig
    from cartridges_sdk.making.synthesis import synthesize

    config = SynthesisConfig(**{k: v for k, v in TINY.items() if k != "progress"})
    return synthesize(TEXT, lm, tmp_path / "data", config, progress=False).path


# -- 4. context limits ------------------------------------------------------------------------------------------

def test_lengths_beyond_the_context_are_refused_with_the_numbers(tiny_llama, tmp_path):
    long_text = TEXT * 3  # ~4,000 characters: tokens of the character-level tiny tokenizer; its context is 2,048
    with pytest.raises(ConfigError, match="2100-token prefix cartridge needs 2100 tokens, more than the 2048-token context"):
        Cartridge.from_prefix(tiny_llama, long_text, 2100)
    spy = Spy(tiny_llama)
    with pytest.raises(ConfigError, match=r"self-study prompt .* needs \d+ tokens, more than the 2048-token context.*max_chunk"):
        Cartridge.from_corpus(long_text, tiny_llama, num_tokens=16, max_chunk=3000, synthesizer=spy,
                              output_dir=tmp_path / "w", progress=False)
    with pytest.raises(ConfigError, match=r"document window .*window_tokens"):
        Cartridge.from_corpus(long_text, tiny_llama, num_tokens=16, window_tokens=1500, windows_per_chunk=2,
                              synthesizer=spy, output_dir=tmp_path / "w", progress=False)
    with pytest.raises(ConfigError, match=r"Training a 1900-token cartridge"):
        Cartridge.from_corpus(long_text, tiny_llama, num_tokens=1900, synthesizer=spy, output_dir=tmp_path / "w",
                              progress=False)
    assert spy.calls == 0
    c = Cartridge.from_prefix(tiny_llama, TEXT, 1000)
    with pytest.raises(ConfigError, match=r"Request 0 \(1000 cartridge tokens \+ \d+ prompt tokens \+ max_new_tokens=1500\)"):
        c.ask("Who?", max_new_tokens=1500)
    with pytest.raises(ConfigError, match="Scoring 1500 tokens after 1000 cartridge tokens"):
        c.logits([5] * 1500)
    # the attention cut's pass (the model's body alone) refuses the same, before it reads anything
    from cartridges_sdk.serve.attended import attended

    with pytest.raises(ConfigError, match="Reading 1500 tokens after 1000 cartridge tokens needs 2500 tokens, more than the "
                                          "2048-token context.*pass a shorter sequence or use a smaller cartridge"):
        attended(tiny_llama, c, [5] * 1500, 10)
    with pytest.raises(ConfigError, match="input_ids must be a non-empty 1-D sequence of token ids, got shape \\(0,\\)"):
        attended(tiny_llama, c, [], 10)


# -- 5. errors, not tracebacks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": "5"}, "max_new_tokens='5' must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens=True must be an integer"),
    ({"temperature": float("nan")}, "temperature=nan must be a finite number"),
    ({"temperature": "hot"}, "temperature='hot' must be a finite number"),
    ({"top_k": 2.5}, "top_k=2.5 must be an integer"),
    ({"seed": "x"}, "seed='x' must be an integer"),
    ({"stop": 5}, "stop=5 must be a non-empty string"),
])
def test_wrongly_typed_generation_arguments(tiny_llama, kwargs, message):
    c = Cartridge.from_prefix(tiny_llama, TEXT, 12)
    with pytest.raises(ConfigError, match=message):
        c.ask("Who?", **kwargs)


def _api_cases(lm):
    c = Cartridge.from_prefix(lm, TEXT, 8)
    corpus = TEXT[:400]
    return [
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, description=5), "description=5 must be a string"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, seed_weights={"question": "a"}), "seed_weights=.* finite"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, seed="a"), "seed='a' must be an integer"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens="8"), "num_tokens='8' must be an int"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, num_conversations="3"), "num_conversations='3' must be an integer"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, output_dir=5), "output_dir=5 must be a folder path"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, synthesizer_options="x"), "synthesizer_options='x' must be a dict"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, synthesizer=5), "synthesizer=5 must be a registered name"),
        (lambda: Cartridge.from_corpus(corpus, lm, num_tokens=8, recipe="readr"),
         r"recipe='readr' is not a recipe; use one of \['reader'\]"),
        (lambda: Cartridge.from_prefix(lm, TEXT, 8, num_frozen="1"), "num_frozen='1' must be an int"),
        (lambda: Cartridge.from_prefix(lm, 5, 8), "from_prefix takes a text or a list of token ids"),
        (lambda: Cartridge.from_prefix(lm, [1.5, 2.0], 1), "token ids must all be integers"),
        (lambda: Cartridge.from_prefix(lm, [10**9], 1), "outside the model's vocabulary"),
        (lambda: Cartridge.from_random_text(lm, 8, seed="a"), "seed='a' must be an integer"),
        (lambda: Cartridge.compose([c, "x"]), r"cartridges\[1\]='x' must be a Cartridge"),
        (lambda: Cartridge.load(5), "path=5 must be a file path"),
        (lambda: c.bind("x"), "model='x' must be a model from load_model"),
        (lambda: c.ask("q", runtime_options=[1]), r"runtime_options=\[1\] must be a dict"),
        (lambda: c.ask("q", runtime=5), "runtime=5 must be a registered name"),
    ]


def test_wrongly_typed_api_arguments(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written anywhere
    for call, message in _api_cases(tiny_llama):
        with pytest.raises(ConfigError, match=message):
            call()
    assert list(tmp_path.iterdir()) == []


def test_wrong_questions_and_messages(tiny_llama):
    c = Cartridge.from_prefix(tiny_llama, TEXT, 12)
    for bad in (None, 5, "", [], ["ok", None]):
        with pytest.raises(ConfigError, match="ask\\(\\) needs a non-empty question"):
            c.ask(bad)
    with pytest.raises(ConfigError, match="Message 0 is .*needs a string 'role' and a string 'content'"):
        c.chat([{"role": "user"}])
    with pytest.raises(ConfigError, match="messages must be a list"):
        c.chat("Who built it?")


def test_cli_file_mistakes_are_one_line_errors(tmp_path, capsys, monkeypatch):
    import cartridges_sdk.cli.common as cli

    monkeypatch.setattr(cli, "model_for", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp_path / "ok.txt").write_text(TEXT)
    (tmp_path / "folder").mkdir()
    cases = [
        (["init", str(tmp_path / "folder"), "-o", str(tmp_path / "c.safetensors"), "--tokens", "8"], "is a folder; give one text file"),
        (["init", str(tmp_path / "bin.dat"), "-o", str(tmp_path / "c.safetensors"), "--tokens", "8"], "is not UTF-8 text"),
        (["init", str(tmp_path / "latin1.txt"), "-o", str(tmp_path / "c.safetensors"), "--tokens", "8"], "is not UTF-8 text"),
        (["init", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "c.safetensors"), "--tokens", "8"], "No file at"),
        (["init", str(tmp_path / "ok.txt"), "-o", str(tmp_path / "folder"), "--tokens", "8"], "-o .* is a folder; give a file path"),
        (["init", str(tmp_path / "ok.txt"), "-o", str(tmp_path / "c.safetensors"), "--tokens", "-3"], "num_tokens=-3"),
        (["build", str(tmp_path / "ok.txt"), "-o", str(tmp_path / "folder"), "--tokens", "8"], "is a folder"),
    ]
    import re

    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), (args, err)
    assert not (tmp_path / "c.safetensors").exists()


def test_foreign_and_malformed_files_are_named(tmp_path, capsys, tiny_llama):
    from safetensors.torch import save_file

    torch.save({"trainable_keys": [torch.zeros(1, 2, 3, 4)]}, tmp_path / "authors.pt")
    assert main(["inspect", str(tmp_path / "authors.pt")]) == 2
    assert "is a PyTorch file (torch.save), not a cartridge file" in capsys.readouterr().err
    with pytest.raises(CartridgeFormatError, match="Cartridge.from_authors_pt"):
        Cartridge.load(tmp_path / "authors.pt")
    good = Cartridge.from_prefix(tiny_llama, TEXT, 8)
    tensors = {f"layers.{i}.{kind}": t for i, (k, v) in enumerate(zip(good.keys, good.values))
               for kind, t in (("keys", k), ("values", v))}
    for broken in ({"model": 5}, {"num_tokens": "eight"}, {"key_layout": "sideways"}, {"num_frozen": None}):
        meta = {**good.meta.to_dict(), **broken}
        save_file(tensors, str(tmp_path / "bad.safetensors"),
                  metadata={"format": "cartridges-sdk", "format_version": "1", "meta": json.dumps(meta)})
        with pytest.raises(CartridgeFormatError, match="bad.safetensors.* has unreadable cartridge metadata"):
            Cartridge.load(tmp_path / "bad.safetensors")
        assert main(["inspect", str(tmp_path / "bad.safetensors")]) == 2
        assert capsys.readouterr().err.startswith("error: ")


# -- 6. files -----------------------------------------------------------------------------------------------------

def test_written_files_follow_the_umask(tiny_llama, tmp_path):
    old = os.umask(0o022)
    try:
        path = Cartridge.from_prefix(tiny_llama, TEXT, 8).save(tmp_path / "c.safetensors")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644  # readable by others sharing a store, as the umask says


def test_the_pickle_refusal_never_suggests_turning_the_safety_off(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"trainable_keys": Payload(), "trainable_values": []}, tmp_path / "evil.pt")
    with pytest.raises(CartridgeFormatError) as info:
        Cartridge.from_authors_pt(tmp_path / "evil.pt")
    message = str(info.value)
    assert "weights_only=False" not in message and "convert it once" in message and "from_authors_pt" in message


def test_non_finite_numbers_never_reach_a_dataset(tiny_llama):
    """A guard against a silent failure mode: NaN teacher log-probs are reported, not trained on."""
    from cartridges_sdk.trainer_inputs import Conversation

    conv = Conversation(0, 0, (0, 4), "question", np.arange(4, dtype=np.int32), np.ones(4, dtype=np.int8),
                        np.array([1, 2, 3], dtype=np.int32), np.zeros((3, 2), dtype=np.int32),
                        np.full((3, 2), math.nan, dtype=np.float32))
    assert any("not finite" in p for p in conv.problems(100))
