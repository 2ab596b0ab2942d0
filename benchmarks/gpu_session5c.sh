#!/usr/bin/env bash
# Fifth session, final device call: every kernel workload with its peers (paged query tiles now
# launched side by side), paged/decode also from CUDA graphs, P1 through the paged kernel; the
# fp16 path of the paged workloads; E1 and E2; the GPU-only tests.
# Usage (on the H200): bash benchmarks/gpu_session5c.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  timeout 170 python3 -m tilellm.cli bench kernels --graph --json "$OUT/kernels.json"
  timeout 60 python3 -m tilellm.cli bench kernels --dtype float16 --no-peers --graph \
    --workloads D3,V1,C1,P1P --json "$OUT/kernels_fp16.json"
} 2>&1 | tee "$OUT/kernels.log"
timeout 200 python3 -m tilellm.cli bench throughput --workloads E1,E2 --json "$OUT/engine.json" 2>&1 \
  | tr '\r' '\n' | grep -v "Processed prompts" | tail -24 | tee "$OUT/engine.log"
timeout 240 python3 -m pytest -q -m gpu tests/kernels tests/engine 2>&1 | tail -15 | tee "$OUT/tests.log"
