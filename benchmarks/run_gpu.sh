#!/usr/bin/env bash
# The whole GPU benchmark in one call, on one CUDA GPU:
#   tests       python -m pytest -q -m gpu tests/kernels (in parallel), then tests/engine tests/models
#   kernels     tilellm bench kernels --graph (every kernel workload beside cuDNN / FlashAttention SDPA,
#               paged and decode workloads also replayed from CUDA graphs), then the host time of
#               eager kernel calls (benchmarks/kernel_host_time.py) and the linear layers at decode
#               sizes in graphs (benchmarks/linear_layers.py) and the element-wise kernels of a decode
#               layer in graphs (benchmarks/decode_layer_ops.py)
#   throughput  tilellm bench throughput --workloads E1,E2 (random Qwen3-0.6B weights, bf16)
#   pdl         programmatic dependent launch (TILELLM_PDL=1) against none: its GPU tests, then
#               benchmarks/small_batch_decode.py and E1 without and with it
#   merge       where split-KV calls merge their partials (TILELLM_SPLIT_MERGE): its tests, the decode,
#               graph-capture and engine GPU tests by default (auto: eager calls in the kernel,
#               captured ones in a second launch), then D1-D4 and V1 (eager and in graphs), the host
#               time of eager calls and small-batch decode under separate, auto and kernel
#   rope        rotary embedding and KV store in one launch (TILELLM_ROPE_STORE=fused, the default)
#               against two launches: its tests on the GPU, small-batch decode with two launches, one,
#               and one plus the in-kernel split-KV merge, then E1 with the defaults
#   hopper      the Gluon prefill kernel (hopper.py): its GPU tests, then `bench kernels` on P1, P2, C1,
#               P1P and P3 with the sweep's hopper.py row, then, when HOPPER_BASELINE names another
#               hopper.py (e.g. `git show REV:tilellm/kernels/hopper.py > .gl/hopper_base.py`),
#               benchmarks/hopper_ab.py against it
#   fp8         benchmarks/fp8_gemm.py --no-sweep (Qwen3's layers, then DeepSeek-V3's merged q_a / kv_a),
#               benchmarks/fused_quant.py (the activation quantization in RMSNorm's and SiLU-and-mul's
#               launches) and benchmarks/decode_fp8.py,
#               then the FP8 tests on the GPU (KV cache, decode, GEMM (Triton and Gluon), the cache
#               stores (FP8 and MLA rows), MoE, checkpoints, the engine against transformers, the fused ops)
#   verify      verification over an FP8 cache in decode_fp8.py (TILELLM_FP8_VERIFY=gluon, opt-in): its GPU
#               tests (and the decode ones, and the engine's over an FP8 cache), benchmarks/decode_fp8.py on
#               V1, V1-G2 and small batches over long contexts (paged.py's FP8 tiles, planned and at forced
#               segment counts, and the Gluon kernel with 8 and 16 columns a program), then E4 over an FP8
#               cache with paged.py and with the Gluon kernel (benchmarks/spec_decode.py --kv-cache-dtype fp8)
#   gemv        the one-row GEMVs (gemv.py, fp8_gemv.py; the default for one-row steps on a CUDA device): their
#               GPU tests and the engine's (greedy vs transformers, the GPU engine tests, FP8), then
#               benchmarks/small_batch_decode.py against TILELLM_GEMV=0 (bf16 and --quantization fp8)
#               and against TILELLM_PDL=1, and benchmarks/fp8_gemm.py's one-row and eight-row columns
#   pdlrows     PDL for the Triton kernels of steps of up to 256 rows, cuBLAS kept for the linear layers
#               (TILELLM_PDL_ROWS=256) against the default (one-row launches): its tests on the GPU,
#               benchmarks/small_batch_decode.py at batch 1, 8 and 32 and E1, three runs each way
#   smallbatch  what a small batch's decode step may still gain: benchmarks/small_batch_decode.py against
#               TILELLM_PDL=0 (the default launches one-row steps' kernels with PDL: what that gives),
#               twice, with the host's Python profile at batch 1; the PDL and merge tests,
#               benchmarks/decode_splits.py (split-KV segments over short contexts, batch 1-64) and
#               benchmarks/few_row_tiles.py (the linear layers at 8 rows by kernel and tile)
# Workloads, counting and targets: docs/workloads.md; the current figures: docs/benchmarks.md.
#
# Usage: bash benchmarks/run_gpu.sh [STEPS]
#   STEPS: comma-separated subset of tests,kernels,throughput,pdl,merge,rope,hopper,fp8,verify,gemv,pdlrows,smallbatch, run in that
#   order (default: the first three).
# Each step writes $OUT/<step>.log (and kernels.json / throughput.json); a step that fails or runs
# past its time limit is reported and the next step still runs. Exit status: 0 when every selected
# step passed, 1 otherwise, 2 for an unknown step.
# Environment: OUT (default ./artifacts), PYTHON (default python3), TESTS (the kernel test paths,
# default tests/kernels), TEST_WORKERS (4), TESTS_TIMEOUT (500 s),
# KERNELS_TIMEOUT (300 s), THROUGHPUT_TIMEOUT (300 s), FP8_TIMEOUT (400 s, the FP8 tests' share),
# BUDGET_S (seconds for the whole run, steps cut to fit; default none: BUDGET_S=570 in a 600 s call).
# Run serially, the GPU tests took about 13 minutes on an H200 (about 200 of their 323 in 480 s),
# before `-m gpu` also selected the tests on the `device` fixture (tests/conftest.py: on a GPU
# machine they run there too, so the selection grew by the twin comparisons of every kernel);
# `tests` runs the kernel tests in TEST_WORKERS processes (default 4, with pytest-xdist), then the
# engine's and models' (tests_engine). Where one call may run 10 minutes at most and that is still
# too long, split the kernel tests with TESTS (e.g. "$(echo tests/kernels/test_[a-m]*.py)"). Run
# `kernels,throughput`, `pdl`, `merge`, `rope`, `hopper`, `fp8`, `verify`, `gemv`, `pdlrows` and `smallbatch` as calls of their own, each with
# BUDGET_S=570.
set -uo pipefail

