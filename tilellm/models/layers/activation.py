"""SwiGLU activation of the gated MLP: silu(gate) * up."""

from __future__ import annotations

import types

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """forward(x [T, 2I] = [gate | up]) -> silu(gate) * up, [T, I]."""

    def __init__(self, ops: types.ModuleType):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
