"""Distillation training: the loss by hand, where gradients go, checkpoints and resume."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from cartridges_sdk import Cartridge, ConfigError
from cartridges_sdk.making.loss import student_loss
from cartridges_sdk.making.trainable import TrainableCartridge
from cartridges_sdk.making.training import TorchTrainer, pack
from cartridges_sdk.trainer_inputs import Conversation, TrainConfig

from conftest import TEXT


def _conversations(lm, n=6, k=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = lm.chat_ids([{"role": "user", "content": f"Question {i}?"}]) + lm.tokenizer(f"Answer {i} here.", add_special_tokens=False)["input_ids"]
        start = len(ids) - 8
        targets = np.arange(start, len(ids), dtype=np.int32)
        top_ids = rng.integers(0, 90, size=(len(targets), k)).astype(np.int32)
        lp = np.log(rng.dirichlet(np.ones(k + 1), size=len(targets))[:, :k]).astype(np.float32)
        out.append(Conversation(i, i // 2, (0, 10), "question", np.asarray(ids, np.int32), np.zeros(len(ids), np.int8),
                                targets, top_ids, lp))
    return out


def test_loss_equals_hand_computation(tiny_lm):
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    cart = TrainableCartridge(init)
    convs = _conversations(tiny_lm, n=2)
    loss, count = student_loss(tiny_lm, cart, convs)
    loss = loss.detach()
    want, n = 0.0, 0
    for c in convs:
        logp = tiny_lm.logits(c.input_ids.tolist(), [init]).log_softmax(-1)
        for t, pos in enumerate(c.target_positions):
            row = logp[pos - 1]
            want -= float((np.exp(c.topk_logprobs[t]) * row[c.topk_ids[t]].numpy()).sum())
            n += 1
    assert count == n
    assert abs(float(loss) - want) <= 1e-3 * max(1.0, abs(want))


def test_conversation_weight_scales_conversation_tokens_only(tiny_lm):
    """Loss = sum(w * token loss) / sum(w), w = 1 for document windows and `conversation_weight` otherwise."""
    import attrs

    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    cart = TrainableCartridge(init)
    conv, window = _conversations(tiny_lm, n=2)
    window = attrs.evolve(window, seed_kind="document")
    (lc, nc), (lw, nw) = (student_loss(tiny_lm, cart, [c]) for c in (conv, window))
    loss, weight = student_loss(tiny_lm, cart, [conv, window], conversation_weight=0.25)
    assert weight == pytest.approx(0.25 * nc + nw)
    assert float(loss.detach()) == pytest.approx(0.25 * float(lc.detach()) + float(lw.detach()), rel=1e-4)


def test_zero_conversation_weight_trains_on_windows_or_says_why_not(tiny_lm):
    import attrs

    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    convs = _conversations(tiny_lm)
    with pytest.raises(ConfigError, match="no document windows"):
        TorchTrainer().fit(init, convs, tiny_lm, TrainConfig(conversation_weight=0.0), progress=False)
    trainer = TorchTrainer()
    trainer.fit(init, convs[:3] + [attrs.evolve(c, seed_kind="document") for c in convs[3:]], tiny_lm,
                TrainConfig(conversation_weight=0.0, eval_fraction=0.0), progress=False)
    assert trainer.history[-1]["step"] == 1  # three windows fit one batch; the three conversations were left out


def test_next_token_objective(tiny_lm):
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    c = _conversations(tiny_lm, n=1)[0]
    loss, _ = student_loss(tiny_lm, TrainableCartridge(init), [c], objective="ntp")
    loss = loss.detach()
    logp = tiny_lm.logits(c.input_ids.tolist(), [init]).log_softmax(-1)
    want = -sum(float(logp[p - 1, c.input_ids[p]]) for p in c.target_positions)
    assert abs(float(loss) - want) <= 1e-3 * abs(want)


def test_gradients_reach_only_trainable_tokens(tiny_lm):
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12, num_frozen=2)
    out = TorchTrainer().fit(init, _conversations(tiny_lm), tiny_lm, TrainConfig(lr=0.05, eval_fraction=0.0), progress=False)
    assert all(p.grad is None for p in tiny_lm.model.parameters())
    for i in range(init.num_layers):
        assert torch.equal(out.keys[i][:, :2], init.keys[i][:, :2])  # frozen sink untouched
        assert torch.equal(out.values[i][:, :2], init.values[i][:, :2])
        assert not torch.equal(out.keys[i][:, 2:], init.keys[i][:, 2:])  # the rest learned
    assert out.meta.init == "trained" and out.meta.extra["init"] == "prefix"
    assert out.meta.training["steps"] >= 1


def _distilled(lm, context: str, n=4, k=8):
    """Conversations whose targets are the model's own top-k with `context` in front: a real teacher."""
    convs = _conversations(lm, n=n, k=k)
    ctx = lm.encode(context)
    out = []
    for c in convs:
        logp = lm.logits(ctx + c.input_ids.tolist()).log_softmax(-1)[len(ctx) - 1 :]
        top = torch.topk(logp[c.target_positions - 1], k, dim=-1)
        out.append(Conversation(c.conv_id, c.group, c.chunk, c.seed_kind, c.input_ids, c.role_mask, c.target_positions,
                                top.indices.numpy().astype(np.int32), top.values.numpy().astype(np.float32)))
    return out


