#!/usr/bin/env bash
# Fourth session, last device call: every kernel workload with its peers on the final tile table,
# X1 in a CUDA graph, E1, then the GPU-only tests (bf16, real shapes, CUDA graphs).
# Usage (on the H200): bash benchmarks/gpu_session4d.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  timeout 150 python3 -m tilellm.cli bench kernels --json "$OUT/kernels.json"
  timeout 45 python3 benchmarks/cascade_splits.py
} 2>&1 | tee "$OUT/kernels.log"
timeout 150 python3 -m tilellm.cli bench throughput --workloads E1 --json "$OUT/engine.json" 2>&1 \
  | tr '\r' '\n' | grep -v "Processed prompts" | tail -20 | tee "$OUT/engine.log"
timeout 230 python3 -m pytest -q -m gpu tests/kernels tests/engine 2>&1 | tail -15 | tee "$OUT/tests.log"
