#!/bin/bash
# The CUDA/NCCL path and the GPU numbers in one run (benchmarks/gpu_check.py; under 8 minutes on one GPU).
# Run from the repository root on a machine with CUDA and a CUDA build of torch; prints one JSON line per section.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" timeout 480 python benchmarks/gpu_check.py "$@"
