"""The `cartridges` command, as a user runs it, on the embedded default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cartridges_sdk import Cartridge
from cartridges_sdk.cli import main

from conftest import DATA

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    tides = d / "tides.txt"
    tides.write_text("Tides rise and fall twice a day because the moon pulls on the oceans. " * 4)
    assert main(["init", str(DATA / "harrow_point.txt"), "-o", str(d / "a.safetensors"), "--tokens", "120"]) == 0
    assert main(["init", str(tides), "-o", str(d / "b.safetensors"), "--tokens", "40"]) == 0
    return d


def test_inspect(files, capsys):
    assert main(["inspect", str(files / "a.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "120 (1 frozen)" in out and "30 layers" in out
    assert main(["inspect", "--json", str(files / "a.safetensors")]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["num_tokens"] == 120 and meta["init"] == "prefix"


@pytest.mark.parametrize("reposition", [False, True])
def test_compose(files, capsys, reposition):
    out = files / f"ab{int(reposition)}.safetensors"
    args = ["compose", str(files / "a.safetensors"), str(files / "b.safetensors"), "-o", str(out)]
    assert main(args + (["--reposition"] if reposition else [])) == 0
    c = Cartridge.load(out)
    assert c.num_tokens == 160 and len(c.meta.parts) == 2
    assert [p["repositioned"] for p in c.meta.parts] == [False, reposition]


def test_ask_answers_from_the_cartridge(files, capsys):
    assert main(["ask", str(files / "a.safetensors"), "When was the Harrow Point lighthouse built?", "--max-new-tokens", "40"]) == 0
    assert "1871" in capsys.readouterr().out


def test_ask_stream(files, capsys):
    assert main(["ask", str(files / "a.safetensors"), "Who built the lighthouse?", "--max-new-tokens", "20", "--stream"]) == 0
    assert capsys.readouterr().out.strip()


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage" * 10)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "truncated or corrupt" in err


def test_wrong_model_from_the_cli(files, tmp_path, tiny_qwen, capsys):
    tiny_qwen.model.save_pretrained(tmp_path / "tiny")
    tiny_qwen.tokenizer.save_pretrained(tmp_path / "tiny")
    code = main(["ask", str(files / "a.safetensors"), "Hi", "--model", str(tmp_path / "tiny")])
    err = capsys.readouterr().err
    assert code == 2 and "SmolLM2-135M-Instruct" in err and "does not fit" in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "compose" in out.stdout
