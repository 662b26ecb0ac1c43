"""benchmarks.gpu, the one-command GPU measurement: it refuses in one line where no GPU is found, and every part
runs on a CPU with a tiny shape, so the script that reaches the GPU machine has run before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu

ROOT = Path(__file__).resolve().parent.parent


def test_refuses_in_one_line_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [gpu.NO_GPU]


def test_the_shell_script_refuses_without_a_gpu():
    if torch.cuda.is_available():
        return  # this check is for machines without one
    done = subprocess.run(["bash", "scripts/gpu-bench.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 2
    assert done.stderr.strip().startswith("gpu-bench: no CUDA GPU visible")


def test_every_part_on_a_cpu_with_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu.json"
    code = gpu.main(["run", "--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--cartridges", "16,32",
                     "--documents", "96", "--budget-gib", "0.001", "--new-tokens", "4", "--repeats", "1",
                     "--train-tokens", "32", "--windows", "4", "--batch-tokens", "256,1024", "--conversations", "4",
                     "--per-chunk", "2",
                     "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, {k: v.get("error") for k, v in result.items() if isinstance(v, dict)}
    assert result["exactness"]["passed"], result["exactness"]
    assert set(result["exactness"]["fp32_contract"].values()) == {"passed"}
    rows = {r["cache_tokens"]: r for r in result["serving"]["rows"]}
    assert [rows[k]["kind"] for k in (16, 32, 96)] == ["cartridge", "cartridge", "ICL"]
    # the same budget holds more users of a smaller cache, and each row decodes every token asked for
    assert rows[16]["batch"] > rows[32]["batch"] > rows[96]["batch"] >= 1
    for r in rows.values():
        assert r["new_tokens"] == 4 * r["batch"]
        assert r["tokens_per_s"] > 0 and r["requests_per_s"] > 0
    assert rows[96]["prefill_s"] > 0  # ICL's own cost per request
    assert set(result["serving"]["ratios"]) == {"cartridge 16 vs ICL 96", "cartridge 32 vs ICL 96"}
    attention = result["serving"]["attention"]
    assert [(a["rows"], a["keys"]) for a in attention] == [(rows[k]["batch"], k) for k in (16, 32, 96)]
    for a in attention:  # every path computes the same attention, and is timed
        assert all(a[f"{name}_ms"] > 0 and a[f"{name}_error"] < 1e-5 for name in ("enable_gqa", "folded_sdpa", "folded_matmul"))
    study = result["selfstudy"]
    assert 0 < study["training"]["mfu"] < 1.5
    # one micro-batch size per run: 4 windows take 4 steps of one window, then one step of all four
    assert [(r["batch_tokens"], r["steps"]) for r in study["training"]["runs"]] == [(256, 4), (1024, 1)]
    runs = study["synthesis"]["runs"]
    assert [r["layout"] for r in runs] == ["packed", "one_by_one"]
    assert all(r["generated_tokens"] > 0 and r["ratio"] > 0 for r in runs)
    # the whole 0.5B recipe, built end to end
    assert result["recipe"]["seconds"] > result["recipe"]["training_seconds"] > 0


@pytest.mark.default_model
def test_prepare_writes_what_the_gpu_machine_cannot_fetch(tmp_path, default_lm):
    from benchmarks.data import DEFAULT_DATA

    gpu.prepare(tmp_path, DEFAULT_DATA, 3)
    tok = gpu.tokenizer_of(tmp_path, "llama-8b")
    assert len(tok) == len(default_lm.tokenizer)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        default_lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert len(gpu.document_of(tmp_path)) > 10_000
