#!/usr/bin/env bash
# Every GPU check and measurement in one command, in about 10 minutes on one GPU (results:
# RESULTS.md): first each model family's short pre-training run with BF16, compile, a kill and
# resume, and the export (benchmarks/gpu_check.py); then phase-1 sequences/s and MFU for
# BERT-Base and BERT-Large (popbert and the fair HF peer), packed vs padded at 512, the optimizer steps, trimmed padding and the sequence-length curriculum;
# last, `popbert serve --device cuda` under 1, 32 and 128 clients (benchmarks/serve.py).
#   benchmarks/gpu.sh              # on a CUDA machine
#   benchmarks/gpu.sh --dry-run    # anywhere: toy shapes on the CPU, checks the scripts only
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}  # the interpreter that has torch (PYTHON=... to pick another)
if [[ "${1:-}" == "--dry-run" ]]; then
    $python benchmarks/gpu_check.py --dry-run --families bert
    $python benchmarks/gpu_suite.py --dry-run
    $python benchmarks/optimizer_step.py --small --device cpu --steps 1 --warmup 1
    $python benchmarks/curriculum_step.py --steps 1 --warmup 0
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $python benchmarks/gpu_check.py || echo "gpu_check: some family failed (table above)"
    $python benchmarks/gpu_suite.py "$@"
    $python benchmarks/optimizer_step.py --device cuda --steps 10 --warmup 3
    $python benchmarks/trim_padding.py --device cuda --compute bfloat16
    $python benchmarks/curriculum_step.py --device cuda --sequence-length 128 --lengths 64 32
    $python benchmarks/curriculum_step.py --device cuda --sequence-length 512 --lengths 256 128
    # popbert serve on the GPU (--device cuda): 1 client against 32 and 128, and the
    # hand-written sentence-transformers server on the same GPU
    $python benchmarks/serve.py --sides popbert-fp32-cuda popbert-fp16-cuda st-server-cuda \
        --levels 1 32 128 --requests 300 1500 2500 --seconds 15 --work /tmp/popbert-serve-gpu \
        --out benchmarks/serve_results_gpu.json || echo "serve.py on the GPU failed"
fi
