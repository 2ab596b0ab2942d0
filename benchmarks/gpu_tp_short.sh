#!/usr/bin/env bash
# Issue 6 on the 2-GPU kind when little device time is left: E1 on the Qwen3-8B shape at tensor
# parallel 2 first, then the all-reduce cost (with run 24's single-GPU E1 as TP 1), then one NCCL
# correctness test with CUDA graphs. NVLink multicast stays off (KINDS.md).
# Usage (on the 2-GPU machine): bash benchmarks/gpu_tp_short.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/tp.log"
timeout 190 python3 -m tilellm.cli bench throughput --workloads E1 --model-shape qwen3-8b -tp 2 --dump-traceback-after 170 \
  --json "$OUT/e1_tp2.json" 2>&1 | tr '\r' '\n' | grep -v "Processed prompts" | tee -a "$OUT/tp.log" | tail -8
timeout 50 python3 benchmarks/tp_allreduce.py --world-size 2 --hidden 4096 --layers 36 --tokens 1,256,16384 \
  --e1 benchmarks/runs/2026-11-29_run24_qwen3_8b_tp1/e1_8b_tp1.json "$OUT/e1_tp2.json" \
  --json "$OUT/allreduce.json" 2>&1 | tee -a "$OUT/tp.log"
timeout 80 python3 -m pytest -q -x tests/distributed/test_tensor_parallel_gpu.py -k "tiny_qwen3_kv2 and False" \
  2>&1 | tail -4 | tee -a "$OUT/tp.log"
