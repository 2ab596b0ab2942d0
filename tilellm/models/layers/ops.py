"""Which implementation of the fused element-wise ops (RMSNorm, SiLU-and-mul, RoPE) and of the fused
MoE experts a model uses.

Same policy as the attention backends (`tilellm.attention.backends.backend_class`): the Triton
kernels on CUDA or when asked for ("triton"; on CPU that needs TRITON_INTERPRET=1), the PyTorch
reference otherwise.
"""

from __future__ import annotations

import types

import torch


def resolve_fused_ops(backend: str, device: torch.device | str) -> types.ModuleType:
    """`tilellm.kernels.fused` or `.reference.fused` for backend "triton" | "reference" | "auto"."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "reference"
    if backend == "triton":
        import tilellm.kernels.fused as ops
    else:
        import tilellm.kernels.reference.fused as ops
    return ops


def resolve_moe_ops(backend: str, device: torch.device | str) -> types.ModuleType:
    """`tilellm.kernels.moe` or `.reference.moe` (the `fused_moe` of MoE layers), same policy."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "reference"
    if backend == "triton":
        import tilellm.kernels.moe as ops
    else:
        import tilellm.kernels.reference.moe as ops
    return ops