ALL_STEPS=(tests kernels throughput pdl merge rope hopper fp8 verify gemv pdlrows smallbatch)
STEPS=${1:-tests,kernels,throughput}
OUT=${OUT:-./artifacts}
PYTHON=${PYTHON:-python3}

selected() { [[ ",$STEPS," == *",$1,"* ]]; }

for step in ${STEPS//,/ }; do
  if [[ ! " ${ALL_STEPS[*]} " == *" $step "* ]]; then
    echo "run_gpu.sh: unknown step '$step'; choose from: ${ALL_STEPS[*]} (comma-separated)" >&2
    exit 2
  fi
done

mkdir -p "$OUT"
export OUT  # benchmarks/fp8_gemm.py writes $OUT/fp8_gemm.json
# The checkout's package, installed or not.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$OUT/gpu.txt"
fi
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)" \
  2>&1 | tee -a "$OUT/gpu.txt"

failed=()
# Every step ends by BUDGET_S seconds after the start (default: none), so that a call with a wall
# limit (a lent GPU's 600 s) still returns every log: a step's limit is cut to what is left.
BUDGET_S=${BUDGET_S:-0}
# run_step NAME LIMIT_S CMD...: CMD under `timeout`, stdout and stderr to $OUT/NAME.log and the terminal.
run_step() {
  local name=$1 limit=$2
  shift 2
  if [ "$BUDGET_S" -gt 0 ]; then
    local left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt 15 ]; then
      echo "=== $name: SKIPPED (${BUDGET_S} s budget spent)" | tee "$OUT/$name.log"
      failed+=("$name")
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    echo "=== $name: passed in $((SECONDS - start)) s"
  else
    [ "$rc" -eq 124 ] && echo "=== $name: stopped by its ${limit} s limit" | tee -a "$OUT/$name.log"
    echo "=== $name: FAILED (exit status $rc) after $((SECONDS - start)) s; the next step still runs"
    failed+=("$name")
  fi
}

