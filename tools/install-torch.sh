#!/bin/sh
# Install PyTorch into the virtual environment whose python is $1, without pulling a CUDA build onto a
# machine that has no NVIDIA GPU.
#   GPU machine (nvidia-smi works): the normal build from the package index (CUDA wheels).
#   CPU machine: the CPU-only build (about 200 MB instead of several GB): first from whatever index or
#   wheel folder pip is configured with, then from PyTorch's own CPU wheel index.
# Set TORCH_SPEC to choose another version, e.g. TORCH_SPEC='torch==2.6.0'.
set -eu
PY="$1"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if "$PY" -c 'import torch' 2>/dev/null; then
    echo "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "NVIDIA GPU found: installing the CUDA build of torch"
    exec "$PY" -m pip install "torch>=2.4"
fi
echo "no NVIDIA GPU: installing the CPU build of torch $TORCH_VERSION"
"$PY" -m pip install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
    || "$PY" -m pip install "torch==$TORCH_VERSION+cpu" --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" \
        --extra-index-url "${PIP_INDEX_URL:-https://pypi.org/simple}"
