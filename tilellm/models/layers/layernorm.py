"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import types

import torch
from torch import nn

from tilellm.models.layers.linear import LayerInput, LinearBase, NormedActivation, QuantizedActivation
from tilellm.models.layers.ops import runs_kernels


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim.

    forward(x [..., H]) -> y, or forward(x, residual) -> (norm(x + residual), x + residual): the
    pre-norm decoder's "add the sublayer output to the residual stream, then normalise" in one op.
    With `quant_for` (the linear layer that reads y), y comes out quantized to FP8 in the same
    launch, as a `QuantizedActivation` [T, H], on the steps where that layer would quantize it in a
    launch of its own (`LinearBase.input_group_quant`: an FP8 layer's many-token steps, and the
    steps `fp8_gemv.py` runs on a quantized x) and the
    group width is a power of two; or, where that layer runs the norm in its own launch
    (`LinearMethod.takes_normed_input`: one row on a CUDA device (`gemv.gemv_max_rows`), or under PDL;
    only with the kernel ops, `ops.runs_kernels`), y is a `NormedActivation` and the new residual
    stream an empty [..., H] that the layer's launch fills.
    """

    def __init__(self, hidden_size: int, eps: float, ops: types.ModuleType):
        super().__init__()
        self.hidden_size, self.eps, self.ops = hidden_size, eps, ops
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        quant_for: LinearBase | None = None,
    ) -> LayerInput | tuple[LayerInput, torch.Tensor]:
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        res2 = None if residual is None else residual.reshape(-1, self.hidden_size)
        if (
            quant_for is not None
            and runs_kernels(self.ops)
            and quant_for.quant_method.takes_normed_input(quant_for, x2)
        ):  # the layer runs this norm in its own launch (a few rows: gemv.py or PDL)
            res_out = None if res2 is None else torch.empty_like(x2, memory_format=torch.contiguous_format)
            normed = NormedActivation(x2, self.weight, self.eps, res2, res_out)
            return normed if residual is None else (normed, res_out.view(shape))
        quant = None if quant_for is None else quant_for.input_group_quant(x2.shape[0])
        # (the fused op views a row as whole groups of a power-of-two width: a per-tensor
        # checkpoint's group may be a whole odd-sized row, which the layer then quantizes itself)
        if quant is not None and quant[0] & (quant[0] - 1) == 0:
            group_size, column_major_scales = quant
            out = self.ops.rms_norm_per_token_group_quant_fp8(
                x2, self.weight, self.eps, group_size, residual=res2, column_major_scales=column_major_scales
            )
            y = QuantizedActivation(out[0], out[1], column_major_scales, x.dtype)
            return y if residual is None else (y, out[2].view(shape))
        if residual is None:
            return self.ops.rms_norm(x2, self.weight, self.eps).view(shape)
        y, res = self.ops.rms_norm(x2, self.weight, self.eps, residual=res2)
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
