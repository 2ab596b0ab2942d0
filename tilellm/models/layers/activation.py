"""SwiGLU activation of the gated MLP: silu(gate) * up."""

from __future__ import annotations

import types

import torch
from torch import nn

from tilellm.models.layers.linear import LinearBase, QuantizedActivation


class SiluAndMul(nn.Module):
    """forward(x [T, 2I] = [gate | up]) -> silu(gate) * up, [T, I].

    With `quant_for` (the linear layer that reads the output), the output comes out quantized to
    FP8 in the same launch, as a `QuantizedActivation` [T, I], on the steps where that layer would
    quantize it in a launch of its own (`LinearBase.input_group_quant`: an FP8 down projection's
    many-token steps, and the steps `fp8_gemv.py` runs on a quantized x).
    """

    def __init__(self, ops: types.ModuleType):
        super().__init__()
        self.ops = ops

    def forward(
        self, x: torch.Tensor, *, quant_for: LinearBase | None = None
    ) -> torch.Tensor | QuantizedActivation:
        x2 = x.reshape(-1, x.shape[-1])
        quant = None if quant_for is None else quant_for.input_group_quant(x2.shape[0])
        if quant is None:
            return self.ops.silu_and_mul(x)
        group_size, column_major_scales = quant
        x_q, x_s = self.ops.silu_and_mul_per_token_group_quant_fp8(
            x2, group_size, column_major_scales=column_major_scales
        )
        return QuantizedActivation(x_q, x_s, column_major_scales, x.dtype)
