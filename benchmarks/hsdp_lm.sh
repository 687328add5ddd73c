#!/usr/bin/env bash
# The LM task (byte-level transformer, AdamW, 4 workers as 2 nodes x 2, 300 steps) under HSDP: dense, int8, int4,
# and int8 with int8 parameters (STEPS=300 by default, as in BENCHMARKS.md). Output: one line per run.
set -euo pipefail
steps=${STEPS:-300}
run() { python -m gradcompress train --task lm --workers 4 --steps "$steps" "$@" 2>&1 | grep -v "device_mesh\|Warning\|^ " | tail -1; }
run --codec none --fsdp --hsdp
run --codec int8 --fsdp --hsdp
run --codec int4 --fsdp --hsdp
run --codec int8 --fsdp --hsdp --params int8
