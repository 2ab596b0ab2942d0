#!/usr/bin/env bash
# The session's last device call (2026-11-29): E2 with cascade decode, the cascade kernel (X1),
# GPU tests of cascade, then the E1 serving benchmark. Everything lands in one archive in $OUT
# (the device tool returns at most 8 files). Run with carry [".whl"] (see gpu_serve.sh).
set -uo pipefail
REAL_OUT=${OUT:-/tmp/tilellm-out}
FINAL=/tmp/final
mkdir -p "$FINAL" "$REAL_OUT"
OUT=$FINAL/all WORKLOADS=E2 ENGINE_TIMEOUT=170 BENCH_ARGS="--workloads X1 --no-peers" TEST_TIMEOUT=80 \
  TESTS="tests/engine/test_cascade.py::test_cascade_graphs_match_eager_and_transformers tests/kernels/test_cascade.py::test_cascade_large" \
  bash benchmarks/gpu_all.sh
OUT=$FINAL/serve RATES="inf 16" BUDGET_S=230 bash benchmarks/gpu_serve.sh 2>&1 | tail -40
tar czf "$REAL_OUT/final.tgz" -C "$FINAL" .
