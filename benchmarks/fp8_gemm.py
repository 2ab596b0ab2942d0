"""Block-scaled FP8 W8A8 GEMM on one GPU: the Triton kernel and torch's block-wise scaled_mm
against the bf16 matmul, on Qwen3-0.6B's and Qwen3-8B's linear layers (and, with `--models
deepseek-v3`, DeepSeek-V3's q_a and kv_a projections apart and merged as the engine runs them).

    python benchmarks/fp8_gemm.py [--models qwen3-0.6b,qwen3-8b,deepseek-v3] [--ms 1,16,64,256,1024,4096]
        [--no-sweep] [--json FILE]

For every layer (qkv, o, gate_up, down: y = x @ W^T, W [N, K]) and token count M it times calls
as a model's decode step runs them: captured in one CUDA graph, each call on its own copy of the
weight, with enough copies (256 MB of weights or more) that no call finds its weight in the 50 MB
L2; the graph's replay is timed with `triton.testing.do_bench` (median) and divided by the calls.
Timed eagerly, a call of a few microseconds measures the host's launch time instead. On random
non-zero inputs:

- `bf16`: torch.matmul(x, W^T) with x, W in bf16;
- `fp8`: `w8a8_block_fp8_matmul(x_q, W_q, x_s, W_s, [128, 128])` with x already quantized (on
  Hopper from 1024 tokens the Gluon kernel of `fp8_gemm_hopper.py`; `fp8_triton_us` in the JSON:
  the Triton kernel at the same size);
- `fp8+q`: the same with the activation quantization (`per_token_group_quant_fp8`) included;
- `linear`: `w8a8_block_fp8_linear(x, W_q, W_s, [128, 128])`, the quantization inside the GEMM
  (what a layer runs for steps of up to 16 tokens);
- `gemv`: the same through `fp8_gemv.py`'s kernel (`TILELLM_GEMV=1` for it, up to 8 tokens; the
  engine runs it for one-row steps by default), with dynamic and static activation scales; every
  other column runs with `TILELLM_GEMV=0`, so at one row it times `fp8_gemm.py`'s own kernels;
- `scaled_mm`: `scaled_mm_block_fp8` (cuBLASLt's block-scaled GEMM), where torch supports it;
- `static+q`, `static linear`: static activations (a checkpoint's calibrated `input_scale`, here
  the tensor's amax / 448): `scaled_fp8_quant(x, s)` then the GEMM with s broadcast, and
  `w8a8_block_fp8_linear(..., input_scale=s)` (what static layers run above / up to 16 tokens);
- `static mm`: `scaled_fp8_quant(x, s)` then `scaled_mm_fp8` (torch._scaled_mm) on s folded into
  the weight's scales, as a per-tensor checkpoint's static layer runs it from 256 tokens:
  row-wise (one scale per output row) for the merged layers (qkv, gate_up), whose shards have
  scales of their own, tensor-wise for the others; `static mm gemm` without the quantization;
- `fast`: `scaled_mm` and `static mm gemm` again with `use_fast_accum=True` (the FP8 tensor
  cores' own accumulator over all of K), their errors against the twin reported beside;
- without --no-sweep, two alternative tile configs of the Triton kernel (the best is reported).

Each result is first checked against the PyTorch twin (`tilellm.kernels.reference.fp8_gemm`):
quantization bit for bit, GEMM outputs within 1% of the output scale. The table gives
microseconds, TFLOP/s (2MNK / t), GB/s of weight bytes (2NK for bf16, NK for fp8: the figure
that bounds decode) and the speedup over bf16; `$OUT/fp8_gemm.json` (OUT defaults to ./out)
holds every number, the configs and the checks. About 1-2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
from collections.abc import Callable
from dataclasses import asdict
from unittest import mock

import torch
import triton

from tilellm.bench.timing import graph_replay_us
from tilellm.kernels import fp8_gemm as tk
from tilellm.kernels.gemv import GEMV_MAX_ROWS
from tilellm.kernels.reference import fp8_gemm as ref

BLOCK = [128, 128]
# (N, K) of each linear layer, q/k/v and gate/up merged as the engine loads them
LAYERS = {
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    # DeepSeek-V3's down-projections of the attention input, apart and as the engine merges them
    # (`fused_qkv_a_proj`: 1536 + 576 rows, held zero-padded to 2176 = 17 whole blocks for cuBLAS)
    "deepseek-v3": {"q_a": (1536, 7168), "kv_a": (576, 7168), "qkv_a_padded": (2176, 7168)},
}
DEFAULT_MODELS = "qwen3-0.6b,qwen3-8b"
# several checkpoint matrices, each with a per-tensor scale of its own
MERGED = ("qkv", "gate_up", "qkv_a_padded")
MS = (1, 16, 64, 256, 1024, 4096)
CHECK_TOL = 1e-2  # of the output scale: bf16 rounding (2^-8) plus fp8 MMA accumulation


WEIGHT_BYTES_PER_GRAPH = 256 * 2**20  # at least 5x the H200's L2


def copies_for(weight_bytes: int) -> int:
    """How many copies of a weight one timed graph walks through."""
    return max(2, math.ceil(WEIGHT_BYTES_PER_GRAPH / weight_bytes))


def time_us(call: Callable[[int], object], num_calls: int) -> float:
    """Microseconds per call of call(0), ..., call(num_calls - 1), replayed from one CUDA graph."""
    return graph_replay_us([functools.partial(call, i) for i in range(num_calls)], warmup=5, rep=40)


def max_rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| over max(max |expected|, 1); inf where got has a non-finite value."""
    g, e = got.float(), expected.float()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - e).abs().max()) / max(float(e.abs().max()), 1.0)


