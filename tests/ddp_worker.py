"""One rank of a data-parallel training run, started by torchrun from test_distributed.py: every rank trains the
test's cartridge on its share of the data; rank 0 saves it. ``die_at`` > 0 makes rank 1 exit at that optimizer step,
as a killed process would. MODE ``shard`` shards the frozen model across the ranks (FSDP2), and rank 0 then prints
the share of the model's weights it holds; ``otherdata`` gives rank 1 fewer conversations than rank 0; ``among``
trains among the distractors `others` makes. (Run as a
script, its folder is on the import path, so the tests' helpers import.)

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_worker.py \
        OUT GRAD_ACCUM WORKDIR DIE_AT MODE [SETTING=INT ...]

(each SETTING=INT replaces that `TrainConfig` setting of `config`)
"""

from __future__ import annotations

import os
import sys

import attrs
import torch
from conftest import TEXT
from test_training import _conversations

from cartridges_sdk import Cartridge, testing
from cartridges_sdk.making.training import TorchTrainer
from cartridges_sdk.trainer_inputs import TrainConfig


def config(grad_accum: int, **changes: int) -> TrainConfig:
    return attrs.evolve(TrainConfig(lr=0.03, epochs=2, batch_tokens=60, grad_accum=grad_accum, checkpoint_every=1,
                                    eval_every=2), **changes)


def others(lm) -> list[Cartridge]:
    """Three small cartridges of other stretches of the text, to train among."""
    return [Cartridge.from_prefix(lm, TEXT[i * 90:], n) for i, n in ((1, 6), (2, 9), (3, 5))]


def data():
    lm = testing.tiny_lm("llama")
    return lm, Cartridge.from_prefix(lm, TEXT, 12), _conversations(lm, n=8)


if __name__ == "__main__":
    out, accum, workdir, die_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    changes = {name: int(value) for name, value in (arg.split("=", 1) for arg in sys.argv[6:])}
    lm, init, convs = data()
    if mode == "otherdata" and int(os.environ["RANK"]) == 1:
        convs = convs[:6]
    if die_at and int(os.environ["RANK"]) == 1:
        real, calls = torch.optim.Adam.step, {"n": 0}

        def dying(self, *a, **kw):
            calls["n"] += 1
            if calls["n"] == die_at:
                os._exit(1)
            return real(self, *a, **kw)

        torch.optim.Adam.step = dying
    whole = sum(p.numel() for p in lm.model.parameters())
    cartridge = TorchTrainer(shard_model=mode == "shard").fit(init, convs, lm, config(accum, **changes),
                                                                output_dir=workdir, progress=False,
                                                                distractors=others(lm) if mode == "among" else ())
    if int(os.environ["RANK"]) == 0:
        cartridge.save(out)
        held = sum(getattr(p, "_local_tensor", p).numel() for p in lm.model.parameters())
        print(f"rank 0 holds {held} of {whole} model weights")
