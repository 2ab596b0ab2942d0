#!/usr/bin/env bash
# Fourth session, third device call: sweeps around the new tile table (prefill order, chunk tiles
# with K gathered as rows, deeper decode pipelines), then the kernel and engine tests on the GPU.
# Usage (on the H200): bash benchmarks/gpu_session4c.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  timeout 300 python3 -m tilellm.cli bench kernels --workloads P1,P2,P3,C1,D3,D1,D4,E1D --sweep --no-peers \
    --json "$OUT/sweep.json"
} 2>&1 | tee "$OUT/sweep.log"
timeout 270 python3 -m pytest -q -x tests/kernels tests/engine/test_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.log"
