#!/usr/bin/env bash
# Fifth session, second device call: C1 with key tiles copied page by page by TMA
# (TileConfig.page_tma) against the gather, and the paged kernel's GPU tests (the TMA path
# compiled for sm_90, bf16 included). Usage (on the H200): bash benchmarks/gpu_session5b.sh
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.log"
timeout 240 python3 benchmarks/chunk_variants.py --json "$OUT/chunk.json" 2>&1 | tee "$OUT/chunk.log"
timeout 240 python3 -m pytest -q -x tests/kernels/test_paged.py -k "tma or launch_orders or gpu" 2>&1 \
  | tail -8 | tee "$OUT/tests.log"
