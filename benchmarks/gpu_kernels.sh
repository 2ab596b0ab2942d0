#!/usr/bin/env bash
# One device call: kernel tests on the GPU (bf16 included), then the kernel benchmark with peers
# and sweeps. Usage (on the H200): bash benchmarks/gpu_kernels.sh  ($OUT receives the logs/JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -m tilellm.cli bench kernels --sweep ${BENCH_ARGS:-} --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
