#!/usr/bin/env bash
# One device call: where E1's engine time goes (torch.profiler: prefill phase, then decode steps
# at 256 running), the launches inside cascade decode, the decode kernels at E1's shapes (E1D,
# with tile/split sweeps), X1 and D1, and the GPU tests named in $TESTS. One archive in $OUT.
set -uo pipefail
REAL_OUT=${OUT:-/tmp/tilellm-out}
R=/tmp/run
mkdir -p "$R" "$REAL_OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$R/gpu.txt"
timeout ${PROFILE_TIMEOUT:-150} python3 benchmarks/profile_engine.py --out "$R" 2>&1 | grep -v Warning > "$R/profile.log"
grep -A12 "kernels by device" "$R/profile.log" | cut -c1-60,90-120
for hq in 32 16; do
  timeout 60 python3 benchmarks/profile_cascade.py --hq $hq --out "$R" 2>&1 | grep -v Warning | tee "$R/cascade_hq$hq.log" | head -12
done
timeout ${KERNEL_TIMEOUT:-150} python3 -m tilellm.cli bench kernels --workloads ${KWORK:-E1D,X1,D1} --no-peers \
  --json "$R/kernels.json" 2>&1 | grep -v Warning | tee "$R/kernels.log" | tail -25
timeout ${TEST_TIMEOUT:-120} python3 -m pytest ${TESTS:-tests/engine/test_cascade.py tests/models/test_attention_layer.py tests/engine/test_gpu.py} \
  -q -x -p no:cacheprovider 2>&1 | tail -6 | tee "$R/gpu_tests.log"
tar czf "$REAL_OUT/run.tgz" -C "$R" .
