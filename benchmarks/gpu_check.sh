#!/bin/bash
# The CUDA/NCCL path and the GPU numbers in one run (benchmarks/gpu_check.py; under 8 minutes on one GPU), then
# torchtitan with gradcompress (benchmarks/gpu_torchtitan.py; 2 GPUs).
# Run from the repository root on a machine with CUDA and a CUDA build of torch; prints one JSON line per section.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" timeout 480 python benchmarks/gpu_check.py "$@"
# torchtitan's llama3 debug model with gradcompress on CUDA/NCCL (FSDP int8, DiLoCo int2 + Muon; 2 GPUs or it says why not)
if python -c "import torchtitan" 2>/dev/null; then
  PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" timeout 900 python benchmarks/gpu_torchtitan.py
else
  echo '{"section": "torchtitan", "skipped": "torchtitan not installed: pip install -e .[torchtitan]"}'
fi
