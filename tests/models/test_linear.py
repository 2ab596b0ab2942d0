"""Tensor-parallel linear layers (`tilellm.models.layers.linear`), ranks run one after the other
on CPU where no collective is needed."""

from __future__ import annotations

import torch

from tilellm.models.layers.linear import RowParallelLinear


def test_row_parallel_partial_sums_carry_the_bias_once():
    """`reduce_results=False` (an MoE block's shared expert, reduced with the experts): the ranks'
    outputs sum to x W^T + b, the bias counted once."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen)
    x = torch.randn(3, 8, generator=gen)
    total = torch.zeros(3, 6)
    for rank in range(2):
        layer = RowParallelLinear(8, 6, bias=True, reduce_results=False, tp_rank=rank, tp_size=2)
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
        total += layer(x[:, rank * 4 : (rank + 1) * 4])
    torch.testing.assert_close(total, x @ weight.T + bias)