def test_training_moves_the_student_toward_the_teacher(tiny_lm):
    convs = _distilled(tiny_lm, TEXT[:200])
    init = Cartridge.from_random_text(tiny_lm, 24)
    cfg = TrainConfig(lr=0.1, epochs=20, eval_fraction=0.0, batch_tokens=10**6, schedule="constant")
    trainer = TorchTrainer()
    trainer.fit(init, convs, tiny_lm, cfg, progress=False)
    losses = [h["loss"] for h in trainer.history]
    # the loss is KL(teacher || student) plus the teacher's (constant) entropy over its top-k
    entropy = float(np.mean([-(np.exp(c.topk_logprobs) * c.topk_logprobs).sum(-1).mean() for c in convs]))
    assert losses[-1] - entropy < 0.5 * (losses[0] - entropy)


def test_pack_respects_the_token_budget(tiny_lm):
    import random

    convs = _conversations(tiny_lm, n=6)
    longest = max(c.num_tokens for c in convs)
    for batch in pack(convs, 2 * longest, random.Random(0)):
        assert len(batch) * max(c.num_tokens for c in batch) <= 2 * longest
    assert sorted(c.conv_id for b in pack(convs, 2 * longest, random.Random(0)) for c in b) == list(range(6))


def test_resume_gives_identical_results(tiny_lm, tmp_path, kill_at_step):
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    convs = _conversations(tiny_lm, n=8)
    cfg = TrainConfig(lr=0.03, epochs=2, batch_tokens=60, checkpoint_every=1, eval_every=2)
    straight = TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "a", progress=False)

    revive = kill_at_step(4)
    with pytest.raises(KeyboardInterrupt):
        TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "b", progress=False)
    revive()
    resumed_trainer = TorchTrainer()
    resumed = resumed_trainer.fit(init, convs, tiny_lm, cfg, output_dir=tmp_path / "b", progress=False)
    assert resumed_trainer.history[2]["step"] == 3  # picked up after the 3 finished steps
    for i in range(init.num_layers):
        assert torch.equal(straight.keys[i], resumed.keys[i]) and torch.equal(straight.values[i], resumed.values[i])
    assert (tmp_path / "b" / "train_log.jsonl").read_text().count("\n") >= len(resumed_trainer.history)


def test_resume_with_other_settings_is_refused(tiny_lm, tmp_path):
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    convs = _conversations(tiny_lm, n=4)
    TorchTrainer().fit(init, convs, tiny_lm, TrainConfig(eval_fraction=0.0), output_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="other settings"):
        TorchTrainer().fit(init, convs, tiny_lm, TrainConfig(lr=0.1, eval_fraction=0.0), output_dir=tmp_path, progress=False)


