#!/usr/bin/env bash
# Issue 6's two-GPU run (kind nvidia-h200-x2; NVLink multicast stays off as the machine sets it):
# the NCCL tests, E1 on a Qwen3-8B-shaped model (random weights) at tensor parallel 1 and 2, the
# all-reduce cost of a step, and the summary (tok/s, scaling efficiency, all-reduce share).
# Usage (on the 2-GPU machine): bash benchmarks/gpu_tp.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/tp.log"
timeout 300 python3 -m pytest -q tests/distributed/test_tensor_parallel_gpu.py 2>&1 | tail -5 | tee -a "$OUT/tp.log"
for tp in 1 2; do
  timeout 400 python3 -m tilellm.cli bench throughput --workloads E1 --model-shape qwen3-8b -tp $tp --dump-traceback-after 360 \
    --json "$OUT/e1_tp$tp.json" 2>&1 | tr '\r' '\n' | grep -v "Processed prompts" | tee -a "$OUT/tp.log" | tail -8
done
timeout 200 python3 benchmarks/tp_allreduce.py --world-size 2 --hidden 4096 --layers 36 \
  --tokens 1,64,256,16384 --e1 "$OUT/e1_tp1.json" "$OUT/e1_tp2.json" --json "$OUT/allreduce.json" \
  2>&1 | tee -a "$OUT/tp.log"
