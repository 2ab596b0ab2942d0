"""Qwen3-0.6B's linear layers at decode sizes, as a decode step runs them: us per GEMM, weight GB/s.

    python benchmarks/linear_layers.py [--rows 1,8,64,256] [--json FILE]

The four layer shapes of a decoder layer (qkv 1024->4096, o 2048->1024, gate-up 1024->6144,
down 3072->1024) and the LM head (1024->151936), bf16. Each variant's calls of one layer shape
are captured in one CUDA graph, one call per layer on its own weight (28 weights, as the model's
28 layers; the LM head: one weight, 311 MB), so that every call reads its weight from HBM and no
host launch time counts, as in the engine's decode graphs; the graph's replay is timed by
`triton.testing.do_bench` (median) and divided by the calls. Variants:

- `cublas`, `cublaslt`: `torch.nn.functional.linear` with `torch.backends.cuda.preferred_blas_library`
  set to each (the engine runs the default, cuBLAS, whose heuristics pick cuBLASLt's kernels);
- `mv` (one row only): the same product as a matrix-vector product (`F.linear` on the 1-D row),
  which cuBLAS runs as a GEMV;
- `skinny` (up to `SKINNY_MAX_ROWS` rows): `tilellm.kernels.skinny.skinny_linear`, which runs its
  narrow-tile Triton GEMM, and up to `GEMV_MAX_ROWS` rows `tilellm.kernels.gemv`'s kernels (this
  script sets `TILELLM_GEMV=1` for it);
- at one row, for the layers that read an RMSNorm (qkv, gate-up) also the layer with its
  neighbours as a decoder layer runs them: `ops+cublas` is `rms_norm` (with the residual) then
  cuBLAS (then `silu_and_mul` for gate-up), `ops+gemv` the one launch of
  `skinny_rms_norm_linear` (with `silu_and_mul=True` for gate-up).

The weight bytes over the time say how far each call is from streaming its weights at the copy
rate (about 4.3 TB/s on an H200). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F

from tilellm.bench.timing import graph_replay_us

SHAPES = {  # name: (in_features, out_features)
    "qkv": (1024, 4096),
    "o": (2048, 1024),
    "gate_up": (1024, 6144),
    "down": (3072, 1024),
    "lm_head": (1024, 151936),
}
NUM_LAYERS = 28


def _variants(rows: int) -> list[str]:
    from tilellm.kernels.skinny import SKINNY_MAX_ROWS

    names = ["cublas", "cublaslt"]
    if rows == 1:
        names.append("mv")
    if rows <= SKINNY_MAX_ROWS:
        names.append("skinny")
    return names


def _calls(variant: str, xs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[Callable]:
    if variant == "mv":
        return [lambda x=x, w=w: F.linear(x[0], w) for x, w in zip(xs, weights)]
    if variant == "skinny":
        from tilellm.kernels.skinny import skinny_linear

        return [lambda x=x, w=w: skinny_linear(x, w, None) for x, w in zip(xs, weights)]
    return [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]


# `TILELLM_GEMV=1` for the gemv columns (read at each call, so for the calls a graph captures)
GEMV_ON = {"TILELLM_GEMV": "1"}


def _with_neighbours(name: str, xs: list[torch.Tensor], weights: list[torch.Tensor]) -> dict[str, float]:
    """{`ops+cublas`, `ops+gemv`: us per call} of a one-row layer with the RMSNorm before it (and,
    for gate-up, the SiLU-and-mul after it), as separate launches and as one."""
    from tilellm.kernels.fused import rms_norm, silu_and_mul
    from tilellm.kernels.skinny import skinny_rms_norm_linear

    gated = name == "gate_up"
    k = xs[0].shape[1]
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    residuals = [torch.randn_like(x) for x in xs]

    def separate(x, r, w):
        y = F.linear(rms_norm(x, norm_w, 1e-6, residual=r)[0], w)
        return silu_and_mul(y) if gated else y

    def fused(x, r, w):
        return skinny_rms_norm_linear(x, norm_w, 1e-6, w, residual=r, silu_and_mul=gated)

    operands = list(zip(xs, residuals, weights))
    with mock.patch.dict(os.environ, GEMV_ON):
        return {
            variant: graph_replay_us([lambda ops=ops, call=call: call(*ops) for ops in operands])
            for variant, call in (("ops+cublas", separate), ("ops+gemv", fused))
        }


def measure(rows: int) -> dict[str, dict[str, float]]:
    """{layer: {variant: us per call}} at `rows` rows."""
    out: dict[str, dict[str, float]] = {}
    for name, (k, n) in SHAPES.items():
        count = 1 if name == "lm_head" else NUM_LAYERS
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        out[name] = {}
        for variant in _variants(rows):
            torch.backends.cuda.preferred_blas_library("cublaslt" if variant == "cublaslt" else "cublas")
            try:
                with mock.patch.dict(os.environ, GEMV_ON if variant == "skinny" else {}):
                    out[name][variant] = graph_replay_us(_calls(variant, xs, weights))
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
        if rows == 1 and name in ("qkv", "gate_up"):
            out[name].update(_with_neighbours(name, xs, weights))
        del weights, xs
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64,256", help="comma-separated row counts")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_layers.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us per GEMM (weight GB/s)")
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        results[rows] = measure(rows)
        for name, times in results[rows].items():
            k, n = SHAPES[name]
            cells = [f"{v} {us:6.1f} ({k * n * 2 / us / 1e3:5.0f})" for v, us in times.items()]
            print(f"M={rows:4d} {name:8s} " + "  ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(r): t for r, t in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
