#!/usr/bin/env bash
# The GPU benchmark (docs/gpu.md) in one command, for a machine with a CUDA GPU and no network.
#
#   scripts/gpu-bench.sh prepare      # here, with the project set up: writes .gpu/ (tokenizer, a document)
#   scripts/gpu-bench.sh [OUT_DIR]    # there, from a copy of this tree with .gpu/ in it: exactness, serving,
#                                     # self-study; figures to OUT_DIR/gpu.json (default benchmarks/results)
#
# There, python3 must already hold torch (CUDA) and transformers, as GPU images do; wheels of anything else it
# lacks go in .gpu/wheels/ and are installed offline first. Extra arguments after OUT_DIR go to
# `python -m benchmarks.gpu run`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "prepare" ]; then
  exec .venv/bin/python -m benchmarks.gpu prepare .gpu
fi
out=${1:-benchmarks/results}
shift || true
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-bench: no CUDA GPU visible to $PYTHON (torch missing or torch.cuda.is_available() is False); run this on a GPU machine." >&2
  exit 2
fi
if [ ! -d .gpu/tokenizer ]; then
  echo "gpu-bench: .gpu/tokenizer is missing; run 'scripts/gpu-bench.sh prepare' where the project is set up and bring .gpu/ along." >&2
  exit 2
fi
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-bench-site .gpu/wheels/*.whl
  export PYTHONPATH=/tmp/gpu-bench-site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 exec "$PYTHON" -m benchmarks.gpu run --assets .gpu --out "$out/gpu.json" "$@"
