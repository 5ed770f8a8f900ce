#!/usr/bin/env bash
# The Hugging Face Optimum environment benchmarks/inference.py compares popbert against: its own
# virtualenv (popbert does not depend on Optimum and is not installed in it), every package
# pinned, CPU-only PyTorch.
#
#   benchmarks/optimum_env.sh                 # into benchmarks/.optimum-venv (git-ignored)
#   benchmarks/optimum_env.sh /some/dir       # anywhere else
#   python benchmarks/inference.py --optimum-python /some/dir/bin/python
#
# torch is installed first and alone as the CPU build (`2.13.0+cpu`: the local version label
# matches no CUDA wheel, and the wheel's CPU build depends on no nvidia-* package), then pinned
# by a constraints file while the rest installs, so nothing can replace it with a CUDA build.
# pip finds the CPU wheel through its configured find-links; elsewhere pass PyTorch's CPU index:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu benchmarks/optimum_env.sh
# onnxruntime is pinned to the version popbert's benchmark environment runs, so the files
# Optimum writes are timed by the same ONNX Runtime that made them (inference.py reports both).
#
# With --intel it builds optimum-intel's environment instead (OVModelFor..., OVQuantizer; the
# OpenVINO peer of popbert's `--runtime openvino` export), a separate virtualenv because
# optimum-intel 2.2 needs optimum 2.3 and the ONNX Runtime side is pinned to optimum 2.1:
#   benchmarks/optimum_env.sh --intel [DIR]   # into benchmarks/.optimum-intel-venv
#   python benchmarks/inference.py --variants ... optimum-intel --optimum-intel-python DIR/bin/python
# OpenVINO and NNCF are pinned to the versions popbert's environment times the IRs with.
# torchvision (an optimum-intel requirement) is removed again: pip's resolver picks one not built
# against torch 2.13's CPU wheel, whose operators fail to load and break transformers' imports;
# text models never use it.
set -euo pipefail
cd "$(dirname "$0")/.."
INTEL=0
if [[ "${1:-}" == "--intel" ]]; then
    INTEL=1
    shift
fi
if (( INTEL )); then
    VENV="${1:-benchmarks/.optimum-intel-venv}"
else
    VENV="${1:-benchmarks/.optimum-venv}"
fi
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0+cpu"

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip
INDEX=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    INDEX=(--index-url "$TORCH_INDEX_URL")
fi
"${PIP[@]}" install --quiet "${INDEX[@]}" --no-deps "$TORCH"

CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "$TORCH" > "$CONSTRAINTS"
if (( INTEL )); then
    # optimum-intel with what it pulls in (the versions this benchmark was measured with).
    "${PIP[@]}" install --quiet -c "$CONSTRAINTS" "$TORCH" \
        optimum-intel==2.2.0 optimum==2.3.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 \
        nncf==3.4.0 transformers==5.5.4 tokenizers==0.22.2 huggingface_hub==1.21.0 \
        numpy==2.4.6
    "${PIP[@]}" uninstall --quiet -y torchvision
    "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import sys

import torch
from optimum.intel import OVModelForSequenceClassification, OVQuantizer  # noqa: F401

if torch.version.cuda is not None:
    sys.exit(f"a CUDA torch in optimum-intel's environment: {torch.__version__}")
print(f"optimum-intel environment ready: {sys.prefix}: " + ", ".join(
    f"{name} {md.version(name)}" for name in ("optimum-intel", "optimum", "openvino", "nncf",
                                              "transformers", "torch")))
EOF
    exit 0
fi
# torch's own dependencies, then Optimum's ONNX Runtime extra (`optimum[onnxruntime]`) with every
# package it pulls in pinned (the versions this benchmark was measured with).
"${PIP[@]}" install --quiet -c "$CONSTRAINTS" \
    "$TORCH" \
    filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 mpmath==1.3.0 \
    networkx==3.6.1 sympy==1.14.0 typing_extensions==4.16.0 \
    optimum==2.1.0 optimum-onnx==0.1.0 onnxruntime==1.32.0 onnx==1.23.2 \
    transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2 hf-xet==1.8.0 \
    safetensors==0.8.0 numpy==2.4.6 protobuf==7.36.2 flatbuffers==25.12.19 \
    ml_dtypes==0.6.0 packaging==26.4 PyYAML==6.0.4 regex==2026.11.19 requests==2.34.2 \
    certifi==2026.10.19.post1 charset-normalizer==3.5.3 idna==3.20 urllib3==2.8.0 \
    tqdm==4.70.1

# Refuse an environment that a CUDA build slipped into.
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import sys

import torch

cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if d.metadata["Name"].lower().startswith(("nvidia-", "triton")))
if torch.version.cuda is not None or cuda:
    sys.exit(f"CUDA packages in the Optimum environment: torch {torch.__version__} "
             f"(CUDA {torch.version.cuda}), {cuda}")
import onnxruntime
import optimum.onnxruntime  # noqa: F401
import transformers

print(f"Optimum environment ready: {sys.prefix}: torch {torch.__version__}, "
      f"optimum {md.version('optimum')}, optimum-onnx {md.version('optimum-onnx')}, "
      f"onnxruntime {onnxruntime.__version__}, transformers {transformers.__version__}")
EOF
