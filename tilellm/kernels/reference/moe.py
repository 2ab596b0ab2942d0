"""PyTorch twin of `tilellm.kernels.moe.fused_moe`: the routed experts of a mixture-of-experts layer.

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
    e = topk_ids[t, k]

A loop over the experts that received tokens, as transformers' `DeepseekV3Experts.forward` runs
it (experts in ascending order, each expert's rows added into the output with `index_add_`), but
in fp32 throughout; the result comes back in `hidden_states.dtype`. It reads the routing on the
host (one sync per call): it is the CPU oracle of the tests, not a path for CUDA graphs.

Block-quantized FP8 experts (w13 / w2 float8_e4m3fn with their [bn, bk] block scales) run the
kernel's W8A8 math on dequantized tensors: x is quantized per token and group of bk channels
and dequantized again (x_q * x_s), each expert's weights are dequantized (w_q * block scale),
and the products run in fp32. The intermediate is rounded to the hidden dtype before its own
quantization, as the kernel stores it between the two GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilellm.kernels.fp8 import is_fp8
from tilellm.kernels.moe import check_fused_moe
from tilellm.kernels.reference.fp8_gemm import (
    dequantize_fp8_block,
    per_token_group_quant_fp8,
    scaled_fp8_quant,
)


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: list[int] | tuple[int, int] | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts: hidden_states [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
    topk_weights [T, K] float32, topk_ids [T, K] int -> [T, H] in hidden_states.dtype (into `out` if given).

    fp8 experts: w13 / w2 float8_e4m3fn with w13_scale [E, cdiv(2I, bn), cdiv(H, bk)] and
    w2_scale [E, cdiv(H, bn), cdiv(I, bk)] float32, block_shape [bn, bk] (see the module docstring);
    a1_scale / a2_scale: static activation scales (one float32 element each) for the experts'
    input and their SiLU-and-mul output, instead of per token-group quantization.
    """
    check_fused_moe(
        hidden_states, w13, w2, topk_weights, topk_ids, out,
        w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape,
        a1_scale=a1_scale, a2_scale=a2_scale,
    )  # fmt: skip
    T, H = hidden_states.shape
    E, I, K = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    quantized = is_fp8(w13)
    x = _quantize_dequantize(hidden_states, block_shape[1], a1_scale) if quantized else hidden_states.float()
    acc = torch.zeros(T, H, dtype=torch.float32, device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1).long()  # pair p = t * K + k
    flat_weights = topk_weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, in token order
    counts = torch.bincount(flat_ids, minlength=E).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // K
        if quantized:
            w13_e = dequantize_fp8_block(w13[e], w13_scale[e], list(block_shape), torch.float32)
            w2_e = dequantize_fp8_block(w2[e], w2_scale[e], list(block_shape), torch.float32)
        else:
            w13_e, w2_e = w13[e].float(), w2[e].float()
        gate_up = x[tokens] @ w13_e.T  # [n, 2I]
        h = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # [n, I]
        if quantized:
            h = _quantize_dequantize(h.to(hidden_states.dtype), block_shape[1], a2_scale)
        y = (h @ w2_e.T) * flat_weights[pairs, None]  # [n, H]
        acc.index_add_(0, tokens, y)
    if out is None:
        return acc.to(hidden_states.dtype)
    return out.copy_(acc)


def _quantize_dequantize(x: torch.Tensor, group_size: int, static_scale: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> x_q * x_s [M, K] fp32: the values the W8A8 GEMM sees, per token-group
    quantized, or by the one static scale."""
    if static_scale is not None:
        x_q, scale = scaled_fp8_quant(x, static_scale)
        return x_q.float() * scale
    x_q, x_s = per_token_group_quant_fp8(x, group_size)
    return x_q.float() * x_s.repeat_interleave(group_size, dim=1)