def test_bad_training_settings():
    with pytest.raises(ConfigError, match="lr"):
        TrainConfig(lr=0)
    with pytest.raises(ConfigError, match="objective"):
        TrainConfig(objective="mse")


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_output_loss_matches_autograd_of_the_plain_formula(monkeypatch, bias):
    """The output layer's loss and its gradient come chunk by chunk (the logits never exist whole); both must equal
    autograd's on the plain formula, with weights, partial teacher mass and repeated ids."""
    from cartridges_sdk.making import loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64)
    b = torch.randn(50, generator=g, dtype=torch.float64) if bias else None
    top_ids = torch.randint(0, 50, (37, 4), generator=g)
    top_p = torch.rand(37, 4, generator=g, dtype=torch.float64) / 5
    weights = torch.rand(37, generator=g, dtype=torch.float64)

    plain_h = hidden.clone().requires_grad_()
    logp = torch.nn.functional.linear(plain_h, weight, b).log_softmax(-1)
    plain = -(weights * (top_p * logp.gather(-1, top_ids)).sum(-1)).sum()
    (3 * plain).backward()

    monkeypatch.setattr(loss, "OUTPUT_CHUNK", 10)
    chunked_h = hidden.clone().requires_grad_()
    chunked = loss.OutputLoss.apply(chunked_h, weight, b, top_ids, top_p, weights)
    (3 * chunked).backward()
    assert float(chunked.detach()) == pytest.approx(float(plain.detach()), rel=1e-5)
    torch.testing.assert_close(chunked_h.grad, plain_h.grad.to(chunked_h.grad.dtype), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_from_before_ranks_still_resumes(tiny_lm, tmp_path):
    """Checkpoints written before data-parallel training recorded grad_accum (one process): read as the
    micro-batches per step, they resume instead of being refused as other settings."""
    init = Cartridge.from_prefix(tiny_lm, TEXT, 12)
    convs = _conversations(tiny_lm, n=4)
    cfg = TrainConfig(grad_accum=2, eval_fraction=0.0)
    done = TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path, progress=False)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    config = dict(state["run"]["config"])
    config["grad_accum"] = config.pop("micro_batches_per_step")
    torch.save({**state, "run": {**state["run"], "config": config}}, tmp_path / "checkpoint.pt")
    again = TorchTrainer().fit(init, convs, tiny_lm, cfg, output_dir=tmp_path, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(done.keys + done.values, again.keys + again.values))


