"""peft CARTRIDGE adapters and the paper authors' .pt caches, in and out."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from cartridges_sdk import Cartridge, CartridgeFormatError, IncompatibleCartridgeError

from conftest import TEXT


def _same_tensors(a: Cartridge, b: Cartridge) -> None:
    for i in range(a.num_layers):
        assert torch.equal(a.keys[i], b.keys[i]) and torch.equal(a.values[i], b.values[i])


def test_peft_round_trip_keeps_tensors_and_metadata(tiny_lm, tmp_path):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 21, num_frozen=3)
    c.to_peft(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "CARTRIDGE" and config["num_virtual_tokens"] == 21
    assert config["num_frozen_tokens"] == 3
    back = Cartridge.from_peft(tmp_path / "adapter", model=tiny_lm)
    _same_tensors(c, back)
    assert back.meta == c.meta


def test_peft_itself_runs_our_export(tiny_lm, tmp_path):
    """Real peft loads the exported adapter and scores exactly as our runtime does."""
    peft = pytest.importorskip("peft")
    c = Cartridge.from_prefix(tiny_lm, TEXT, 21)
    c.to_peft(tmp_path / "adapter")
    q = tiny_lm.chat_ids([{"role": "user", "content": "Who built it?"}])
    ours = tiny_lm.logits(q, [c])
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(tiny_lm.model), str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = wrapped(input_ids=torch.tensor([q]), attention_mask=torch.ones(1, len(q), dtype=torch.long)).logits[0]
    assert (ours - theirs.float()).abs().max().item() <= 1e-4


def test_peft_adapter_made_by_peft_imports(tiny_lm, tmp_path):
    """An adapter written by peft (no SDK metadata) imports with the right layout."""
    pytest.importorskip("peft")
    from peft import CartridgeConfig, get_peft_model
    from peft.tuners.cartridge.utils import initialize_kv_prefix_from_past_key_values
    from transformers import DynamicCache

    model = copy.deepcopy(tiny_lm.model)
    wrapped = get_peft_model(model, CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=15, num_frozen_tokens=1))
    ids = tiny_lm.encode(TEXT)[:15]
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), wrapped.disable_adapter():
        wrapped(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    initialize_kv_prefix_from_past_key_values(wrapped, past_key_values=cache, num_virtual_tokens=15)
    wrapped.save_pretrained(str(tmp_path / "from_peft"))
    got = Cartridge.from_peft(tmp_path / "from_peft", model=tiny_lm)
    want = Cartridge.from_prefix(tiny_lm, ids, 15)
    assert got.num_tokens == 15 and got.num_frozen == 1 and got.meta.init == "imported"
    for i in range(want.num_layers):
        assert torch.allclose(got.keys[i], want.keys[i], atol=1e-6)
        assert torch.allclose(got.values[i], want.values[i], atol=1e-6)


def test_peft_wrong_model(tiny_llama, tiny_qwen, tmp_path):
    Cartridge.from_prefix(tiny_llama, TEXT, 9).to_peft(tmp_path / "a")
    with pytest.raises(IncompatibleCartridgeError):
        Cartridge.from_peft(tmp_path / "a", model=tiny_qwen)


def test_peft_not_an_adapter(tmp_path):
    with pytest.raises(CartridgeFormatError, match="adapter_config.json"):
        Cartridge.from_peft(tmp_path)


def _authors_state(c: Cartridge, frozen_name: str):
    nf = c.num_frozen
    return {
        "trainable_keys": [k[None, :, nf:].clone() for k in c.keys],
        "trainable_values": [v[None, :, nf:].clone() for v in c.values],
        f"{frozen_name}_keys": [k[None, :, :nf].clone() for k in c.keys],
        f"{frozen_name}_values": [v[None, :, :nf].clone() for v in c.values],
    }


@pytest.mark.parametrize("frozen_name", ["frozen", "fixed"])
def test_authors_pt_import(tiny_lm, tmp_path, frozen_name):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 18, num_frozen=2)
    path = tmp_path / "cache.pt"
    torch.save(_authors_state(c, frozen_name), path)
    back = Cartridge.from_authors_pt(path, model=tiny_lm)
    _same_tensors(c, back)
    assert back.num_frozen == 2 and back.num_tokens == 18
    assert back.meta.model == tiny_lm.identity
    q = tiny_lm.chat_ids([{"role": "user", "content": "Who?"}])
    assert torch.equal(tiny_lm.logits(q, [back]), tiny_lm.logits(q, [c]))


def test_authors_pt_without_model_keeps_shapes_and_binds_later(tiny_lm, tiny_qwen, tmp_path):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 18)
    path = tmp_path / "cache.pt"
    torch.save(_authors_state(c, "frozen"), path)
    loose = Cartridge.from_authors_pt(path)
    assert loose.lm is None and loose.meta.model.architecture["num_layers"] == 3
    loose.bind(tiny_lm)  # shapes fit


def test_authors_pt_rejects_other_things(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(CartridgeFormatError, match="trainable_keys"):
        Cartridge.from_authors_pt(path)
    path.write_bytes(b"not a torch file at all")
    with pytest.raises(CartridgeFormatError):
        Cartridge.from_authors_pt(path)


def test_authors_pt_is_never_unpickled(tmp_path):
    """A pickle that would run code is refused by weights_only loading."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"trainable_keys": Evil()}, f)
    with pytest.raises(CartridgeFormatError):
        Cartridge.from_authors_pt(path)
