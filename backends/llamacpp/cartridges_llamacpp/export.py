"""A cartridge as a llama.cpp sequence-state file, which llama.cpp's own server restores into a slot.

The file is what ``llama_state_seq_save_file`` writes: ``u32 'ggsq'``, ``u32 version 3``, ``u32 n_tokens``, the
tokens (``i32`` each), then the sequence's cells as in `state` (without the 8-byte header of the in-memory blob).
The tokens are what the server believes the cells hold: `placeholder` ids, which a request's prompt must start with
for the server to reuse the cells (see docs/llamacpp.md).

    python -m cartridges_llamacpp.export CARTRIDGE.safetensors OUT.bin [--flash-attn on|off]
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

from cartridges_sdk import Cartridge, UnsupportedModelError
from cartridges_sdk.kit import atomic_write

from .runtime import PAIRING, PLACEHOLDER_ID, _blob
from .state import Layout

GGSQ_MAGIC = 0x67677371
GGSQ_VERSION = 3
F16 = 1


def export_state_file(cartridge: Cartridge, path: str | os.PathLike, *, flash_attn: bool = True,
                      placeholder: int = PLACEHOLDER_ID) -> Path:
    """Write `cartridge` as a sequence-state file for a llama.cpp context with an f16 KV cache and one stream
    (llama-server with ``--parallel 1`` or ``--kv-unified``). `flash_attn`: the server's setting; on and auto
    (llama-server's default) keep V untransposed, off (``-fa off``) transposes it, and llama.cpp refuses a file of the
    other kind."""
    arch = cartridge.meta.model.architecture
    family = arch.get("model_type")
    if family not in PAIRING:
        raise UnsupportedModelError(f"llama.cpp state files are written for {sorted(PAIRING)} models; this cartridge "
                                    f"is for {family!r}.")
    layers, width = len(cartridge.keys), cartridge.keys[0].shape[0] * cartridge.keys[0].shape[2]
    layout = Layout(n_stream=1, stream=0, v_trans=not flash_attn, k_types=(F16,) * layers, v_types=(F16,) * layers,
                    width=width)
    p = cartridge.num_tokens
    cells = _blob(layout, cartridge, PAIRING[family])[8:]  # the file holds the cells without the in-memory header
    head = struct.pack("<III", GGSQ_MAGIC, GGSQ_VERSION, p) + struct.pack(f"<{p}i", *([placeholder] * p))
    path = Path(path)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(head + cells))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a cartridge as a llama.cpp sequence-state file (slot restore).")
    parser.add_argument("cartridge", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--flash-attn", choices=("on", "off"), default="on",
                        help="the server's flash attention: 'on' also for llama-server's default 'auto'")
    args = parser.parse_args(argv)
    cartridge = Cartridge.load(args.cartridge)
    out = export_state_file(cartridge, args.output, flash_attn=args.flash_attn == "on")
    print(f"wrote {out}: {cartridge.num_tokens} cells; a prompt must start with {cartridge.num_tokens} x token "
          f"{PLACEHOLDER_ID} to use them", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
