"""PyTorch twin of `tilellm.kernels.indexer`: DeepSeek-V3.2's lightning indexer (DSA) selection.

Each token s caches one indexer key k_s (D values) in index_cache [num_blocks, block_size, 1, D];
each new token t brings Hi indexer heads q_t,h and fp32 weights w_t,h, and

    score(t, s) = sum_h w_t,h * relu(scale * q_t,h . k_s)        for s <= pos(t), else excluded

(transformers' `DeepseekV32Indexer`: matmul, relu, the weights' matmul over the heads, masked
top-k). Token t gets the positions of its `topk` largest scores; with n < topk causal keys it
gets all n, then -1s. Positions as in `paged_attention`: the j-th new token of request i sits at
`seq_lens[i] - q_len_i + j`.

One loop over requests, keys gathered through the block table, fp32 scores, `torch.topk` (rows
in descending score order; the kernel's order differs, its set does not). Checks are the
Triton twin's (`tilellm.kernels.indexer.check_index_topk`); `max_seqlen_k` is checked and
otherwise ignored.
"""

from __future__ import annotations

import torch

from tilellm.kernels.fp8 import FP8_MAX, quantize_fp8
from tilellm.kernels.indexer import (
    INDEX_SCALE_EPS,
    check_index_topk,
    check_store_index_keys,
    index_output,
    quantize_index_queries,
)
from tilellm.kernels.reference.fp8_gemm import _div_exact, per_token_group_quant_fp8

# Upper bound on the fp32 score elements materialised at once (about 256 MiB): requests with
# more new tokens x heads x keys are scored in chunks of query tokens.
_MAX_SCORE_ELEMENTS = 1 << 26


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    topk: int,
    scale: float,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    index_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `topk` causal key positions of largest index score for each new token of q [T, Hi, D]
    (an e4m3 index_cache: each key row times its `index_scales` entry, and q quantized as the
    kernel does, `quantize_index_queries`, then dequantized, in fp32).

    Returns [T, topk] int32 logical positions, -1 = empty.
    """
    name = "index_topk"
    check_index_topk(
        name, q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, topk, scale,
        max_seqlen_k, index_scales,
    )  # fmt: skip
    o = index_output(name, q, topk, out)
    o.fill_(-1)
    if index_scales is not None:
        q = fp8_index_queries(q)
    bounds, kv_lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    block_size = index_cache.shape[1]
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        kv_len = kv_lens[i]
        positions = torch.arange(kv_len, device=q.device)
        blocks = block_table[i].long()[positions // block_size]
        keys = index_cache[blocks, positions % block_size, 0].float()  # [N, D]
        if index_scales is not None:
            keys = keys * index_scales[blocks, positions % block_size, None]
        q_positions = positions[kv_len - (end - start) :]  # [M]
        chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, kv_len * q.shape[1]))
        for lo in range(start, end, chunk):
            hi = min(end, lo + chunk)
            scores = index_scores(q[lo:hi], weights[lo:hi], keys, scale)  # [m, N]
            own = q_positions[lo - start : hi - start, None]  # [m, 1]
            scores = scores.masked_fill(positions[None, :] > own, float("-inf"))
            k = min(topk, kv_len)
            picked = scores.topk(k, dim=-1).indices  # the causal keys first: their scores are finite
            o[lo:hi, :k] = torch.where(picked <= own, picked, -1).to(torch.int32)
    return o


def fp8_index_queries(q: torch.Tensor) -> torch.Tensor:
    """q [T, Hi, D] as the FP8 scores see it: each head's row in e4m3 with its scale, in fp32."""
    ones = torch.ones(q.shape[:2], device=q.device)
    q8, qs = quantize_index_queries(q, ones, per_token_group_quant_fp8)
    return q8.float() * qs[..., None]


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """score[t, s] = sum_h weights[t, h] * relu(scale * q[t, h] . keys[s]) in fp32: q [M, Hi, D],
    weights [M, Hi], keys [N, D] -> [M, N]."""
    dots = torch.einsum("mhd,nd->mhn", q.float(), keys.float()) * float(scale)
    return torch.einsum("mh,mhn->mn", weights.float(), torch.relu(dots))


def store_index_keys(
    index_k: torch.Tensor,
    index_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    index_scales: torch.Tensor | None = None,
) -> None:
    """PyTorch twin of `tilellm.kernels.indexer.store_index_keys` (the same bytes, the same checks)."""
    check_store_index_keys("store_index_keys", index_k, index_cache, slot_mapping, index_scales)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = index_k[keep]
    flat = index_cache.view(-1, index_cache.shape[-1])
    if index_scales is None:
        flat[slots] = rows.to(index_cache.dtype)
        return
    x = rows.float()
    s = _div_exact(x.abs().amax(dim=-1).clamp(min=INDEX_SCALE_EPS), FP8_MAX)  # [N]
    flat[slots] = quantize_fp8(x, s[:, None])
    index_scales.view(-1)[slots] = s
