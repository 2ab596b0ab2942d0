#!/usr/bin/env bash
# One device call (2026-11-29, second session): the serving benchmark on the CUDA-graph engine at
# three rates (with offline E1 in the same call), the decode kernels after the split-plan change,
# then the GPU-only kernel tests (bf16, large shapes) and the engine GPU tests. Run with carry
# [".whl"]. One archive in $OUT.
set -uo pipefail
REAL_OUT=${OUT:-/tmp/tilellm-out}
R=/tmp/r4
mkdir -p "$R" "$REAL_OUT"
OUT=$R/serve RATES="${RATES:-inf 64 16}" BUDGET_S=${SERVE_BUDGET:-300} bash benchmarks/gpu_serve.sh > "$R/serve.log" 2>&1
grep -A12 "summary\|overhead" "$R/serve.log" | tail -16
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 90 python3 -m tilellm.cli bench kernels --workloads ${KWORK:-D1,D2,D3,D4,E1D} --no-peers --json "$R/kernels.json" \
  2>&1 | grep -v -i warn | tee "$R/kernels.log" | tail -22
timeout ${TEST_TIMEOUT:-170} python3 -m pytest tests/kernels -m gpu tests/engine/test_gpu.py tests/models/test_attention_layer.py \
  -q -p no:cacheprovider 2>&1 | tail -6 | tee "$R/gpu_tests.log"
tar czf "$REAL_OUT/r4.tgz" -C "$R" .
