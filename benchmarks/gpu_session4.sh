#!/usr/bin/env bash
# Fourth session, first device call: prefill loop/tile variants, V1/C1/D3 sweeps, E1 fused vs unfused.
# Usage (on the H200): bash benchmarks/gpu_session4.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  timeout 300 python3 benchmarks/prefill_variants.py --modes plain,prefetch --json "$OUT/variants.json"
} 2>&1 | tee "$OUT/variants.log"
timeout 150 python3 benchmarks/prefill_variants.py --modes ws 2>&1 | grep -v "^ *$" | cut -c1-300 | tail -30 >"$OUT/ws.log"
cat "$OUT/ws.log"
timeout 240 python3 -m tilellm.cli bench kernels --workloads V1,C1,D3 --sweep --no-peers \
  --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
timeout 300 python3 -m tilellm.cli bench throughput --workloads E1 --compare-fused \
  --json "$OUT/fused.json" 2>&1 | tail -40 | tee "$OUT/fused.log"
