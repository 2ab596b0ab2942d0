"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import types

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim.

    forward(x [..., H]) -> y, or forward(x, residual) -> (norm(x + residual), x + residual): the
    pre-norm decoder's "add the sublayer output to the residual stream, then normalise" in one op.
    """

    def __init__(self, hidden_size: int, eps: float, ops: types.ModuleType):
        super().__init__()
        self.hidden_size, self.eps, self.ops = hidden_size, eps, ops
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        if residual is None:
            return self.ops.rms_norm(x2, self.weight, self.eps).view(shape)
        y, res = self.ops.rms_norm(x2, self.weight, self.eps, residual=residual.reshape(-1, self.hidden_size))
        return y.view(shape), res.view(shape)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (DeepSeek-V3.2's indexer
    keys); in the input's dtype, as torch's own."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
