#!/usr/bin/env bash
# Sixth session, final figures with the Gluon kernels as the package's kernels on sm_90: every SPEC
# workload with peers (graph timing for paged/decode), fp16 for the Gluon-served ones, E1/E2.
# The GPU tests run in a second call (TESTS_ONLY=1) to stay inside one call's 10 minutes.
# Usage (on the H200): bash benchmarks/gpu_session6_final.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ "${TESTS_ONLY:-0}" = 1 ]; then
  timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/engine tests/models 2>&1 \
    | tail -15 | tee "$OUT/tests.log"
  exit 0
fi
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  timeout 200 python3 -m tilellm.cli bench kernels --graph --json "$OUT/kernels.json"
  timeout 60 python3 -m tilellm.cli bench kernels --dtype float16 --no-peers --graph \
    --workloads P1,P2,C1,P1P --json "$OUT/kernels_fp16.json"
} 2>&1 | tee "$OUT/kernels.log"
timeout 200 python3 -m tilellm.cli bench throughput --workloads E1,E2 --json "$OUT/engine.json" 2>&1 \
  | tr '\r' '\n' | grep -v "Processed prompts" | tail -24 | tee "$OUT/engine.log"
