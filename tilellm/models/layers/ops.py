"""Which implementation of the fused element-wise ops (RMSNorm, SiLU-and-mul, RoPE), of the fused
MoE experts and of the FP8 GEMM a model uses.

Same policy as the attention backends (`tilellm.attention.backends.backend_class`): the Triton
kernels on CUDA or when asked for ("triton"; on CPU that needs TRITON_INTERPRET=1), the PyTorch
reference otherwise.
"""

from __future__ import annotations

import importlib
import types

import torch


def resolve_ops(backend: str, device: torch.device | str, kernels: str) -> types.ModuleType:
    """`tilellm.kernels.<kernels>` or its twin `tilellm.kernels.reference.<kernels>` for backend
    "triton" | "reference" | "auto" (Triton on CUDA, the twin otherwise)."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "reference"
    package = "tilellm.kernels" if backend == "triton" else "tilellm.kernels.reference"
    return importlib.import_module(f"{package}.{kernels}")


def runs_kernels(ops: types.ModuleType) -> bool:
    """Whether `ops` is a kernel module, not its PyTorch twin. Only kernel modules hand their
    work to the linear layer beside them (the RMSNorm before a layer, the SiLU-and-mul after a
    gate-up projection, run in the layer's launch): the reference backend keeps every op its own,
    as the oracle it is."""
    return not ops.__name__.startswith("tilellm.kernels.reference.")


def resolve_fused_ops(backend: str, device: torch.device | str) -> types.ModuleType:
    """`tilellm.kernels.fused` or `.reference.fused` (RMSNorm, SiLU-and-mul, RoPE)."""
    return resolve_ops(backend, device, "fused")


def resolve_moe_ops(backend: str, device: torch.device | str) -> types.ModuleType:
    """`tilellm.kernels.moe` or `.reference.moe` (the `fused_moe` of MoE layers)."""
    return resolve_ops(backend, device, "moe")


def resolve_fp8_gemm_ops(backend: str, device: torch.device | str) -> types.ModuleType:
    """`tilellm.kernels.fp8_gemm` or `.reference.fp8_gemm` (FP8 linear layers' quantizer and GEMM)."""
    return resolve_ops(backend, device, "fp8_gemm")
