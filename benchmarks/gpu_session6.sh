#!/usr/bin/env bash
# Sixth session: the Gluon Hopper kernels (tilellm/kernels/hopper.py). Correctness matrix and timings
# (benchmarks/hopper_kernels.py: P1-P3 vs the Triton kernel and cuDNN, C1 and a 128-token chunk batch
# vs the Triton paged kernel), then the kernel GPU tests.
# Usage (on the H200): bash benchmarks/gpu_session6.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/hopper_kernels.py --variants "${VARIANTS:-pp128x3,ws128x3,pp128x2}" \
  --json "$OUT/hopper_kernels.json" 2>&1 | tee "$OUT/hopper_kernels.log"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/kernels/test_hopper.py tests/kernels/test_paged.py tests/kernels/test_prefill.py} \
  2>&1 | tail -15 | tee "$OUT/tests.log"
