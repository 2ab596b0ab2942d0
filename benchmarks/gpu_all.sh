#!/usr/bin/env bash
# One device call: engine throughput (E1-E3 + transformers baseline), the kernel benchmark with
# peers, then the kernel tests on the GPU (bf16 included). Logs and JSON land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_ENGINE:-0}" != 1 ]; then
  timeout ${ENGINE_TIMEOUT:-300} python3 -m tilellm.cli bench throughput --workloads ${WORKLOADS:-E1,E2,E3} \
    ${THROUGHPUT_ARGS:-} --json "$OUT/throughput.json" 2>&1 | tail -60 | tee "$OUT/throughput.log"
fi
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  timeout 200 python3 -m tilellm.cli bench kernels ${BENCH_ARGS:-} --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest ${TESTS:-tests/kernels} -q -x -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
fi
