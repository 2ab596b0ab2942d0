#!/usr/bin/env bash
# Sixth session, after run 35: E1/E2 again (run 35 paid JIT compiles of the Gluon kernels in mixed
# steps: no do_not_specialize, no warm-up of the paged variant), C1 public vs direct, GPU tests.
# Usage (on the H200): bash benchmarks/gpu_session6_check.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 150 python3 -m tilellm.cli bench throughput --workloads E1,E2 --json "$OUT/engine.json" 2>&1 \
  | tr '\r' '\n' | grep -v "Processed prompts" | tail -12 | tee "$OUT/engine.log"
timeout 60 python3 benchmarks/c1_ab.py 2>&1 | tee "$OUT/c1_ab.log"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/engine tests/models \
  2>&1 | tail -15 | tee "$OUT/tests.log"
