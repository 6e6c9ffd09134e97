#!/usr/bin/env bash
# Create a separate venv with SGLang 0.5.23's own benchmark client (sglang.bench_serving), to run it
# against a sglite server. Not used by CI. The venv is kept apart from the project's: torchvision pulls
# a newer torch. sglang is installed with --no-deps (its full dependency set is a GPU stack); then only
# what `python -m sglang.bench_serving` imports is added. pip prints dependency-conflict warnings; they
# are harmless for the client.
#
# Usage: benchmark/setup_client_venvs.sh [VENV_DIR]   (default: $SGLANG_CLIENT_VENV, else .venvs/sglang-client in
# the repository)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV=${1:-${SGLANG_CLIENT_VENV:-$REPO/.venvs/sglang-client}}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --no-deps "sglang==0.5.23"
"$VENV/bin/pip" install -q aiohttp tqdm numpy requests pybase64 orjson triton pillow starlette msgspec pyzmq \
  ipython datasets torchvision apache-tvm-ffi compressed-tensors transformers sentencepiece gguf
"$VENV/bin/python" -c "import sglang.bench_serving" && echo "sglang.bench_serving imports: $VENV"
