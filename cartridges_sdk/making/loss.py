"""The student's loss: the frozen model with the trainable cartridge in front, against the teacher's top-k.

`student_loss` lays a batch out and runs `Student`, whose output layer and loss come ``OUTPUT_CHUNK`` target
positions at a time (`OutputLoss`), so the ``[targets, vocab]`` logits never exist whole. With ``shard_model`` the
student is the model sharded across the ranks with FSDP2 (`sharded_student`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ConfigError
from ..lm import LM
from ..trainer_inputs import SEED_KIND_DOCUMENT, Conversation
from .trainable import TrainableCartridge

# target positions whose logits are in memory at once (256 x a 50k vocabulary in float32 = 50 MB); on a GPU more,
# since each chunk costs the host about ten kernel launches whatever its size (2,048 x a 152k vocabulary = 1.2 GB)
OUTPUT_CHUNK = 256
OUTPUT_CHUNK_GPU = 2048


def target_weights(batch: Sequence[Conversation], conversation_weight: float = 1.0) -> np.ndarray:
    """Each target token's weight in the loss: 1 for document windows, `conversation_weight` for conversations."""
    return np.concatenate([
        np.full(len(c.target_positions), 1.0 if c.seed_kind == SEED_KIND_DOCUMENT else conversation_weight, np.float32)
        for c in batch
    ])


class Student(torch.nn.Module):
    """The frozen model's body and output layer as one module whose forward is the loss.

    One module, so FSDP2 can shard the whole model (`shard_model`): its root unit gathers the embeddings, final norm
    and output layer for the forward, while each decoder layer is a unit of its own."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask, position_ids, cache, rows, positions, top_ids, top_p, weights):
        hidden = self.model.base_model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                                       past_key_values=cache, use_cache=True).last_hidden_state
        head = self.model.get_output_embeddings()
        return OutputLoss.apply(hidden[rows, positions], head.weight, head.bias, top_ids, top_p, weights)


def check_shardable(ranks: int) -> None:
    """Refuse `shard_model` where there is nothing to shard across, before any work."""
    if ranks < 2:
        raise ConfigError("shard_model=True splits the model across ranks; run under torchrun with 2 or more "
                          "(--nproc N), or train without it.")


def sharded_student(lm: LM) -> Student:
    """Shard `lm`'s frozen weights across the ranks with FSDP2 (each decoder layer a unit, the rest the root unit),
    in place: afterwards `lm` serves only this training. The cartridge is not part of it and stays whole on every
    rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = getattr(lm.model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"shard_model=True needs a model whose decoder layers are `model.layers` (Llama, Qwen2, "
                          f"Mistral, ...); {type(lm.model).__name__} has none. Train without shard_model.")
    mesh = init_device_mesh(lm.device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(Student(lm.model), mesh=mesh)


def student_loss(
    lm: LM, cartridge: TrainableCartridge, batch: Sequence[Conversation], objective: str = "distill",
    conversation_weight: float = 1.0, student: Student | None = None, kv: list | None = None,
) -> tuple[torch.Tensor, float]:
    """Weighted sum of the loss over the batch's target tokens, and the sum of weights (divide for the mean).

    With the default weights each target token counts once, so the second value is the number of target tokens.
    `student` is the model as `sharded_student` made it, when it is sharded; `kv` the prefix's per-layer keys and
    values when it is more than the cartridge (the cartridge among distractors, `Distractors.around`)."""
    from transformers import DynamicCache

    device = lm.device
    rows = len(batch)
    width = max(c.num_tokens for c in batch)
    ids = torch.full((rows, width), lm.pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, c in enumerate(batch):
        ids[r, : c.num_tokens] = torch.from_numpy(c.input_ids.astype(np.int64))
        mask[r, : c.num_tokens] = 1
    ids, mask = ids.to(device), mask.to(device)
    layers = kv if kv is not None else cartridge.layers()
    p = layers[0][0].shape[1]
    dtype = lm.dtype
    data = [(k.to(dtype)[None].expand(rows, -1, -1, -1), v.to(dtype)[None].expand(rows, -1, -1, -1)) for k, v in layers]
    cache = DynamicCache(ddp_cache_data=data, config=lm.model.config)
    # only the positions that predict a target token go through the (large) output layer
    row_idx = torch.cat([torch.full((len(c.target_positions),), r, dtype=torch.long) for r, c in enumerate(batch)])
    pos = torch.cat([torch.from_numpy(c.target_positions.astype(np.int64)) for c in batch])
    if objective == "ntp":
        top_ids = ids[row_idx.to(device), pos.to(device)][:, None]
        top_p = torch.ones(top_ids.shape, device=device)
    else:
        top_ids = torch.from_numpy(np.concatenate([c.topk_ids for c in batch]).astype(np.int64)).to(device)
        top_p = torch.from_numpy(np.concatenate([c.topk_logprobs for c in batch])).to(device).exp()
    weights = target_weights(batch, conversation_weight)
    loss = (student or Student(lm.model))(
        ids, torch.cat([torch.ones(rows, p, dtype=torch.long, device=device), mask], dim=1),
        (p + torch.arange(width, device=device))[None].expand(rows, -1), cache, row_idx.to(device),
        (pos - 1).to(device), top_ids, top_p, torch.from_numpy(weights).to(device),
    )
    return loss, float(weights.sum())


class OutputLoss(torch.autograd.Function):
    """The output layer and the loss at the target positions, ``OUTPUT_CHUNK`` positions at a time.

    Per target position: ``-sum_k p(k) log softmax(h W^T + b)_k`` over the target's ids `k` (the teacher's top-k, or
    the next token with ``p = 1``), times its weight; summed. The gradient with respect to the hidden states is
    worked out in the same pass, so the ``[targets, vocab]`` logits never exist whole (in float32 with their
    log-softmax and gradients they took about 1 GB more in a 2,048-token step). The layer is frozen: it gets no
    gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, top_ids, top_p, weights):
        need_grad = ctx.needs_input_grad[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        chunk = OUTPUT_CHUNK if hidden.device.type == "cpu" else OUTPUT_CHUNK_GPU
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            lse = logits.logsumexp(-1)
            p, w = top_p[rows].float(), weights[rows].float()
            mass = p.sum(-1)
            total += (w * (mass * lse - (p * logits.gather(-1, top_ids[rows])).sum(-1))).sum()
            if need_grad:  # d loss / d logits = w * (mass * softmax - p at the target ids)
                g = (logits - lse[:, None]).exp_().mul_((w * mass)[:, None])
                g.scatter_add_(-1, top_ids[rows], -(w[:, None] * p))
                grad[rows] = g.to(weight.dtype) @ weight
        if need_grad:
            ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None, None
