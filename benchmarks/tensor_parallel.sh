#!/usr/bin/env bash
# Tensor parallelism on two GPUs of one host: does E1 on a Qwen3-8B shape (random bf16 weights)
# scale from one GPU to two, and what share of a decode step do the all-reduces take?
#   1. the NCCL tests (tests/distributed/test_tensor_parallel_gpu.py: TP 2 against TP 1, CUDA graphs);
#   2. `tilellm bench throughput --workloads E1 --model-shape qwen3-8b -tp N` for N = 1 and 2;
#   3. `python benchmarks/tp_allreduce.py`: one all-reduce and a whole step's 2 x 36 all-reduces
#      (eager and replayed from a CUDA graph) at 1-16384 tokens, and the summary from step 2's JSON
#      (output tok/s at TP 1 and 2, scaling efficiency, the all-reduce share of a step at 256 running).
# NVLink multicast (NVLS) stays off: NCCL and torch's symmetric memory are told not to use it.
# Usage: bash benchmarks/tensor_parallel.sh   (about 10 minutes; OUT, default ./artifacts/tp, receives
# tp.log, e1_tp1.json, e1_tp2.json and allreduce.json). TP_SIZES="2" skips the single-GPU run.
set -uo pipefail
OUT=${OUT:-./artifacts/tp}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/tp.log"
timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra tests/distributed/test_tensor_parallel_gpu.py 2>&1 \
  | tail -5 | tee -a "$OUT/tp.log"
for tp in ${TP_SIZES:-1 2}; do
  # --dump-traceback-after prints every rank's stacks before the limit: a slow build tells from a hang.
  timeout 400 "$PYTHON" -m tilellm.cli bench throughput --workloads E1 --model-shape qwen3-8b -tp "$tp" \
    --dump-traceback-after 360 --json "$OUT/e1_tp$tp.json" 2>&1 | tr '\r' '\n' | grep -v "Processed prompts" \
    | tee -a "$OUT/tp.log" | tail -8
done
SUMMARY=()
if [ -f "$OUT/e1_tp1.json" ] && [ -f "$OUT/e1_tp2.json" ]; then
  SUMMARY=(--e1 "$OUT/e1_tp1.json" "$OUT/e1_tp2.json")
else
  echo "no E1 summary: e1_tp1.json or e1_tp2.json is missing in $OUT" | tee -a "$OUT/tp.log"
fi
timeout 200 "$PYTHON" benchmarks/tp_allreduce.py --world-size 2 --hidden 4096 --layers 36 \
  --tokens 1,64,256,16384 "${SUMMARY[@]}" --json "$OUT/allreduce.json" 2>&1 | tee -a "$OUT/tp.log"
