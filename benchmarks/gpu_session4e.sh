#!/usr/bin/env bash
# Fourth session, fifth device call: lazy rescaling as a prefill variant, and the fp16 path on the
# final tile table. Usage (on the H200): bash benchmarks/gpu_session4e.sh   ($OUT receives logs)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  timeout 150 python3 benchmarks/prefill_variants.py --round 3 --modes plain,lazy --json "$OUT/variants.json"
} 2>&1 | tee "$OUT/variants.log"
timeout 150 python3 -m tilellm.cli bench kernels --dtype float16 --no-peers \
  --workloads P1,P2,P3,D1,D3,V1,C1,E1D --json "$OUT/kernels_fp16.json" 2>&1 | tee "$OUT/kernels_fp16.log"
