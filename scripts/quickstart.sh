#!/usr/bin/env bash
# Set up, then build a cartridge for the sample corpus with the embedded default model (offline) and ask it questions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
