#!/usr/bin/env bash
# Fourth session, last device call: paged chunk tiles launched query-tiles-first (C1, V1, D4, X1),
# then the paged/cascade GPU tests. Usage (on the H200): bash benchmarks/gpu_session4f.sh
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  timeout 90 python3 -m tilellm.cli bench kernels --workloads C1,V1,D4,X1 --no-peers --json "$OUT/kernels.json"
  timeout 30 python3 benchmarks/cascade_splits.py
} 2>&1 | tee "$OUT/kernels.log"
timeout 90 python3 -m pytest -q -m gpu tests/kernels/test_paged.py tests/kernels/test_cascade.py \
  tests/kernels/test_schedule.py 2>&1 | tail -5 | tee "$OUT/tests.log"
