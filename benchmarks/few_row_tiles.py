"""Qwen3-0.6B's decoder-layer linear layers at 2-16 rows, by kernel and tile: us per layer call.

    python benchmarks/few_row_tiles.py [--rows 8,2] [--json F]

(with tilellm installed, or from the repository root with `PYTHONPATH=.`)

At one row the engine runs `gemv.py`'s whole-tile GEMV; from two rows on, cuBLAS (the rows
kernel of `gemv.py` and `skinny.py`'s GEMM measured slower there: docs/benchmarks.md, "One-row
linear layers"). This looks for tiles that change that. Each layer runs as a decode step runs it
with its neighbours: qkv after the RMSNorm (with the residual), o_proj alone, gate-up after the
RMSNorm and before the SiLU-and-mul, down_proj alone. Variants:

- `cublas`: the separate launches (`rms_norm`, `F.linear`, `silu_and_mul`), as the engine runs
  steps of more than one row;
- `rows nt{N} pe{E}` (up to `GEMV_MAX_ROWS` rows): `gemv.py`'s rows kernel with `ROWS_N_TILES=N`
  column tiles a program (x read and normalised once for them) and `ROWS_PRODUCT_ELEMENTS=E`;
- `skinny {BLOCK_N}/{BLOCK_K}/w{warps}/s{stages}`: `skinny.py`'s GEMM (16-row tensor-core tiles)
  at that tile, `skinny_config` patched; BLOCK_K of 1024 takes a K of 1024 in one step (no loop),
  as the GEMV does; `skinny default` is `skinny_config`'s own choice.

Each variant's 28 calls, on weights of their own (more bytes than L2 holds), are captured in one
CUDA graph and its replay timed (`tilellm.bench.timing.graph_replay_us`); each variant's output is
first checked against `cublas`'s (relative error under 2%). Prints, per layer and row count,
cuBLAS and the three fastest variants. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
import triton

from tilellm.bench.timing import graph_replay_us
from tilellm.kernels import gemv, skinny
from tilellm.kernels.fused import rms_norm, silu_and_mul

NUM_LAYERS = 28
EPS = 1e-6
# name: (in_features, out_features, the neighbours: "norm" before, "norm_gated" also SiLU-and-mul after)
LAYERS = {
    "qkv": (1024, 4096, "norm"),
    "o": (2048, 1024, None),
    "gate_up": (1024, 6144, "norm_gated"),
    "down": (3072, 1024, None),
}
ROWS_TILES = list(itertools.product((1, 2, 4), (16384, 32768)))  # (ROWS_N_TILES, ROWS_PRODUCT_ELEMENTS)
SKINNY_TILES = list(
    itertools.product((16, 32), (256, 1024), (4, 8), (1, 3))
)  # (BLOCK_N, BLOCK_K, warps, stages)


def _layer_call(kind: str | None, ours: bool, norm_weight: torch.Tensor) -> Callable:
    """One layer call (x, residual, weight) -> output, with its neighbours: separate launches and
    cuBLAS, or (ours) the few-row kernels' launch that takes them."""
    gated = kind == "norm_gated"
    if not ours:

        def separate(x, r, w):
            if kind is None:
                return F.linear(x, w)
            y = F.linear(rms_norm(x, norm_weight, EPS, residual=r)[0], w)
            return silu_and_mul(y) if gated else y

        return separate

    def fused(x, r, w):
        if kind is None:
            return skinny.skinny_linear(x, w)
        return skinny.skinny_rms_norm_linear(x, norm_weight, EPS, w, residual=r, silu_and_mul=gated)[0]

    return fused


def measure(name: str, rows: int) -> dict[str, float]:
    k, n, kind = LAYERS[name]
    gen = torch.Generator(device="cuda").manual_seed(rows * 1000 + k + n)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    weights = [randn(n, k, scale=0.02) for _ in range(NUM_LAYERS)]
    xs = [randn(rows, k) for _ in range(NUM_LAYERS)]
    residuals = [randn(rows, k) for _ in range(NUM_LAYERS)]
    norm_weight = torch.rand(k, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    operands = list(zip(xs, residuals, weights))
    baseline = _layer_call(kind, False, norm_weight)
    reference = baseline(*operands[0]).float()
    row = {"cublas": graph_replay_us([lambda ops=ops: baseline(*ops) for ops in operands])}
    ours = _layer_call(kind, True, norm_weight)

    def timed(label: str, env: dict[str, str], patches: list) -> None:
        with mock.patch.dict(os.environ, env), contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            try:
                out = ours(*operands[0]).float()
            except triton.runtime.errors.OutOfResources as exc:  # (a tile past the SM's shared memory)
                print(f"  {name} M={rows} {label}: {exc}, not timed", file=sys.stderr)
                return
            err = ((out - reference).abs().max() / reference.abs().max()).item()
            if err > 2e-2:
                print(f"  {name} M={rows} {label}: relative error {err:.3g}, not timed", file=sys.stderr)
                return
            row[label] = graph_replay_us([lambda ops=ops: ours(*ops) for ops in operands])

    if rows <= gemv.GEMV_MAX_ROWS:
        for nt, pe in ROWS_TILES:
            patch = mock.patch.multiple(gemv, ROWS_N_TILES=nt, ROWS_PRODUCT_ELEMENTS=pe)
            timed(f"rows nt{nt} pe{pe}", {"TILELLM_GEMV": "1"}, [patch])
    for tile in [None, *SKINNY_TILES]:
        skinny._plan.cache_clear()
        patches = (
            [] if tile is None else [mock.patch.object(skinny, "skinny_config", lambda M, N, K, t=tile: t)]
        )
        label = "skinny default" if tile is None else "skinny {}/{}/w{}/s{}".format(*tile)
        timed(label, {"TILELLM_GEMV": "0"}, patches)
    skinny._plan.cache_clear()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("few_row_tiles.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us per layer call")
    results: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for rows in (int(r) for r in args.rows.split(",")):
        for name in LAYERS:
            row = results[f"{name} M={rows}"] = measure(name, rows)
            best = sorted((us, label) for label, us in row.items() if label != "cublas")[:3]
            cells = " | ".join(f"{label} {us:.2f}" for us, label in best)
            print(
                f"{name:8s} M={rows:2d} cublas {row['cublas']:6.2f} | {cells}  "
                f"[{time.perf_counter() - t0:.0f} s]"
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "us_per_call": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
