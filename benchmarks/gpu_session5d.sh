#!/usr/bin/env bash
# Fifth session, last device call: chunk tiles of 64 keys three deep (C1, X1's cascade prefix
# pass, P1P, V1 unchanged as a control), E2, and the paged/cascade/engine GPU tests.
# Usage (on the H200): bash benchmarks/gpu_session5d.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 90 python3 -m tilellm.cli bench kernels --workloads V1,C1,P1P,X1 --no-peers --graph \
  --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
timeout 120 python3 -m tilellm.cli bench throughput --workloads E2 --json "$OUT/engine.json" 2>&1 \
  | tr '\r' '\n' | grep -v "Processed prompts" | tail -8 | tee "$OUT/engine.log"
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_paged.py tests/kernels/test_cascade.py tests/engine \
  2>&1 | tail -6 | tee "$OUT/tests.log"
