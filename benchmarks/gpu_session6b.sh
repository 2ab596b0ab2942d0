#!/usr/bin/env bash
# Sixth session, second device call: the Gluon prefill kernel, lockstep vs warp-specialised
# (producer warp + two consumer warpgroups) vs ping-pong; correctness matrix then P1-P3 timings.
# Usage (on the H200): bash benchmarks/gpu_session6b.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 240 python3 benchmarks/prefill_hopper.py --variants "${VARIANTS:-128x3,ws128x2,ws128x3,pp128x2,pp128x3,ws64x4}" \
  --json "$OUT/prefill_hopper.json" 2>&1 | tee "$OUT/prefill_hopper.log"
