#!/usr/bin/env bash
# Set up the core (no backends: scripts/setup.sh installs those, and scripts/test.sh runs it), then build a cartridge
# for the sample corpus with the embedded default model (offline) and ask it questions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --core
exec .venv/bin/python examples/quickstart.py "$@"