def test_bf16_is_measured_only_where_the_hardware_computes_it(monkeypatch):
    """An x86 CPU without AVX512-BF16 or AMX emulates bf16, so "fastest" keeps the model's own dtype there
    unmeasured; any other CPU or device, or a torch that cannot say, is measured."""
    from cartridges_sdk.making import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    for avx512_bf16, amx, measured in [(False, False, False), (True, False, True), (False, True, True)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert precision.bf16_in_hardware(cpu) is measured, (avx512_bf16, amx)
    assert precision.bf16_in_hardware(torch.device("cuda"))  # GPUs are measured
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert precision.bf16_in_hardware(cpu)  # this torch cannot tell
    monkeypatch.setattr(precision.platform, "machine", lambda: "arm64")
    assert precision.bf16_in_hardware(cpu)


def test_the_fastest_work_dtype_is_measured_per_stage_once_per_run(tiny_llama, monkeypatch):
    """work_dtype="fastest" picks bfloat16 for a stage only where that stage's miniature runs clearly faster in it
    (the 135M model trains faster in bf16 and synthesizes slower), and a self-study run measures once, for both
    stages, recording each stage's dtype in the cartridge."""
    from cartridges_sdk.making import precision

    # a toy model is not measured: it computes in its own dtype
    assert precision.resolve_work_dtype(tiny_llama, "fastest") == {"synthesis": None, "training": None}
    monkeypatch.setattr(precision, "SMALLEST_MEASURED", 0)
    # nor on a CPU that has no bf16 arithmetic (an x86 without AVX512-BF16 or AMX): bf16 cannot win there
    monkeypatch.setattr(precision, "bf16_in_hardware", lambda device: False)
    assert precision.resolve_work_dtype(tiny_llama, "fastest") == {"synthesis": None, "training": None}
    monkeypatch.setattr(precision, "bf16_in_hardware", lambda device: True)
    assert set(precision.resolve_work_dtype(tiny_llama, "fastest").values()) <= {torch.float32, torch.bfloat16}
    assert precision.resolve_work_dtype(tiny_llama, "BF16") == {"synthesis": torch.bfloat16, "training": torch.bfloat16}
    assert precision.resolve_work_dtype(tiny_llama, None) == {"synthesis": None, "training": None}
    with pytest.raises(ConfigError, match="not supported"):
        precision.resolve_work_dtype(tiny_llama, "fastest-please")
    # seconds per run of each stage's miniature, by dtype: a slow warm-up round and a loaded round decide nothing
    times = {"synthesis": {torch.float32: [9.0, 1.0, 1.0], torch.bfloat16: [9.0, 5.0, 0.9]},
             "training": {torch.float32: [9.0, 1.0, 1.0], torch.bfloat16: [9.0, 0.6, 5.0]}}

    def probe(stage):
        def make(lm):
            runs = list(times[stage][lm.dtype])
            return lambda: runs.pop(0)
        return make

    monkeypatch.setattr(precision, "_synthesis_probe", probe("synthesis"))
    monkeypatch.setattr(precision, "_training_probe", probe("training"))
    assert precision.fastest_dtypes(tiny_llama) == {"synthesis": torch.float32, "training": torch.bfloat16}
    assert tiny_llama.in_dtype(torch.bfloat16) is tiny_llama.in_dtype(torch.bfloat16)
    measured = []
    monkeypatch.setattr(precision, "_CHOSEN", weakref.WeakKeyDictionary())
    monkeypatch.setattr(precision, "fastest_dtypes", lambda lm, stages=precision.STAGES: measured.append(lm) or
                        {"synthesis": torch.float32, "training": torch.bfloat16})
    cart = Cartridge.from_corpus(TEXT[:400], tiny_llama, num_tokens=8, num_conversations=2, document_windows=0,
                                 max_tokens_a=4, max_tokens_b=4, min_chunk=32, max_chunk=64, work_dtype="fastest",
                                 progress=False)
    assert len(measured) == 1
    assert (cart.meta.training["synthesis_dtype"], cart.meta.training["work_dtype"]) == ("float32", "bfloat16")
    precision.resolve_work_dtype(tiny_llama, "fastest")
    assert len(measured) == 1  # once per model and process
    assert cart.keys[0].dtype == tiny_llama.dtype  # bound to the model it was asked for
    # the quality report only synthesizes, so it times synthesis alone; a later run times training, once
    asked = []
    monkeypatch.setattr(precision, "_CHOSEN", weakref.WeakKeyDictionary())
    monkeypatch.setattr(precision, "fastest_dtypes", lambda lm, stages=precision.STAGES: asked.append(stages) or
                        dict.fromkeys(stages, torch.bfloat16))
    assert precision.resolve_work_dtype(tiny_llama, "fastest", stages=("synthesis",)) == {"synthesis": torch.bfloat16}
    assert precision.resolve_work_dtype(tiny_llama, "fastest") == dict.fromkeys(precision.STAGES, torch.bfloat16)
    precision.resolve_work_dtype(tiny_llama, "fastest")
    assert asked == [("synthesis",), ("training",)]
    with pytest.raises(ConfigError, match="'decoding' is not one of"):
        precision.resolve_work_dtype(tiny_llama, "fastest", stages=("decoding",))
