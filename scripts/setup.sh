#!/usr/bin/env bash
# Install popbert into the active Python environment without pulling CUDA wheels on CPU machines:
# torch is pinned to the CPU build first, so setup.cfg's `torch>=2.4` is already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${POPBERT_TORCH_VERSION:-2.13.0}"
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install "$@" "torch==${TORCH_VERSION}"
fi
python -m pip install "$@" -e .
