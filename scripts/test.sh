#!/usr/bin/env bash
# Set up, then run the test suite (pytest). Extra arguments go to pytest, e.g. `scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
