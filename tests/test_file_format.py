"""The cartridge file: round trips, atomic writes, and clear errors for bad files and wrong models."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from cartridges_sdk import Cartridge, CartridgeFormatError, IncompatibleCartridgeError

from conftest import TEXT


def _same(a: Cartridge, b: Cartridge) -> None:
    assert a.num_layers == b.num_layers
    for i in range(a.num_layers):
        assert torch.equal(a.keys[i], b.keys[i]) and torch.equal(a.values[i], b.values[i])
    assert a.meta == b.meta


def test_save_load_round_trip(tiny_lm, tmp_path):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 33, num_frozen=2)
    path = c.save(tmp_path / "c.safetensors")
    back = Cartridge.load(path, model=tiny_lm)
    _same(c, back)
    assert back.lm is tiny_lm
    assert back.meta.corpus["num_tokens"] == len(tiny_lm.encode(TEXT))
    assert back.meta.model.fingerprint == tiny_lm.identity.fingerprint
    assert os.listdir(tmp_path) == ["c.safetensors"]  # no temp files left behind


def test_metadata_is_plain_json_in_the_header(tiny_lm, tmp_path):
    from safetensors import safe_open

    path = Cartridge.from_prefix(tiny_lm, TEXT, 10).save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
        names = set(f.keys())
    meta = json.loads(header["meta"])
    assert header["format"] == "cartridges-sdk" and header["format_version"] == "1"
    assert meta["num_tokens"] == 10 and meta["num_frozen"] == 1 and meta["init"] == "prefix"
    assert meta["model"]["architecture"]["num_kv_heads"] == 2
    assert {"created", "sdk_version", "dtype", "corpus"} <= set(meta)
    assert names == {f"layers.{i}.{kind}" for i in range(3) for kind in ("keys", "values")}


def test_failed_save_keeps_the_old_file(tiny_lm, tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    old = Cartridge.from_prefix(tiny_lm, TEXT, 10)
    old.save(path)
    before = path.read_bytes()

    import safetensors.torch

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        Cartridge.from_prefix(tiny_lm, TEXT, 20).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.safetensors"]


def test_wrong_model_names_both_models(tiny_llama, tiny_qwen, tmp_path):
    path = Cartridge.from_prefix(tiny_llama, TEXT, 12).save(tmp_path / "c.safetensors")
    with pytest.raises(IncompatibleCartridgeError) as err:
        Cartridge.load(path, model=tiny_qwen)
    assert "tiny-llama-seed0" in str(err.value) and "tiny-qwen2-seed0" in str(err.value)


def test_truncated_file(tiny_lm, tmp_path):
    path = Cartridge.from_prefix(tiny_lm, TEXT, 12).save(tmp_path / "c.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CartridgeFormatError, match="truncated or corrupt"):
        Cartridge.load(path)


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.safetensors"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CartridgeFormatError):
        Cartridge.load(path)


def test_plain_safetensors_is_not_a_cartridge(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(path))
    with pytest.raises(CartridgeFormatError, match="not a cartridge"):
        Cartridge.load(path)


def test_missing_layer_tensor(tiny_lm, tmp_path):
    from safetensors import safe_open

    path = Cartridge.from_prefix(tiny_lm, TEXT, 12).save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    del tensors["layers.1.values"]
    save_file(tensors, str(path), metadata=header)
    with pytest.raises(CartridgeFormatError, match="layers"):
        Cartridge.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(CartridgeFormatError, match="No cartridge file"):
        Cartridge.load(tmp_path / "nope.safetensors")


def test_newer_format_is_refused(tiny_lm, tmp_path):
    from safetensors import safe_open

    path = Cartridge.from_prefix(tiny_lm, TEXT, 12).save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**header, "format_version": "99"})
    with pytest.raises(CartridgeFormatError, match="upgrade"):
        Cartridge.load(path)
