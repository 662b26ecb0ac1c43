"""The cartridge as training holds it: its keys and values as parameters, with the frozen tokens kept apart.

Its own module, below the loss and the trainer that both read it.
"""

from __future__ import annotations

import torch

from ..cartridge import Cartridge
from ..fileformat import CartridgeMeta
from ..lm import LM


class TrainableCartridge(torch.nn.Module):
    """A cartridge's KV as parameters; the first `num_frozen` tokens are buffers and never change."""

    def __init__(self, init: Cartridge):
        super().__init__()
        nf = init.num_frozen
        self.num_frozen = nf
        self.frozen_keys = torch.nn.ParameterList(
            [torch.nn.Parameter(k[:, :nf].detach().float().clone(), requires_grad=False) for k in init.keys]
        )
        self.frozen_values = torch.nn.ParameterList(
            [torch.nn.Parameter(v[:, :nf].detach().float().clone(), requires_grad=False) for v in init.values]
        )
        self.keys = torch.nn.ParameterList([torch.nn.Parameter(k[:, nf:].detach().float().clone()) for k in init.keys])
        self.values = torch.nn.ParameterList([torch.nn.Parameter(v[:, nf:].detach().float().clone()) for v in init.values])

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (torch.cat([fk, k], dim=1), torch.cat([fv, v], dim=1))
            for fk, k, fv, v in zip(self.frozen_keys, self.keys, self.frozen_values, self.values)
        ]

    def to_cartridge(self, meta: CartridgeMeta, lm: LM | None, dtype: torch.dtype) -> Cartridge:
        kv = self.layers()
        return Cartridge([k.detach().to(dtype).clone() for k, _ in kv], [v.detach().to(dtype).clone() for _, v in kv], meta, lm=lm)
