"""Training among distractor cartridges: the student's prefix is the composition serving makes, the draw is the
seed's and the step's alone, only the trainable cartridge learns, and a run resumes only among the same others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cartridges_sdk import Cartridge, ConfigError, IncompatibleCartridgeError
from cartridges_sdk.making.distractors import Distractors, Placement, draw
from cartridges_sdk.making.loss import student_loss
from cartridges_sdk.making.trainable import TrainableCartridge
from cartridges_sdk.making.training import TorchTrainer
from cartridges_sdk.trainer_inputs import TrainConfig
from cartridges_sdk.serve.store import CartridgeStore
from cartridges_sdk.serve.settings import SyncConfig

from conftest import TEXT
from test_sync import STUDY, TEXTS
from test_training import _conversations


def _others(lm):
    return [Cartridge.from_prefix(lm, TEXT[i * 90:], n) for i, n in ((1, 6), (2, 9), (3, 5))]


@pytest.mark.parametrize("placement", [Placement((), ()), Placement((2, 0), ()), Placement((1,), (0, 2)),
                                       Placement((), (1,))])
def test_the_prefix_is_the_composition_serving_makes(tiny_lm, placement):
    """The loss among distractors equals the loss worked out by hand with the composed cartridge in front."""
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    others = _others(tiny_lm)
    kv = Distractors(others, tiny_lm, 3).around(TrainableCartridge(init).layers(), placement)
    parts = [others[i] for i in placement.before] + [init] + [others[i] for i in placement.after]
    composed = Cartridge.compose(parts, reposition=True, model=tiny_lm) if len(parts) > 1 else init
    convs = _conversations(tiny_lm, n=2)
    loss, _ = student_loss(tiny_lm, TrainableCartridge(init), convs, kv=kv)
    want = 0.0
    for c in convs:
        logp = tiny_lm.logits(c.input_ids.tolist(), [composed]).log_softmax(-1)
        for t, pos in enumerate(c.target_positions):
            want -= float((np.exp(c.topk_logprobs[t]) * logp[pos - 1][c.topk_ids[t]].numpy()).sum())
    assert abs(float(loss.detach()) - want) <= 1e-3 * max(1.0, abs(want))


def test_the_draw_is_the_seed_and_step_alone():
    draws = [draw(5, 3, seed=0, step=s) for s in range(200)]
    assert draws == [draw(5, 3, seed=0, step=s) for s in range(200)]  # any rank, any resume, draws the same
    assert draws != [draw(5, 3, seed=1, step=s) for s in range(200)]
    counts = [len(d.before) + len(d.after) for d in draws]
    assert set(counts) == {0, 1, 2, 3}  # alone sometimes, never more than `most`
    assert all(len(set(d.before + d.after)) == len(d.before + d.after) for d in draws)  # no distractor twice
    assert {len(d.before) for d in draws if len(d.before + d.after) == 3} == {0, 1, 2, 3}  # every place
    assert all(not d.before and not d.after for d in (draw(0, 7, 0, s) for s in range(5)))
    assert all(not d.before and not d.after for d in (draw(5, 0, 0, s) for s in range(5)))  # max_distractors=0
    halves = [draw(5, 3, seed=0, step=s, alone=0.5) for s in range(400)]
    assert 150 < sum(not d.before and not d.after for d in halves) < 250  # about half the steps alone


def test_only_the_trainable_cartridge_learns_among_others(tiny_lm, tmp_path):
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    others = _others(tiny_lm)
    before = [[k.clone() for k in o.keys] for o in others]
    cfg = TrainConfig(lr=0.05, epochs=3, batch_tokens=60, eval_fraction=0.0, max_distractors=2)
    among = TorchTrainer().fit(init, _conversations(tiny_lm), tiny_lm, cfg, progress=False, distractors=others)
    alone = TorchTrainer().fit(init, _conversations(tiny_lm), tiny_lm, cfg, progress=False)
    assert all(p.grad is None for p in tiny_lm.model.parameters())
    assert all(torch.equal(a, b) for o, keys in zip(others, before) for a, b in zip(o.keys, keys))
    assert among.num_tokens == 12 and torch.equal(among.keys[0][:, :1], init.keys[0][:, :1])  # its sink stays
    assert not torch.equal(among.keys[0], alone.keys[0])  # the others changed what it learned
    assert among.meta.training["distractors"] == {"most": 2, "alone": 0.5,
                                                "content": [o.fingerprint for o in others]}
    assert "distractors" not in alone.meta.training


def test_a_run_resumes_only_among_the_same_distractors(tiny_lm, tmp_path, kill_at_step):
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    others = _others(tiny_lm)
    convs = _conversations(tiny_lm, n=8)
    cfg = TrainConfig(lr=0.03, epochs=2, batch_tokens=60, checkpoint_every=1, eval_fraction=0.0, max_distractors=2)
    straight = TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "a", progress=False,
                                  distractors=others)
    revive = kill_at_step(3)
    with pytest.raises(KeyboardInterrupt):
        TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "b", progress=False, distractors=others)
    revive()
    with pytest.raises(ConfigError, match="other settings or data.*distractors"):
        TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "b", progress=False,
                           distractors=others[:2])
    with pytest.raises(ConfigError, match="other settings or data.*distractors"):
        TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "b", progress=False)
    resumed = TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "b", progress=False,
                                 distractors=others)
    assert all(torch.equal(a, b) for a, b in zip(straight.keys, resumed.keys))


def test_bad_distractors_are_refused_by_name(tiny_llama, tiny_qwen):
    tiny_lm = tiny_llama
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    convs = _conversations(tiny_lm, n=2)
    with pytest.raises(ConfigError, match=r"distractors\[1\].*must be a Cartridge"):
        TorchTrainer().fit(init, convs, tiny_lm, progress=False, distractors=[_others(tiny_lm)[0], "b.safetensors"])
    with pytest.raises(IncompatibleCartridgeError, match=r"distractors\[0\]"):
        TorchTrainer().fit(init, convs, tiny_lm, progress=False,
                           distractors=[Cartridge.from_prefix(tiny_qwen, TEXT, 4)])
    too_long = [Cartridge.from_prefix(tiny_lm, TEXT, 800)] * 3  # 2,400 tokens of 2,048
    with pytest.raises(ConfigError, match="max_distractors"):
        Cartridge.from_corpus(TEXT, tiny_lm, num_tokens=12, distractors=too_long, progress=False, **STUDY)
    with pytest.raises(ConfigError, match="max_distractors=-1"):
        TrainConfig(max_distractors=-1)


def test_a_store_self_studies_among_its_other_cartridges(tmp_path, tiny_llama):
    texts = {"a": TEXTS["lighthouse.txt"], "b": TEXTS["railway.txt"], "c": TEXTS["orchard.md"]}
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    config = SyncConfig(tokens=24)
    store.sync(texts, config, progress=False)
    others = {n: store.get(n).fingerprint for n in ("b", "c")}
    assert store.self_study(texts, config, STUDY, limit=1, distractors=2, progress=False) == ("a",)
    training = store.get("a").meta.training
    assert training["distractors"] == {"most": 2, "alone": 0.5,
                                      "content": [others["b"], others["c"]]}
    assert not list((store.root / ".work").iterdir())  # the kept distractors went with the work folder
    with pytest.raises(ConfigError, match=r"\['max_distractors'\] are set by sync"):
        store.self_study(texts, config, {"max_distractors": 3})
    with pytest.raises(ConfigError, match="distractors=-1 must be a whole number"):
        store.self_study(texts, config, STUDY, distractors=-1)