def alternatives(M: int, default: tk.Fp8GemmConfig) -> list[tk.Fp8GemmConfig]:
    """Two other tile configs for M rows: vLLM's H200 tables' shapes and a narrower/wider tile."""
    if M <= 64:
        options = [tk.Fp8GemmConfig(64, 64, 8, 4, 4), tk.Fp8GemmConfig(16, 128, 8, 4, 4)]
    else:
        options = [tk.Fp8GemmConfig(64, 128, 8, 4, 3), tk.Fp8GemmConfig(128, 64, 8, 8, 4)]
    return [c for c in options if c != default][:2]


def bench_case(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, sweep: bool, merged: bool
) -> dict:
    """Every variant for one [M, K] x [N, K]^T product; x, w bf16 on the GPU, (b, b_s) = w quantized;
    `merged`: a merged layer (per-tensor checkpoints give it one scale per shard)."""
    (M, K), N = x.shape, w.shape[0]
    a, a_s = tk.per_token_group_quant_fp8(x, BLOCK[1])
    a_ref, a_s_ref = ref.per_token_group_quant_fp8(x, BLOCK[1])
    quant_exact = torch.equal(a.view(torch.uint8), a_ref.view(torch.uint8)) and torch.equal(a_s, a_s_ref)
    expected = ref.w8a8_block_fp8_matmul(a_ref, b, a_s_ref, b_s, BLOCK, torch.bfloat16)
    cfg = tk.block_fp8_config(M, N, BLOCK, K)
    row: dict = {"M": M, "N": N, "K": K, "config": asdict(cfg), "quant_bit_exact": quant_exact}
    n_bf16, n_fp8 = copies_for(2 * N * K), copies_for(N * K)
    w_copies = [w.clone() for _ in range(n_bf16)]
    b_copies = [(b.clone(), b_s.clone()) for _ in range(n_fp8)]
    row["calls_per_graph"] = {"bf16": n_bf16, "fp8": n_fp8}

    def fp8(i: int, config: tk.Fp8GemmConfig | None = None) -> torch.Tensor:
        return tk.w8a8_block_fp8_matmul(a, b_copies[i][0], a_s, b_copies[i][1], BLOCK, config=config)

    def fp8_with_quant(i: int) -> torch.Tensor:
        x_q, x_s = tk.per_token_group_quant_fp8(x, BLOCK[1])
        return tk.w8a8_block_fp8_matmul(x_q, b_copies[i][0], x_s, b_copies[i][1], BLOCK)

    row["fp8_error"] = max_rel_error(fp8(0), expected)
    row["bf16_us"] = time_us(lambda i: torch.matmul(x, w_copies[i].T), n_bf16)
    row["fp8_us"] = time_us(fp8, n_fp8)
    # from GLUON_MIN_TOKENS on Hopper `fp8` runs the Gluon kernel; a config forces the Triton one
    row["fp8_triton_error"] = max_rel_error(fp8(0, cfg), expected)
    row["fp8_triton_us"] = time_us(lambda i: fp8(i, cfg), n_fp8)
    row["fp8_quant_us"] = time_us(fp8_with_quant, n_fp8)
    row["quant_us"] = time_us(lambda i: tk.per_token_group_quant_fp8(x, BLOCK[1]), n_fp8)
    row["linear_error"] = max_rel_error(tk.w8a8_block_fp8_linear(x, b, b_s, BLOCK), expected)
    row["linear_us"] = time_us(lambda i: tk.w8a8_block_fp8_linear(x, *b_copies[i], BLOCK), n_fp8)

    # static activations: one calibrated scale (this x's amax / 448, so nothing saturates)
    s_in = ref.dynamic_per_tensor_scale(x)
    static_expected = ref.w8a8_block_fp8_linear(x, b, b_s, BLOCK, torch.bfloat16, input_scale=s_in)
    if M <= GEMV_MAX_ROWS:  # `linear` through fp8_gemv.py's kernel (TILELLM_GEMV=1)
        with mock.patch.dict(os.environ, {"TILELLM_GEMV": "1"}):
            row["gemv_error"] = max_rel_error(tk.w8a8_block_fp8_linear(x, b, b_s, BLOCK), expected)
            row["gemv_us"] = time_us(lambda i: tk.w8a8_block_fp8_linear(x, *b_copies[i], BLOCK), n_fp8)
            static_gemv = tk.w8a8_block_fp8_linear(x, b, b_s, BLOCK, input_scale=s_in)
            row["static_gemv_error"] = max_rel_error(static_gemv, static_expected)
            row["static_gemv_us"] = time_us(
                lambda i: tk.w8a8_block_fp8_linear(x, *b_copies[i], BLOCK, input_scale=s_in), n_fp8
            )

    def static_with_quant(i: int) -> torch.Tensor:
        x_q, scale = tk.scaled_fp8_quant(x, s_in)
        x_s = tk.broadcast_input_scale(scale, M, K // BLOCK[1])
        return tk.w8a8_block_fp8_matmul(x_q, b_copies[i][0], x_s, b_copies[i][1], BLOCK)

    row["static_quant_error"] = max_rel_error(static_with_quant(0), static_expected)
    row["static_quant_us"] = time_us(static_with_quant, n_fp8)
    static_linear = tk.w8a8_block_fp8_linear(x, b, b_s, BLOCK, input_scale=s_in)
    row["static_linear_error"] = max_rel_error(static_linear, static_expected)
    row["static_linear_us"] = time_us(
        lambda i: tk.w8a8_block_fp8_linear(x, *b_copies[i], BLOCK, input_scale=s_in), n_fp8
    )
    # a per-tensor checkpoint's static layer: one scale per output row (merged) or one in all
    row.update(static_mm_bench(x, b, b_s, b_copies, s_in, n_fp8, per_row=merged))
    if sweep:
        row["alternatives"] = []
        for alt in alternatives(M, cfg):
            us = time_us(lambda i, alt=alt: fp8(i, alt), n_fp8)
            err = max_rel_error(fp8(0, alt), expected)
            row["alternatives"].append({"config": asdict(alt), "us": us, "error": err})
    reason = tk.scaled_mm_block_unavailable(x.device, BLOCK, N)
    if reason is None:
        a_cm, a_s_cm = tk.per_token_group_quant_fp8(x, BLOCK[1], column_major_scales=True)
        try:
            row["scaled_mm_error"] = max_rel_error(
                tk.scaled_mm_block_fp8(a_cm, b, a_s_cm, b_s, BLOCK), expected
            )
            row["scaled_mm_us"] = time_us(
                lambda i: tk.scaled_mm_block_fp8(a_cm, b_copies[i][0], a_s_cm, b_copies[i][1], BLOCK), n_fp8
            )
        except RuntimeError as e:  # a cuBLASLt without block-wise scaling, or a shape it refuses
            row["scaled_mm_unavailable"] = str(e).splitlines()[0]
        try:  # cuBLAS's fast FP8 accumulation flag (block scales promote every 128 k anyway?)
            fast = tk.scaled_mm_block_fp8(a_cm, b, a_s_cm, b_s, BLOCK, use_fast_accum=True)
            row["scaled_mm_fast_error"] = max_rel_error(fast, expected)
            row["scaled_mm_fast_us"] = time_us(
                lambda i: tk.scaled_mm_block_fp8(
                    a_cm, b_copies[i][0], a_s_cm, b_copies[i][1], BLOCK, use_fast_accum=True
                ),
                n_fp8,
            )
        except RuntimeError as e:
            row["scaled_mm_fast_unavailable"] = str(e).splitlines()[0]
    else:
        row["scaled_mm_unavailable"] = reason
    return row


def static_mm_bench(
    x: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    b_copies: list[tuple[torch.Tensor, torch.Tensor]],
    s_in: torch.Tensor,
    n_fp8: int,
    *,
    per_row: bool,
) -> dict:
    """`static_mm` (quantization + scaled_mm_fp8) and `static_mm_gemm` (scaled_mm_fp8 alone), on
    the block-quantized weight read as a per-row (each row's first block scale) or per-tensor
    (the first scale) one, checked against the twin on the same operands."""
    N, K = b.shape
    rows = b_s[:, 0].repeat_interleave(BLOCK[0])[:N]
    scale_b = (s_in * rows if per_row else s_in * rows[:1]).contiguous()
    out = {"static_mm_kind": "row-wise" if per_row else "tensor-wise"}
    reason = tk.scaled_mm_fp8_unavailable(x.device, torch.bfloat16, N, K, per_row=per_row)
    if reason is not None:
        out["static_mm_unavailable"] = reason
        return out
    x_q, _ = tk.scaled_fp8_quant(x, s_in)
    expected = ref.scaled_mm_fp8(x_q, b, None, scale_b, torch.bfloat16)
    out["static_mm_error"] = max_rel_error(tk.scaled_mm_fp8(x_q, b, None, scale_b, torch.bfloat16), expected)

    def with_quant(i: int) -> torch.Tensor:
        a, _ = tk.scaled_fp8_quant(x, s_in)
        return tk.scaled_mm_fp8(a, b_copies[i][0], None, scale_b, torch.bfloat16)

    out["static_mm_us"] = time_us(with_quant, n_fp8)
    out["static_mm_gemm_us"] = time_us(
        lambda i: tk.scaled_mm_fp8(x_q, b_copies[i][0], None, scale_b, torch.bfloat16), n_fp8
    )
    fast = tk.scaled_mm_fp8(x_q, b, None, scale_b, torch.bfloat16, use_fast_accum=True)
    out["static_mm_fast_error"] = max_rel_error(fast, expected)
    out["static_mm_fast_us"] = time_us(
        lambda i: tk.scaled_mm_fp8(x_q, b_copies[i][0], None, scale_b, torch.bfloat16, use_fast_accum=True),
        n_fp8,
    )
    return out


def derived(row: dict) -> None:
    """TFLOP/s, weight GB/s and speedup over bf16 of each timed variant, in place."""
    flops = 2 * row["M"] * row["N"] * row["K"]
    weight_bytes = {"bf16_us": 2 * row["N"] * row["K"]}
    for key in (
        "bf16_us",
        "fp8_us",
        "fp8_quant_us",
        "linear_us",
        "gemv_us",
        "static_gemv_us",
        "scaled_mm_us",
        "static_quant_us",
        "static_linear_us",
        "static_mm_us",
        "static_mm_gemm_us",
        "static_mm_fast_us",
        "scaled_mm_fast_us",
    ):
        if key in row:
            us = row[key]
            name = key[: -len("_us")]
            row[f"{name}_tflops"] = flops / us * 1e-6
            row[f"{name}_weight_gbps"] = weight_bytes.get(key, row["N"] * row["K"]) / us * 1e-3
            row[f"{name}_speedup"] = row["bf16_us"] / us


def print_header() -> None:
    cols = f"{'us':>8} {'TF/s':>6} {'GB/s':>6}"  # each variant: time, TFLOP/s, weight GB/s
    groups = f"{'bf16':<22} | {'fp8':<28} | {'fp8+quant':<28} | {'scaled_mm':<22}"
    tail = "| best    | static us                       | fast us         |               |"
    print(f"{'':<38} | {groups} {tail}")
    print(
        f"{'model':<11}{'layer':<8}{'M':>5} {'N':>6} {'K':>6} | {cols} | {cols} {'xbf16':>5} | {cols} "
        f"{'xbf16':>5} | {cols} | alt us  | +q / linear / mm+q / mm    | static / block  | gemv us xbf16 "
        "| check"
    )


def print_row(model: str, layer: str, row: dict) -> None:
    def cell(name: str) -> str:
        us = row.get(f"{name}_us")
        if us is None:
            return f"{'-':>22}"
        return f"{us:8.1f} {row[f'{name}_tflops']:6.1f} {row[f'{name}_weight_gbps']:6.0f}"

    best = min(row.get("alternatives", []), key=lambda alt: alt["us"], default=None)
    alt = f"{best['us']:7.1f}" if best else f"{'-':>7}"
    errors = ("fp8_error", "linear_error", "static_quant_error", "static_linear_error")
    errors += ("gemv_error", "static_gemv_error") if "gemv_us" in row else ()
    exact = row["quant_bit_exact"] and max(row[e] for e in errors) <= CHECK_TOL
    exact = exact and row.get("static_mm_error", 0.0) <= CHECK_TOL
    mm = [row.get(k) for k in ("static_mm_us", "static_mm_gemm_us", "static_mm_fast_us", "scaled_mm_fast_us")]
    static = f"{row['static_quant_us']:7.1f} {row['static_linear_us']:7.1f} " + " ".join(
        f"{us:7.1f}" if us is not None else f"{'-':>7}" for us in mm
    )
    gemv = "   -    -   " if "gemv_us" not in row else f"{row['gemv_us']:5.1f} x{row['gemv_speedup']:4.2f}"
    checks = "ok" if exact else "FAIL"
    if row.get("scaled_mm_error", 0.0) > CHECK_TOL:
        checks += " scaled_mm FAIL"
    fast_errors = [row.get(k) for k in ("static_mm_fast_error", "scaled_mm_fast_error")]
    checks += " fast err " + "/".join("-" if e is None else f"{e:.1e}" for e in fast_errors)
    print(
        f"{model:<11}{layer:<8}{row['M']:>5} {row['N']:>6} {row['K']:>6} | {cell('bf16')} | {cell('fp8')} "
        f"x{row['fp8_speedup']:4.2f} | {cell('fp8_quant')} x{row['fp8_quant_speedup']:4.2f} | "
        f"{cell('scaled_mm')} | {alt} | {static} | {gemv} | {checks}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {', '.join(LAYERS)}")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--no-sweep", action="store_true", help="skip the alternative tile configs")
    parser.add_argument("--json", default=None, help="the report's path (default $OUT/fp8_gemm.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_gemm.py needs a CUDA GPU")
    # every column but `gemv` times fp8_gemm.py's own kernels: no one-row GEMV dispatch
    os.environ["TILELLM_GEMV"] = "0"
    torch.manual_seed(0)
    device = torch.device("cuda")
    print_header()
    rows = []
    for model in args.models.split(","):
        for layer, (N, K) in LAYERS[model].items():
            w = (torch.randn(N, K, device=device) / K**0.5).to(torch.bfloat16)
            b, b_s = ref.quantize_fp8_block(w, BLOCK)
            for M in (int(m) for m in args.ms.split(",")):
                x = torch.randn(M, K, device=device).to(torch.bfloat16)
                row = bench_case(x, w, b, b_s, sweep=not args.no_sweep, merged=layer in MERGED)
                derived(row)
                row.update(model=model, layer=layer)
                print_row(model, layer, row)
                rows.append(row)
    path = pathlib.Path(args.json or pathlib.Path(os.environ.get("OUT", "out")) / "fp8_gemm.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "block_size": BLOCK,
        "scaled_mm": tk.scaled_mm_block_unavailable(device, BLOCK, 128) or "available",
        "rows": rows,
    }
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
