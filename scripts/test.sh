#!/usr/bin/env bash
# Set up, then run the test suite (pytest). Extra arguments go to pytest.
#   scripts/test.sh            the default tier (what CI runs)
#   scripts/test.sh --all      the default tier and the slow tier together
#   scripts/test.sh -m slow    the slow tier alone
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then args+=(-m "slow or not slow"); else args+=("$a"); fi
done
exec .venv/bin/python -m pytest ${args[@]+"${args[@]}"}
