"""Attention backends (see `base.py`) and the choice among them."""

from __future__ import annotations

import torch

from tilellm.attention.backends.base import AttentionBackend, AttentionPlan, AttentionSpec
from tilellm.attention.backends.hopper import HopperBackend
from tilellm.attention.backends.reference import ReferenceBackend
from tilellm.attention.backends.triton import TritonBackend

BACKEND_NAMES = ("auto", "triton", "reference")


def backend_class(name: str, device: torch.device | str) -> type[AttentionBackend]:
    """The backend for `attention_backend=name` ("auto" | "triton" | "reference") on `device`.

    "auto" is Triton on CUDA and the reference on CPU. "triton" is the Hopper backend where
    `hopper.py`'s Gluon kernels run (an sm_90 GPU and a Triton that builds them), the portable
    Triton backend elsewhere; on CPU it needs TRITON_INTERPRET=1 set before triton was imported.
    """
    from tilellm.kernels.config import gluon_ok

    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be 'auto', 'triton' or 'reference', got {name!r}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "reference" or (name == "auto" and not is_cuda):
        return ReferenceBackend
    return HopperBackend if is_cuda and gluon_ok() else TritonBackend


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """An instance of `backend_class(name, device)` (stateless: one serves every layer)."""
    return backend_class(name, device)()


__all__ = [
    "AttentionBackend",
    "AttentionPlan",
    "AttentionSpec",
    "HopperBackend",
    "ReferenceBackend",
    "TritonBackend",
    "backend_class",
    "get_attention_backend",
]
