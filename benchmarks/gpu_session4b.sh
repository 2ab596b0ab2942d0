#!/usr/bin/env bash
# Fourth session, second device call: the new tile table and prefill launch order, every kernel
# workload with its peers, X1 in a CUDA graph, E1 and E2.
# Usage (on the H200): bash benchmarks/gpu_session4b.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  timeout 150 python3 benchmarks/prefill_variants.py --round 2 --modes plain --json "$OUT/variants.json"
} 2>&1 | tee "$OUT/variants.log"
{
  timeout 300 python3 -m tilellm.cli bench kernels --json "$OUT/kernels.json"
  timeout 60 python3 benchmarks/cascade_splits.py
} 2>&1 | tee "$OUT/kernels.log"
timeout 300 python3 -m tilellm.cli bench throughput --workloads E1,E2 --json "$OUT/engine.json" 2>&1 \
  | tr '\r' '\n' | grep -v "Processed prompts" | tail -40 | tee "$OUT/engine.log"
