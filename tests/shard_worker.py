"""One rank of a synthesis shared under torchrun, started by test_distributed.py: every rank synthesizes the test's
tiny dataset into one folder. MODE ``differ`` gives rank 1 another top_k; ``apart`` gives it a folder of its own, as
on a machine that does not share rank 0's. (Run as a script, its folder is on the import path.)

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/shard_worker.py FOLDER MODE
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conftest import TEXT
from test_synthesis import SHARDED, _config

from cartridges_sdk import testing
from cartridges_sdk.hf import HFSynthesizer
from cartridges_sdk.making.synthesis import synthesize

if __name__ == "__main__":
    folder, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    lm = testing.tiny_lm("llama")
    config = _config(**{**SHARDED, "top_k": 3}) if mode == "differ" and rank == 1 else _config(**SHARDED)
    output = folder.with_name(folder.name + "-apart") if mode == "apart" and rank == 1 else folder
    ds = synthesize(TEXT, lm, output, config, synthesizer=HFSynthesizer(lm), progress=False)
    print(f"rank {rank}: {len(ds)} sequences")
