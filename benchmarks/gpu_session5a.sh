#!/usr/bin/env bash
# Fifth session, first device call: C1 launch order x tile configs x page order; decode/verify
# timed eagerly and from CUDA graphs; host time per eager call; D3's page-locality probe.
# Usage (on the H200): bash benchmarks/gpu_session5a.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.log"
timeout 200 python3 benchmarks/chunk_variants.py --json "$OUT/chunk.json" 2>&1 | tee "$OUT/chunk.log"
timeout 150 python3 -m tilellm.cli bench kernels --workloads D1,D2,D3,D4,V1,C1,X1,E1D --no-peers --graph \
  --json "$OUT/graph.json" 2>&1 | tee "$OUT/graph.log"
timeout 60 python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host.log"
timeout 120 python3 -m tilellm.cli bench kernels --workloads D3 --sweep --no-peers --json "$OUT/d3_sweep.json" \
  2>&1 | tee "$OUT/d3_sweep.log"
