"""The FP8 activation quantization inside the op before the GEMM, against a launch of its own.

    python benchmarks/fused_quant.py [--tokens 17,64,256,1024,4096] [--json FILE]

An FP8 linear layer with dynamic scales quantizes its input per token and 128-wide group. From 17
tokens that quantization runs in the launch of the op that makes the input (`docs/fp8.md`):

- `norm`: the residual add and RMSNorm before qkv_proj / gate_up_proj:
  `rms_norm(x, w, eps, residual=r)` then `per_token_group_quant_fp8(y, 128)` ("two launches")
  against `rms_norm_per_token_group_quant_fp8(x, w, eps, 128, residual=r)` ("one launch");
- `silu`: SiLU-and-mul before down_proj: `silu_and_mul(x)` then `per_token_group_quant_fp8`
  against `silu_and_mul_per_token_group_quant_fp8(x, 128)`.

Shapes: the hidden size (norm) and the intermediate size (silu) of Qwen3-0.6B (1024, 3072) and
Qwen3-8B (4096, 12288), bf16. Each variant's calls are captured in one CUDA graph, one call per
input of its own (enough inputs that they exceed the 50 MB L2, at least 8), as a decode step's
graph runs them; the replay is timed by `triton.testing.do_bench` (median) and divided by the
calls. The floor is each variant's bytes (what it must read and write) at the copy rate measured
in the same run. Before timing, the one-launch outputs are checked against the two launches' bit
for bit (e4m3 bits, scales, residual). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tilellm.bench.timing import copy_gbps as measure_copy_gbps
from tilellm.bench.timing import graph_replay_us

GROUP = 128
SHAPES = {"qwen3-0.6b": (1024, 3072), "qwen3-8b": (4096, 12288)}  # (hidden, intermediate)
L2_BYTES = 50 << 20
DEVICE = "cuda"


def _same(a: tuple, b: tuple) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def measure(op: str, width: int, tokens: int, copy_gbps: float) -> dict:
    """One op ("norm" over `width` channels or "silu" to `width` channels) at `tokens` tokens."""
    from tilellm.kernels import fused
    from tilellm.kernels.fp8_gemm import per_token_group_quant_fp8

    in_width = width if op == "norm" else 2 * width
    per_input = tokens * in_width * 2 * (2 if op == "norm" else 1)
    copies = max(8, -(-2 * L2_BYTES // per_input))
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    bf16 = {"device": DEVICE, "dtype": torch.bfloat16}
    xs = [torch.randn(tokens, in_width, generator=gen, **bf16) for _ in range(copies)]
    weight = torch.randn(width, generator=gen, **bf16)
    if op == "norm":
        rs = [torch.randn_like(x) for x in xs]

        def two(i: int) -> tuple:
            y, res = fused.rms_norm(xs[i], weight, 1e-6, residual=rs[i])
            return (*per_token_group_quant_fp8(y, GROUP), res)

        def one(i: int) -> tuple:
            return fused.rms_norm_per_token_group_quant_fp8(xs[i], weight, 1e-6, GROUP, residual=rs[i])

        # x, residual in; residual, e4m3, scales out (+ y out and back in for two launches)
        fused_bytes = tokens * width * (2 + 2 + 2 + 1) + tokens * (width // GROUP) * 4
        two_bytes = fused_bytes + 2 * tokens * width * 2
    else:

        def two(i: int) -> tuple:
            return per_token_group_quant_fp8(fused.silu_and_mul(xs[i]), GROUP)

        def one(i: int) -> tuple:
            return fused.silu_and_mul_per_token_group_quant_fp8(xs[i], GROUP)

        fused_bytes = tokens * 2 * width * 2 + tokens * width + tokens * (width // GROUP) * 4
        two_bytes = fused_bytes + 2 * tokens * width * 2
    if not _same(one(0), two(0)):
        raise AssertionError(f"{op} {width} x {tokens}: one launch differs from two")
    us_two = graph_replay_us([lambda i=i: two(i) for i in range(copies)])
    us_one = graph_replay_us([lambda i=i: one(i) for i in range(copies)])
    return {
        "op": op,
        "width": width,
        "tokens": tokens,
        "us_two_launches": us_two,
        "us_one_launch": us_one,
        "floor_us_one_launch": fused_bytes / copy_gbps / 1e3,
        "gbps_one_launch": fused_bytes / us_one / 1e3,
        "gbps_two_launches": two_bytes / us_two / 1e3,
        "copies": copies,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="17,64,256,1024,4096", help="comma-separated token counts")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_quant.py needs a CUDA GPU", file=sys.stderr)
        return 1
    copy_gbps = measure_copy_gbps()
    print(f"device: {torch.cuda.get_device_name()}, copy {copy_gbps:.0f} GB/s")
    header = ("op", "model", "width", "tokens", "two us", "one us", "floor", "x")
    print("{:5} {:11} {:>6} {:>6} {:>8} {:>8} {:>7} {:>6}".format(*header))
    results = []
    for model, (hidden, intermediate) in SHAPES.items():
        for op, width in (("norm", hidden), ("silu", intermediate)):
            for tokens in (int(t) for t in args.tokens.split(",")):
                r = measure(op, width, tokens, copy_gbps) | {"model": model}
                results.append(r)
                print(
                    f"{op:5} {model:11} {width:6d} {tokens:6d} {r['us_two_launches']:8.2f} "
                    f"{r['us_one_launch']:8.2f} {r['floor_us_one_launch']:7.2f} "
                    f"{r['us_two_launches'] / r['us_one_launch']:5.2f}x"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
