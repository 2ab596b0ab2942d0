"""cuBLAS on Qwen3-0.6B's linear layers at small batches: microseconds per GEMM and weight GB/s.

    python benchmarks/linear_layers.py

`torch.nn.functional.linear` in bf16 on the four layer shapes of a decoder layer (qkv 1024->4096,
o 2048->1024, gate-up 1024->6144, down 3072->1024) and the LM head (1024->151936) at 1, 8, 64 and
256 rows, with cuBLAS and with cuBLASLt (`torch.backends.cuda.preferred_blas_library`), timed by
`triton.testing.do_bench` (L2 flushed, median). The weight bytes over the better time say how far
each is from streaming its weights at the copy rate. Needs a CUDA GPU.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

SHAPES = {
    "qkv": (1024, 4096),
    "o": (2048, 1024),
    "gate_up": (1024, 6144),
    "down": (3072, 1024),
    "lm_head": (1024, 151936),
}


def main() -> int:
    import triton.testing

    if not torch.cuda.is_available():
        print("linear_layers.py needs a CUDA GPU", file=sys.stderr)
        return 1
    weights = {
        k: torch.randn(n, k_in, device="cuda", dtype=torch.bfloat16) for k, (k_in, n) in SHAPES.items()
    }
    print("us per GEMM, cuBLAS / cuBLASLt (weight GB/s of the better)")
    for rows in (1, 8, 64, 256):
        cells = []
        for name, w in weights.items():
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            times = []
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                F.linear(x, w)
                times.append(
                    triton.testing.do_bench(
                        lambda x=x, w=w: F.linear(x, w), warmup=20, rep=100, return_mode="median"
                    )
                )
            torch.backends.cuda.preferred_blas_library("cublas")
            us = [t * 1e3 for t in times]
            cells.append(f"{name} {us[0]:.1f}/{us[1]:.1f} ({w.numel() * 2 / min(us) / 1e3:.0f})")
        print(f"M={rows:4d} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
