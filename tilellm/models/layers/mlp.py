"""The gated MLP (SwiGLU) of Llama-family decoders and of MoE shared experts."""

from __future__ import annotations

import types

import torch
from torch import nn

from tilellm.models.layers.activation import SiluAndMul
from tilellm.models.layers.linear import LayerInput, MergedColumnParallelLinear, RowParallelLinear
from tilellm.models.layers.ops import runs_kernels


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj x) * up_proj x), with gate and up in one matmul: [T, H] -> [T, H].

    `reduce_results=False` leaves down_proj's partial sums un-reduced under tensor parallelism
    (an MoE block adds them to its experts' and reduces once).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        fused_ops: types.ModuleType,
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        reduce_results: bool = True,
    ):
        super().__init__()
        h, i = hidden_size, intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], bias, tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(
            i, h, bias, reduce_results=reduce_results, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act_fn = SiluAndMul(fused_ops)

    @property
    def input_linear(self) -> MergedColumnParallelLinear:
        """The one layer that reads the MLP's input (the norm before may quantize for it)."""
        return self.gate_up_proj

    def forward(self, x: LayerInput) -> torch.Tensor:
        gate_up = self.gate_up_proj
        # a few rows (gemv.py, or PDL): the gate-up GEMM and SiLU-and-mul in one launch (with the
        # kernel ops only: the reference backend runs its own SiLU-and-mul)
        act = None
        if runs_kernels(self.act_fn.ops):
            act = gate_up.quant_method.apply_silu_and_mul(gate_up, x, gate_up.bias)
        if act is None:
            # (an FP8 down_proj takes silu(gate) * up quantized in the activation's own launch)
            act = self.act_fn(gate_up(x), quant_for=self.down_proj)
        return self.down_proj(act)