if selected tests; then
  # The kernel tests in TEST_WORKERS processes sharing the GPU (they check values, not time or
  # memory); the engine's and models' serially (they size the KV pool from the free memory).
  parallel=()
  if [ "${TEST_WORKERS:-4}" -gt 1 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
    parallel=(-n "${TEST_WORKERS:-4}" --dist loadfile)
  fi
  # shellcheck disable=SC2086
  run_step tests "${TESTS_TIMEOUT:-500}" "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu \
    --continue-on-collection-errors ${parallel[@]+"${parallel[@]}"} ${TESTS:-tests/kernels}
  # (test_structured_outputs.py holds no GPU test and imports jsonschema, which GPU machines
  # without the test extras lack: it is left out there rather than failing the step)
  ignore=()
  if ! "$PYTHON" -c "import jsonschema" 2>/dev/null; then
    echo "jsonschema missing: tests/engine/test_structured_outputs.py (no GPU tests) left out"
    ignore=(--ignore=tests/engine/test_structured_outputs.py)
  fi
  run_step tests_engine 200 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu \
    --continue-on-collection-errors ${ignore[@]+"${ignore[@]}"} tests/engine tests/models
fi
if selected kernels; then
  run_step kernels "${KERNELS_TIMEOUT:-300}" "$PYTHON" -m tilellm.cli bench kernels --graph \
    --json "$OUT/kernels.json"
  run_step kernel_host_time 120 "$PYTHON" benchmarks/kernel_host_time.py --json "$OUT/kernel_host_time.json"
  run_step linear_layers 100 "$PYTHON" benchmarks/linear_layers.py --json "$OUT/linear_layers.json"
  run_step decode_layer_ops 100 "$PYTHON" benchmarks/decode_layer_ops.py --json "$OUT/decode_layer_ops.json"
fi
if selected throughput; then
  run_step throughput "${THROUGHPUT_TIMEOUT:-300}" "$PYTHON" -m tilellm.cli bench throughput \
    --workloads E1,E2 --json "$OUT/throughput.json"
fi

if selected pdl; then
  # (the tests set TILELLM_PDL themselves: their baselines run without it)
  run_step pdl_tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra \
    tests/kernels/test_skinny.py tests/engine/test_pdl.py
  run_step small_batch 200 "$PYTHON" benchmarks/small_batch_decode.py --batches 1,8,32 --kernels 12 \
    --json "$OUT/small_batch.json"
  run_step small_batch_pdl 200 env TILELLM_PDL=1 "$PYTHON" benchmarks/small_batch_decode.py \
    --batches 1,8,32 --kernels 12 --json "$OUT/small_batch_pdl.json"
  run_step e1 200 "$PYTHON" -m tilellm.cli bench throughput --workloads E1 --json "$OUT/e1.json"
  run_step e1_pdl 200 env TILELLM_PDL=1 "$PYTHON" -m tilellm.cli bench throughput --workloads E1 \
    --json "$OUT/e1_pdl.json"
fi
if selected merge; then
  # (limits sum to under 10 minutes: one device call)
  run_step merge_tests 140 "$PYTHON" -m pytest -q -p no:cacheprovider \
    -o addopts=-ra tests/kernels/test_merge_in_kernel.py tests/kernels/test_decode.py \
    tests/kernels/test_graph_capture.py tests/engine/test_gpu.py
  for mode in separate auto kernel; do
    run_step "merge_kernels_$mode" 100 env TILELLM_SPLIT_MERGE=$mode "$PYTHON" -m tilellm.cli bench kernels \
      --workloads D1,D2,D3,D4,V1 --graph --no-peers --json "$OUT/merge_kernels_$mode.json"
    run_step "merge_host_time_$mode" 40 env TILELLM_SPLIT_MERGE=$mode "$PYTHON" benchmarks/kernel_host_time.py \
      --json "$OUT/merge_host_time_$mode.json"
    run_step "merge_small_batch_$mode" 80 env TILELLM_SPLIT_MERGE=$mode "$PYTHON" \
      benchmarks/small_batch_decode.py --batches 1,8 --steps 128 --kernels 8 \
      --json "$OUT/merge_small_batch_$mode.json"
  done
fi
if selected rope; then
  run_step rope_tests 100 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra tests/models/test_fused_ops.py
  # two launches, one, and one with the split-KV merge in the paged kernel too
  for mode in separate,separate fused,separate fused,kernel; do
    name=rope_${mode%,*}_merge_${mode#*,}
    run_step "$name" 80 env TILELLM_ROPE_STORE=${mode%,*} TILELLM_SPLIT_MERGE=${mode#*,} "$PYTHON" \
      benchmarks/small_batch_decode.py --batches 1,8,32 --steps 128 --kernels 8 --json "$OUT/$name.json"
  done
  run_step rope_e1 150 "$PYTHON" -m tilellm.cli bench throughput --workloads E1 --json "$OUT/rope_e1.json"
fi
if selected hopper; then
  run_step hopper_tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu \
    tests/kernels/test_hopper.py
  run_step hopper_kernels 150 "$PYTHON" -m tilellm.cli bench kernels --workloads P1,P2,C1,P1P --no-peers \
    --json "$OUT/hopper_kernels.json"
  run_step hopper_p3 100 "$PYTHON" -m tilellm.cli bench kernels --workloads P3 --sweep --no-peers \
    --json "$OUT/hopper_p3.json"
  if [ -n "${HOPPER_BASELINE:-}" ]; then
    run_step hopper_ab 150 "$PYTHON" benchmarks/hopper_ab.py --baseline "$HOPPER_BASELINE" \
      --json "$OUT/hopper_ab.json"
  fi
fi
if selected fp8; then
  # (the measurements first: the tests take what is left of a call's budget)
  run_step fp8_gemm 200 "$PYTHON" benchmarks/fp8_gemm.py --no-sweep
  run_step fused_quant 90 "$PYTHON" benchmarks/fused_quant.py --json "$OUT/fused_quant.json"
  run_step fp8_gemm_deepseek 90 "$PYTHON" benchmarks/fp8_gemm.py --no-sweep --models deepseek-v3 \
    --ms 16,256,4096 --json "$OUT/fp8_gemm_deepseek.json"
  run_step decode_fp8 120 "$PYTHON" benchmarks/decode_fp8.py --json "$OUT/decode_fp8.json"
  run_step fp8_tests "${FP8_TIMEOUT:-400}" "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra \
    tests/kernels/test_decode_fp8.py tests/kernels/test_kv_fp8.py tests/kernels/test_fp8_gemm.py \
    tests/kernels/test_fp8_gemm_hopper.py \
    tests/kernels/test_store_kvcache.py \
    tests/kernels/test_moe_fp8.py tests/engine/test_kv_cache_fp8.py tests/models/test_fp8_checkpoint.py \
    tests/engine/test_fp8_greedy_vs_hf.py tests/models/test_fused_ops.py tests/models/test_layernorm.py
fi

if selected verify; then
  run_step verify_tests 240 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra \
    tests/kernels/test_decode_fp8.py tests/inspect/test_tiles.py tests/engine/test_kv_cache_fp8.py
  # V1 and V1-G2, then small batches over long contexts (one and eight requests of 8192 / 4096
  # keys, 4 and 5 new tokens at Qwen3-0.6B's heads), paged.py's tiles at forced segment counts too
  run_step verify_fp8 150 "$PYTHON" benchmarks/decode_fp8.py --workloads V1,V1-G2 --variants 32:3 --no-check \
    --paged-splits 4,8,16,32 --verify-shape R8-S1x8k=16:4:1:8192 --verify-shape S1x8k=16:5:1:8192 \
    --verify-shape R8-S8x4k=16:4:8:4096 --json "$OUT/verify_fp8.json"
  run_step e4_fp8_paged 100 "$PYTHON" benchmarks/spec_decode.py --kv-cache-dtype fp8 --json "$OUT/e4_fp8_paged.json"
  run_step e4_fp8_gluon 100 env TILELLM_FP8_VERIFY=gluon "$PYTHON" benchmarks/spec_decode.py --kv-cache-dtype fp8 \
    --json "$OUT/e4_fp8_gluon.json"
fi

if selected gemv; then
  run_step gemv_tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -n 8 -m gpu \
    tests/kernels/test_gemv.py tests/kernels/test_skinny.py tests/kernels/test_fp8_gemv.py tests/kernels/test_fp8_gemm.py
  run_step gemv_engine_tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -n 8 \
    tests/engine/test_greedy_vs_hf.py tests/engine/test_gpu.py tests/engine/test_fp8_greedy_vs_hf.py
  run_step gemv_small_batch 200 "$PYTHON" benchmarks/small_batch_decode.py --batches 1,8 --steps 64 --kernels 8 \
    --ab TILELLM_GEMV=0 --repeat 2 --json "$OUT/gemv_small_batch.json"
  # programmatic dependent launch with them (one-row launches, the default) against none
  run_step gemv_small_batch_pdl 150 "$PYTHON" benchmarks/small_batch_decode.py --batches 1,8 --steps 64 --kernels 8 \
    --ab TILELLM_PDL=0 --json "$OUT/gemv_small_batch_pdl.json"
  run_step gemv_small_batch_fp8 120 "$PYTHON" benchmarks/small_batch_decode.py --batches 1,8 --steps 64 \
    --quantization fp8 --ab TILELLM_GEMV=0 --json "$OUT/gemv_small_batch_fp8.json"
  run_step gemv_fp8_gemm 100 "$PYTHON" benchmarks/fp8_gemm.py --no-sweep --ms 1,8 --models qwen3-0.6b,qwen3-8b \
    --json "$OUT/gemv_fp8_gemm.json"
fi

if selected pdlrows; then
  run_step pdlrows_tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -n 4 \
    tests/kernels/test_pdl.py tests/engine/test_pdl.py
  run_step pdlrows_small_batch 150 "$PYTHON" benchmarks/small_batch_decode.py --batches 1,8,32 --steps 64 \
    --kernels 8 --ab TILELLM_PDL_ROWS=256 --json "$OUT/pdlrows_small_batch.json"
  run_step pdlrows_e1 120 "$PYTHON" -m tilellm.cli bench throughput --workloads E1 --repeat 3 \
    --json "$OUT/pdlrows_e1_default.json"
  run_step pdlrows_e1_256 120 env TILELLM_PDL_ROWS=256 "$PYTHON" -m tilellm.cli bench throughput --workloads E1 \
    --repeat 3 --json "$OUT/pdlrows_e1_256.json"
fi
if selected smallbatch; then
  # the default (PDL for one-row launches) against none, twice, with the host's Python profile
  run_step smallbatch_pdl 300 "$PYTHON" benchmarks/small_batch_decode.py --batches 1,8 --steps 64 --kernels 8 \
    --ab TILELLM_PDL=0 --repeat 2 --cprofile 40 --json "$OUT/smallbatch_pdl.json"
  run_step smallbatch_pdl_engine_tests 100 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts=-ra -n 8 \
    tests/engine/test_pdl.py tests/kernels/test_pdl.py tests/kernels/test_pdl_order.py tests/kernels/test_merge.py \
    tests/kernels/test_merge_in_kernel.py
  # (batches 16-64: the small-batch split rule's bound, schedule.SMALL_BATCH_SPLIT_BELOW; docs/benchmarks.md,
  # "Split-KV segments at batch 16-64")
  run_step smallbatch_splits 90 "$PYTHON" benchmarks/decode_splits.py --batches 1,8,16,32,64 \
    --contexts 192,512,1024 --json "$OUT/decode_splits.json"
  run_step smallbatch_tiles 150 "$PYTHON" benchmarks/few_row_tiles.py --rows 8 --json "$OUT/few_row_tiles.json"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}; logs in $OUT" >&2
  exit 1
fi
echo "all steps passed; logs and JSON in $OUT"
