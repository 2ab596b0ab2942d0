#!/usr/bin/env bash
# Sixth session, first device call: the Gluon Hopper prefill kernel (tilellm/kernels/prefill_hopper.py):
# correctness matrix, P1-P3 against the portable Triton kernel and cuDNN, then the prefill GPU tests
# through the public entry point (which now dispatches to it on Hopper).
# Usage (on the H200): bash benchmarks/gpu_session6a.sh   ($OUT receives logs and JSON)
set -uo pipefail
OUT=${OUT:-/tmp/tilellm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.log"
timeout 360 python3 benchmarks/prefill_hopper.py --json "$OUT/prefill_hopper.json" 2>&1 | tee "$OUT/prefill_hopper.log"
timeout 150 python3 -m pytest -q -x -m gpu tests/kernels/test_prefill.py 2>&1 | tail -6 | tee "$OUT/tests.log"
