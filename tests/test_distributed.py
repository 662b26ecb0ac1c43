"""Data-parallel training under torchrun (gloo, CPU processes): two ranks train the same cartridge as one process
with the same settings; a rank killed mid-run fails the job without damaging the checkpoint, and the run resumes
on another number of ranks to the same result."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TEXT
from ddp_worker import config, data, others

from cartridges_sdk import Cartridge, ConfigError
from cartridges_sdk.making.dataset import SelfStudyDataset
from cartridges_sdk.making.training import TorchTrainer

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"


def torchrun(tmp_path: Path, out: Path, grad_accum: int, workdir: Path, die_at: int = 0,
             mode: str = "plain", **changes: int) -> subprocess.CompletedProcess:
    """Two ranks of `ddp_worker.py` training with `config(grad_accum, **changes)`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(out), str(grad_accum), str(workdir), str(die_at), mode,
                           *(f"{name}={value}" for name, value in changes.items())],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path, check=False)


def failure(done: subprocess.CompletedProcess) -> str:
    """The exit status tells the launcher's own crash (negative: its signal) from a rank's failure (1)."""
    return f"torchrun exited {done.returncode}: {done.stderr[-3000:]}"


@contextlib.contextmanager
def one_thread():
    """As each rank runs (OMP_NUM_THREADS=1): matmul sums split over threads round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def max_diff(a: Cartridge, b: Cartridge) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.keys + a.values, b.keys + b.values))


def test_two_ranks_train_the_cartridge_one_process_trains_with_the_same_global_batch(tmp_path):
    lm, init, convs = data()
    trainer = TorchTrainer()
    with one_thread():
        one = trainer.fit(init, convs, lm, config(2), output_dir=tmp_path / "one", progress=False)
    done = torchrun(tmp_path, tmp_path / "two.safetensors", 2, tmp_path / "two")
    assert done.returncode == 0, failure(done)
    two = Cartridge.load(tmp_path / "two.safetensors", lm)
    assert max_diff(one, two) <= 1e-5
    assert max_diff(one, init) > 1e-2  # it did train
    # the same loss and gradient norm at every step: each step saw the whole global batch, summed once
    logged = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert len(logged) == len(trainer.history) > 2
    for mine, theirs in zip(trainer.history, logged):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_two_ranks_training_among_distractors_draw_as_one_process_does(tmp_path):
    """Each step's others and the trainable cartridge's place among them come from the seed and the step alone, so
    two ranks compose the same prefix for their shares of a step, and train what one process trains."""
    lm, init, convs = data()
    trainer = TorchTrainer()
    with one_thread():
        one = trainer.fit(init, convs, lm, config(2), output_dir=tmp_path / "one", progress=False,
                          distractors=others(lm))
    alone = TorchTrainer().fit(init, convs, lm, config(2), progress=False)
    assert max_diff(one, alone) > 1e-3  # the distractors changed what it learned
    done = torchrun(tmp_path, tmp_path / "two.safetensors", 2, tmp_path / "two", mode="among")
    assert done.returncode == 0, failure(done)
    two = Cartridge.load(tmp_path / "two.safetensors", lm)
    assert max_diff(one, two) <= 1e-5
    assert two.meta.training["distractors"] == one.meta.training["distractors"]  # recorded: the same three others
    assert len(one.meta.training["distractors"]["content"]) == 3
    logged = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    for mine, theirs in zip(trainer.history, logged, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


def test_a_model_sharded_across_two_ranks_trains_the_same_cartridge(tmp_path):
    """FSDP2: each rank holds about half of the frozen model's weights, gathered layer by layer for each pass; the
    cartridge, replicated, trains as with the whole model in one process."""
    lm, init, convs = data()
    trainer = TorchTrainer()
    with one_thread():
        one = trainer.fit(init, convs, lm, config(2), output_dir=tmp_path / "one", progress=False)
    done = torchrun(tmp_path, tmp_path / "two.safetensors", 2, tmp_path / "two", mode="shard")
    assert done.returncode == 0, failure(done)
    held, whole = map(int, re.search(r"rank 0 holds (\d+) of (\d+) model weights", done.stdout).groups())
    # the first half of each weight's rows (rounded up), not the whole model
    assert held == sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in lm.model.parameters()) < 0.6 * whole
    two = Cartridge.load(tmp_path / "two.safetensors", lm)
    assert max_diff(one, two) <= 1e-5
    logged = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    for mine, theirs in zip(trainer.history, logged, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine.keys() == theirs.keys()
        if "eval_loss" in mine:  # the ranks evaluate a share each
            assert mine["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)


# 3 micro-batches in the one epoch (two 45-token sequences each), which 2 ranks cannot share evenly
UNEVEN = {"batch_tokens": 100, "epochs": 1}


@pytest.mark.parametrize("grad_accum, mode, steps", [(1, "plain", 3), (2, "shard", 2)])
def test_the_number_of_ranks_never_changes_the_optimizer_steps(tmp_path, grad_accum, mode, steps):
    """Two ranks given one process's settings take its optimizer steps, also where they cannot share a step evenly:
    3 micro-batches make 3 steps of 1 (rank 1 adds nothing) or, with grad_accum=2, steps of 2 and 1 (two ranks once
    made 2 steps and 1 of them, each rank taking grad_accum micro-batches a step)."""
    lm, init, convs = data()
    trainer = TorchTrainer()
    with one_thread():
        one = trainer.fit(init, convs, lm, config(grad_accum, **UNEVEN), progress=False)
    done = torchrun(tmp_path, tmp_path / "two.safetensors", grad_accum, tmp_path / "two", mode=mode, **UNEVEN)
    assert done.returncode == 0, failure(done)
    two = Cartridge.load(tmp_path / "two.safetensors", lm)
    assert one.meta.training["steps"] == two.meta.training["steps"] == steps
    assert max_diff(one, two) <= 1e-5
    assert max_diff(one, init) > 1e-2  # it did train


def test_shard_model_needs_ranks(tmp_path):
    lm, init, convs = data()
    with pytest.raises(ConfigError, match="shard_model=True splits the model across ranks.*--nproc"):
        TorchTrainer(shard_model=True).fit(init, convs, lm, config(1), progress=False)


def test_a_killed_rank_fails_the_job_cleanly_and_the_run_resumes_on_one_process(tmp_path):
    lm, init, convs = data()
    with one_thread():
        want = TorchTrainer().fit(init, convs, lm, config(2), output_dir=tmp_path / "one", progress=False)
    failed = torchrun(tmp_path, tmp_path / "two.safetensors", 2, tmp_path / "two", die_at=4)
    assert failed.returncode != 0 and not (tmp_path / "two.safetensors").exists()
    saved = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)  # whole, not half-written
    assert 3 <= saved["step"] <= 4
    resumed_trainer = TorchTrainer()
    with one_thread():
        resumed = resumed_trainer.fit(init, convs, lm, config(2), output_dir=tmp_path / "two", progress=False)
    assert resumed_trainer.history[len(saved["history"])]["step"] == saved["step"] + 1  # picked up there
    assert max_diff(want, resumed) <= 1e-5


@pytest.mark.slow  # 35 s: a refusal path under torchrun; the paths that train stay in the default tier
def test_a_checkpoint_rank_0_refuses_stops_every_rank(tmp_path):
    assert torchrun(tmp_path, tmp_path / "a.safetensors", 1, tmp_path / "work").returncode == 0
    again = torchrun(tmp_path, tmp_path / "b.safetensors", 2, tmp_path / "work")  # another global batch
    assert again.returncode != 0
    assert "micro_batches_per_step: 1 -> 2" in again.stderr  # rank 0's reason
    assert "Rank 0 failed, so this rank stops too: ConfigError: The checkpoint in" in again.stderr  # rank 1 too


@pytest.mark.slow  # 20 s: a refusal path under torchrun; the paths that train stay in the default tier
def test_ranks_given_other_data_stop_with_the_reason(tmp_path):
    done = torchrun(tmp_path, tmp_path / "a.safetensors", 1, tmp_path / "work", mode="otherdata")
    assert done.returncode != 0
    # both ranks say it (rank 1 found fewer sequences than rank 0), neither waits in a collective
    assert done.stderr.count("The ranks were given other training data or settings than rank 0 (rank 1: ") == 2


@pytest.mark.slow  # two ranks of the default model under torchrun; the tiny-model torchrun tests here stay in the default tier
def test_cartridges_train_nproc_2_on_the_default_model(tmp_path, capsys):
    """`cartridges train --nproc 2` starts two ranks on this machine; the file it writes equals a one-process run's
    with the same settings."""
    from test_cli import DATA, TINY

    from cartridges_sdk.cli import main

    data = tmp_path / "data"
    assert main(["synthesize", str(DATA / "harrow_point.txt"), "-o", str(data), "--conversations", "8", *TINY]) == 0
    common = ["train", str(data), "--tokens", "16", "--init", "prefix", "--epochs", "2", "--set", "batch_tokens=256"]
    # the issue's own case: the same dataset and settings (batch_tokens=256, default grad_accum) once took 3 steps
    # in one process and 2 in two, and trained cartridges 1.1e-2 apart
    with one_thread():
        assert main([*common, "-o", str(tmp_path / "one.safetensors")]) == 0
    two = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", *common, "-o", str(tmp_path / "two.safetensors"),
                          "--nproc", "2"], capture_output=True, text=True, timeout=900, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    assert "leaves 1 of the 2 ranks idle in every step" in two.stderr  # one micro-batch a step: said, not hidden
    assert two.stdout.count("wrote ") == 1  # rank 0 alone writes the file
    one, two = (Cartridge.load(tmp_path / f"{n}.safetensors") for n in ("one", "two"))
    assert max_diff(one, two) <= 1e-5 and one.meta.training["steps"] == two.meta.training["steps"] > 1
    # rank 0 alone makes the start; when it cannot, the other rank stops with its reason instead of waiting
    failed = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", *common, "-o", str(tmp_path / "x.safetensors"),
                             "--tokens", "4000", "--nproc", "2"], capture_output=True, text=True, timeout=300,
                            check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert failed.returncode != 0
    assert "Rank 0 failed, so this rank stops too: ConfigError: init='prefix' needs num_tokens <=" in failed.stderr


def share_synthesis(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER.with_name("shard_worker.py")), str(tmp_path / "data"), mode],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
                          cwd=tmp_path, check=False)


def test_two_ranks_synthesize_the_one_process_dataset_into_one_folder(tiny_llama, tmp_path):
    from test_synthesis import SHARDED, _config, contents

    from cartridges_sdk.hf import HFSynthesizer
    from cartridges_sdk.making.synthesis import synthesize

    done = share_synthesis(tmp_path, "same")
    assert done.returncode == 0, failure(done)
    assert "rank 0: 16 sequences" in done.stdout and "rank 1: 16 sequences" in done.stdout  # each has the whole
    with one_thread():
        one = synthesize(TEXT, tiny_llama, tmp_path / "one", _config(**SHARDED), synthesizer=HFSynthesizer(tiny_llama),
                         progress=False)
    assert contents(SelfStudyDataset(tmp_path / "data")) == contents(one)


@pytest.mark.slow  # 20 s each: refusal paths under torchrun; the paths that synthesize stay in the default tier
@pytest.mark.parametrize("mode, reason", [
    ("differ", r"rank 1 was given other settings than rank 0 \(config.top_k: 5 -> 3\)"),
    ("apart", r"rank 1 does not see the dataset folder rank 0 prepared.*a shared filesystem"),
])
def test_ranks_that_cannot_share_a_synthesis_all_stop_with_the_reason(tmp_path, mode, reason):
    done = share_synthesis(tmp_path, mode)
    assert done.returncode != 0
    assert len(re.findall(reason, done.stderr)) == 2  # said by both ranks: neither waits for the other


@pytest.mark.slow  # both stages under torchrun, two ranks; the tiny-model torchrun tests here stay in the default tier
def test_cartridges_build_nproc_2_shares_synthesis_and_training(tmp_path):
    """`cartridges build --nproc 2`: the two ranks make one dataset between them, equal to the one a single process
    makes, and train on it the cartridge one process trains with the same settings."""
    from test_cli import DATA, TINY
    from test_synthesis import contents

    from cartridges_sdk.cli import main
    from cartridges_sdk.making.dataset import SelfStudyDataset

    common = ["build", str(DATA / "harrow_point.txt"), "--tokens", "16", "--init", "prefix", "--epochs", "2",
              "--conversations", "8", *TINY, "--set", "batch_tokens=256"]
    with one_thread():
        assert main([*common, "-o", str(tmp_path / "one.safetensors"), "--set", "grad_accum=2"]) == 0
    two = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", *common, "-o", str(tmp_path / "two.safetensors"),
                          "--set", "grad_accum=2", "--nproc", "2"], capture_output=True, text=True, timeout=900,
                         check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    assert "shard 0 of 2" in two.stderr and "shard 1 of 2" not in two.stderr  # rank 0 alone shows progress
    data = [SelfStudyDataset(tmp_path / f"{n}.safetensors.work" / "data") for n in ("one", "two")]
    assert len(data[1]) == 10 and contents(data[0]) == contents(data[1])
    one, two = (Cartridge.load(tmp_path / f"{n}.safetensors") for n in ("one", "two"))
    assert max_diff(one, two) <= 1e-5 and one.meta.training["steps"] == two.meta.training["steps"] > 1
