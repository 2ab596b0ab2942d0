"""Benchmark the fused MoE layer (`kernels.moe.fused_moe`) beside a torch expert loop and torch._grouped_mm.

Shapes are the routed experts of two models (one GPU, no tensor parallelism): DeepSeek-V2-Lite
(E=64, K=6, H=2048, I=1408) and Qwen3-30B-A3B (E=128, K=8, H=2048, I=768); their weights (1.1 and
1.2 GB in bf16) are far bigger than L2. For each T, every token's K distinct experts are drawn
uniformly at random (seeded), with random normal activations and weights (scaled by 1/sqrt(fan-in)
so bf16 stays in range) and positive routing weights summing to 1 per token.

Variants: `triton` (fused_moe, eager: what do_bench sees, host launches included), `triton graph`
(the same call replayed from a CUDA graph with L2 flushed before each call: device time only, and
proof that the layer captures), `torch loop` (a loop over the experts hit: `x[idx] @ w.T` in the
input dtype, the way transformers' eager experts run, with an fp32 accumulator) and
`torch grouped_mm` (torch._grouped_mm over the pairs sorted by expert, when this torch has it).
Every variant is checked against the torch loop before it is timed.

Columns: ms (median), TFLOP/s, weight GB/s (the bytes of the experts actually hit plus the
activations in and out, over the time), the floor (the larger of compute at the matmul ceiling
and bytes at the copy bandwidth, both measured in this run by `tilellm.bench.kernels.
measure_ceilings`) and %-of-floor (floor / ms). `--json FILE` writes every row.

    python -m tilellm.bench.moe --tokens 1,64,512,4096 --json moe.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tilellm.commands.common import UsageError


@dataclass(frozen=True)
class MoeShape:
    model: str
    num_experts: int  # E
    top_k: int  # K
    hidden: int  # H
    intermediate: int  # I (moe_intermediate_size)


SHAPES = {
    "v2lite": MoeShape("DeepSeek-V2-Lite", 64, 6, 2048, 1408),
    "qwen3moe": MoeShape("Qwen3-30B-A3B", 128, 8, 2048, 768),
}
CHECK_TOL = 2e-2  # max |error| / max |loop output|: bf16 rounding of the intermediates


@dataclass
class MoeRow:
    shape: str
    tokens: int
    variant: str
    ms: float
    tflops: float | None = None
    weight_gbps: float | None = None
    floor_ms: float | None = None
    pct_of_floor: float | None = None
    experts_hit: int | None = None
    max_rel_err: float | None = None
    note: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write results to this file")
    p.add_argument(
        "--shapes", default="v2lite,qwen3moe", help=f"comma-separated subset of {','.join(SHAPES)}"
    )
    p.add_argument("--tokens", default="1,64,512,4096", help="comma-separated token counts T")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])


# ----------------------------------------------------------------------------------------------
# Inputs, the peers, and the cost model
# ----------------------------------------------------------------------------------------------


def make_experts(shape: MoeShape, dtype, *, device: str = "cuda", seed: int = 0):
    """w13 [E, 2I, H] and w2 [E, H, I], random normal scaled by 1/sqrt(fan-in)."""
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, device=device, dtype=dtype, generator=g) * I**-0.5
    return w13, w2


def make_tokens(shape: MoeShape, tokens: int, dtype, *, device: str = "cuda", seed: int = 0):
    """x [T, H], topk_weights [T, K] fp32 (positive, summing to 1), topk_ids [T, K] int32."""
    E, K = shape.num_experts, shape.top_k
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype, generator=g)
    # K distinct experts per token, uniformly at random: the first K of a random permutation
    ids = torch.rand(tokens, E, device=device, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    weights = torch.rand(tokens, K, device=device, generator=g) + 0.1  # never zero
    return x, weights / weights.sum(dim=1, keepdim=True), ids


def torch_loop(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Per-expert loop in the input dtype (transformers' eager experts), fp32 accumulation."""
    T, K = topk_ids.shape
    E, I = w13.shape[0], w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()  # a host sync: part of this baseline's cost
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // K
        gate_up = x[tokens] @ w13[e].T
        h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
        y = (h @ w2[e].T).float() * topk_weights.reshape(-1)[pairs, None]
        acc.index_add_(0, tokens, y)
    return acc.to(x.dtype)


