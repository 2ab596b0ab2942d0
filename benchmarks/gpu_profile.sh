#!/usr/bin/env bash
# One device call (session 2, 2026-11-29): where E1's time goes (torch.profiler over an E1
# slice), E1 + E2 with the per-kind device split and the cascade graph count, the cascade /
# verify / cached-prefill kernels (X1, V1, C1), and the cascade GPU tests. One archive in $OUT.
set -uo pipefail
REAL_OUT=${OUT:-/tmp/tilellm-out}
R=/tmp/run
mkdir -p "$R" "$REAL_OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$R/gpu.txt"
timeout ${PROFILE_TIMEOUT:-150} python3 benchmarks/profile_engine.py --out "$R" 2>&1 | grep -v Warning | tail -75 | tee "$R/profile.log"
OUT=$R WORKLOADS=${WORKLOADS:-E1,E2} ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-220} BENCH_ARGS="--workloads ${KWORK:-X1,C1,V1} --no-peers" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-90} \
  TESTS="${TESTS:-tests/engine/test_cascade.py tests/kernels/test_cascade.py}" \
  bash benchmarks/gpu_all.sh 2>&1 | grep -v "captured\|Warning" | tail -5
grep -h "captured\|cascade" "$R"/*.log | head -5
tar czf "$REAL_OUT/run.tgz" -C "$R" .
