#!/usr/bin/env bash
# Sixth session, second device call: the Gluon prefill kernel, warp-specialised
# (producer warp + two consumer warpgroups) with and without ping-pong (run 33 also timed the lockstep kernel since removed); correctness matrix then P1-P3 timings.
# Usage (on the H200): bash benchmarks/gpu_session6b.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 240 python3 benchmarks/prefill_hopper.py --variants "${VARIANTS:-pp128x3,ws128x3}" \
  --json "$OUT/prefill_hopper.json" 2>&1 | tee "$OUT/prefill_hopper.log"