def torch_grouped_mm(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """torch._grouped_mm over the pairs sorted by expert; offsets = each expert's end row."""
    T, K = topk_ids.shape
    E, I, H = w13.shape[0], w2.shape[2], x.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = x[order // K]  # [T*K, H], rows grouped by expert
    gate_up = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)  # mat_b [E, H, 2I], column-major
    h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [T*K, H]
    y = y.float() * topk_weights.reshape(-1)[order, None]
    per_pair = torch.empty((T * K, H), dtype=torch.float32, device=x.device)
    per_pair[order] = y
    return per_pair.view(T, K, H).sum(dim=1).to(x.dtype)


def moe_flops(shape: MoeShape, tokens: int) -> float:
    """2 * T*K * (2I*H + I*H): per (token, k) pair, the gate/up GEMM (2I x H) and the down GEMM
    (H x I), 2 FLOPs per multiply-add; SiLU, the weight multiply and the sum over K are not counted."""
    H, I = shape.hidden, shape.intermediate
    return 2.0 * tokens * shape.top_k * (2 * I * H + I * H)


def moe_bytes(shape: MoeShape, tokens: int, experts_hit: int, itemsize: int) -> float:
    """The minimum traffic: each expert hit read once (w13 + w2 = 3*I*H elements), x in and out once."""
    H, I = shape.hidden, shape.intermediate
    return experts_hit * 3 * I * H * itemsize + 2 * tokens * H * itemsize


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run_moe_bench(
    shapes: str = "v2lite,qwen3moe",
    tokens=(1, 64, 512, 4096),
    dtype=torch.bfloat16,
    *,
    ceilings: dict[str, float] | None = None,
) -> list[dict]:
    """Times every variant on every (shape, T); one dict per row (see MoeRow). Needs a CUDA GPU."""
    from tilellm.bench.kernels import measure_ceilings

    names = [s.strip() for s in shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        raise UsageError(f"unknown MoE shape(s) {unknown}: choose from {list(SHAPES)}")
    ceilings = ceilings or measure_ceilings()
    rows: list[MoeRow] = []
    for name in names:
        shape = SHAPES[name]
        experts = make_experts(shape, dtype, seed=1)  # one copy of the weights per shape
        for T in tokens:
            try:
                _bench_shape(name, shape, int(T), dtype, experts, ceilings, rows)
            except Exception as e:
                import traceback

                traceback.print_exc()
                rows.append(
                    MoeRow(name, int(T), "FAILED", float("nan"), note=f"{type(e).__name__}: {e}"[:200])
                )
            torch.cuda.empty_cache()
        del experts
        torch.cuda.empty_cache()
    return [asdict(r) for r in rows]


def _bench_shape(name, shape: MoeShape, T: int, dtype, experts, ceilings, rows: list[MoeRow]) -> None:
    from tilellm.bench.kernels import _bench, _bench_graph
    from tilellm.kernels.moe import fused_moe

    w13, w2 = experts
    x, topk_weights, topk_ids = make_tokens(shape, T, dtype, seed=T)
    args = (x, w13, w2, topk_weights, topk_ids)
    experts_hit = int(topk_ids.unique().numel())
    flops = moe_flops(shape, T)
    nbytes = moe_bytes(shape, T, experts_hit, x.element_size())
    floor_ms = max(flops / (ceilings["matmul_tflops"] * 1e12), nbytes / (ceilings["copy_gbps"] * 1e9)) * 1e3

    def row(variant: str, ms: float, err: float | None, note: str = "") -> MoeRow:
        ok = math.isfinite(ms) and ms > 0
        return MoeRow(
            name, T, variant, ms,
            tflops=flops / ms / 1e9 if ok else None,
            weight_gbps=nbytes / ms / 1e6 if ok else None,
            floor_ms=floor_ms,
            pct_of_floor=100.0 * floor_ms / ms if ok else None,
            experts_hit=experts_hit, max_rel_err=err, note=note,
        )  # fmt: skip

    expected = torch_loop(*args)
    out = torch.empty_like(x)
    err = _rel_err(fused_moe(*args, out=out), expected)
    if not err < CHECK_TOL:
        raise AssertionError(f"{name} T={T}: fused_moe differs from the torch loop: {err:.3e} > {CHECK_TOL}")
    rows.append(row("triton", _bench(lambda: fused_moe(*args, out=out)), err))
    try:
        rows.append(row("triton graph", _bench_graph(lambda: fused_moe(*args, out=out)), err, "device time"))
    except Exception as e:  # a host sync inside the layer breaks capture
        rows.append(row("triton graph", float("nan"), None, f"capture failed: {type(e).__name__}: {e}"[:120]))
    rows.append(row("torch loop", _bench(lambda: torch_loop(*args)), 0.0, "the oracle"))
    if not hasattr(torch, "_grouped_mm"):
        rows.append(row("torch grouped_mm", float("nan"), None, "this torch has no _grouped_mm"))
        return
    try:
        err = _rel_err(torch_grouped_mm(*args), expected)
        if not err < CHECK_TOL:
            raise AssertionError(f"differs from the torch loop: {err:.3e}")
        rows.append(row("torch grouped_mm", _bench(lambda: torch_grouped_mm(*args)), err))
    except Exception as e:  # unsupported dtype / GPU / layout in this torch
        rows.append(row("torch grouped_mm", float("nan"), None, f"skipped: {type(e).__name__}: {e}"[:120]))


def _print_table(rows: list[dict]) -> None:
    def fmt(value, spec: str, width: int) -> str:
        return format(value, spec) if value is not None else " " * width

    print(
        f"{'shape':9} {'T':>5} {'variant':17} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'floor ms':>9} "
        f"{'%floor':>6} {'hit':>4}  note"
    )
    for r in rows:
        print(
            f"{r['shape']:9} {r['tokens']:5d} {r['variant']:17} {r['ms']:9.4f} {fmt(r['tflops'], '8.1f', 8)} "
            f"{fmt(r['weight_gbps'], '7.0f', 7)} {fmt(r['floor_ms'], '9.4f', 9)} "
            f"{fmt(r['pct_of_floor'], '6.1f', 6)} {fmt(r['experts_hit'], '4d', 4)}  {r['note']}"
        )


def main(args: argparse.Namespace) -> int:
    from tilellm.bench.kernels import measure_ceilings

    if not torch.cuda.is_available():
        raise UsageError(
            "this benchmark times the MoE kernels on a CUDA GPU and none is visible here "
            "(on the CPU the kernels' tests run them: pytest tests/kernels/test_moe.py)"
        )
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
    except ValueError as e:
        raise UsageError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from e
    t0 = time.time()
    ceilings = measure_ceilings()
    print(
        f"# {torch.cuda.get_device_name()}  copy {ceilings['copy_gbps']:.0f} GB/s  "
        f"matmul {ceilings['matmul_tflops']:.0f} TFLOP/s"
    )
    rows = run_moe_bench(args.shapes, tokens, getattr(torch, args.dtype), ceilings=ceilings)
    _print_table(rows)
    print(f"# {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "ceilings": ceilings, "rows": rows}, f, indent=1
            )
    return 1 if any(r["variant"] == "FAILED" for r in rows) else 0


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilellm.bench.moe", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except UsageError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    raise SystemExit(_cli())
