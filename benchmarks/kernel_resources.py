"""Registers and spills of the one-row GEMV kernels at the tiles the engine launches, compiled for
Hopper (sm_90a) on any machine: no GPU needed.

    python benchmarks/kernel_resources.py [--models qwen3-0.6b,qwen3-8b,deepseek-v3]

For each layer shape of the models and each form a decode layer launches (plain; with the RMSNorm
in the launch; gated, SiLU-and-mul in gate-up's launch), the kernel of `gemv.py` (bf16) and of
`fp8_gemv.py` (e4m3 weights in 128 x 128 blocks, one row of x quantized in the kernel, or loaded
quantized where `fp8_gemv_quantizes_x` says so) is compiled by Triton for sm_90a at the tile
`gemv_tile` / `fp8_gemv_tile` gives, and the binary's resource use is read with the `cuobjdump`
that Triton ships: registers a thread and STACK, the bytes a thread spills to local memory. A
tile that spills does not say how much slower it runs, only where to look first when a GPU is at
hand. The Triton on this machine compiles: its code may differ from the GPU machine's version.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tilellm.kernels import fp8_gemv, gemv

TARGET = GPUTarget("cuda", 90, 32)
MODELS = {  # name: {layer: (N, K)}; gate-up's N is the gate's (the weight holds 2N rows)
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (3072, 1024), "down": (1024, 3072)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (12288, 4096), "down": (4096, 12288)},
    "deepseek-v3": {"q_a+kv_a": (2112, 7168), "o": (7168, 16384), "dense gate_up": (18432, 7168)},
}
NORMED = ("qkv", "gate_up", "q_a+kv_a", "dense gate_up")  # layers that read an RMSNorm
GATED = ("gate_up", "dense gate_up")


def _resources(fn: triton.JITFunction, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict,
               num_warps: int) -> tuple[int, int]:  # fmt: skip
    """(registers a thread, stack bytes a thread) of `fn` compiled for TARGET: every argument an
    int32 but `pointers` (name: Triton pointer type), `floats` (fp32) and `constexprs`."""
    signature = {name: "i32" for name in fn.arg_names}
    signature.update(pointers)
    signature.update({name: "fp32" for name in floats})
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": 1})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        run = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True)
    usage = run.stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output: {usage[-300:]!r}")
    return int(found.group(1)), int(found.group(2))


def gemv_resources(N: int, K: int, gated: bool, norm: bool) -> tuple[str, int, int]:
    """(tile, registers, stack bytes) of `gemv.py`'s one-row kernel in bf16."""
    _, block_n, block_k, k_tiles = gemv.gemv_tile(1, K)
    bf16 = "*bf16"
    pointers = {name: bf16 for name in ("X", "W", "B", "Y", "NW", "R", "RO")}
    flags = dict(
        HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=k_tiles, EVEN_N=N % block_n == 0,
        GATED=gated, NORM=norm, HAS_RESIDUAL=norm, USE_PDL=False,
    )  # fmt: skip
    warps = gemv.NUM_WARPS_NORM if norm else gemv.NUM_WARPS
    regs, stack = _resources(gemv._gemv_kernel, pointers, ("eps",), flags, warps)
    return f"{block_n} x {block_k} x {k_tiles}", regs, stack


def fp8_gemv_resources(N: int, K: int, gated: bool, norm: bool) -> tuple[str, int, int]:
    """(tile, registers, stack bytes) of `fp8_gemv.py`'s kernel at one row, 128 x 128 blocks."""
    block_m, block_n, block_g, g_tiles = fp8_gemv.fp8_gemv_tile(1, K, 128)
    quantized_x = not fp8_gemv.fp8_gemv_quantizes_x(1, K, 128)
    pointers = {name: "*bf16" for name in ("X", "Y", "NW", "R", "RO")}
    pointers.update(W="*fp8e4nv", Xs="*fp32", Bs="*fp32", As="*fp32")
    if quantized_x:
        pointers["X"] = "*fp8e4nv"
    flags = dict(
        GROUP_N=128, GROUP_K=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g, G_TILES=g_tiles,
        STATIC_A=False, GATED=gated, NORM=norm and not quantized_x, HAS_RESIDUAL=norm and not quantized_x,
        QUANTIZED_X=quantized_x, USE_PDL=False,
    )  # fmt: skip
    kernel = fp8_gemv._fp8_gemv_kernel
    regs, stack = _resources(kernel, pointers, ("eps", "norm_eps"), flags, fp8_gemv.NUM_WARPS)
    x = "x_q" if quantized_x else "x"
    return f"{block_n} x {block_g} x 128 x {g_tiles}, {x}", regs, stack


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    args = parser.parse_args()
    print(f"{'model':12s} {'layer':14s} {'form':6s} | {'gemv.py tile':18s} regs stack | "
          f"{'fp8_gemv.py tile':24s} regs stack")  # fmt: skip
    for model in args.models.split(","):
        for layer, (N, K) in MODELS[model].items():
            forms = [("plain", False, False)]
            forms += [("norm", False, True)] if layer in NORMED else []
            forms += [("gated", True, layer in NORMED)] if layer in GATED else []
            for form, gated, norm in forms:
                tile16, regs16, stack16 = gemv_resources(N, K, gated, norm)
                tile8, regs8, stack8 = fp8_gemv_resources(N, K, gated, norm)
                print(
                    f"{model:12s} {layer:14s} {form:6s} | {tile16:18s} {regs16:4d} {stack16:5d} | "
                    f"{tile8:24s} {regs8:4d} {stack8:5d}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
