"""PyTorch twin of `tilellm.kernels.sparse_mla`: DeepSeek-V3.2's sparse (DSA) MLA attention.

The absorbed form of `tilellm.kernels.reference.mla` (one latent row `[c, k_pe]` per token,
shared by every query head), restricted per query token to the logical positions listed in its
row of `topk_indices`:

    score_h(r) = scale * q_h . row_r    for r in topk_indices[t], 0 <= r <= pos_t
    o_h        = softmax_r(score_h) @ c_r    (c_r: the row's first kv_lora_rank values)

where token j of request i sits at `pos = seq_lens[i] - q_len_i + j`. Other entries (-1, and
any other negative or future position the checks let through on the GPU) are skipped; a token
with no valid entry outputs zeros. One loop over requests, each token's selected rows gathered
through the block table (an FP8 cache's dequantized, `stored.float() * kv_scale`), fp32
scores / softmax / accumulation, outputs in q.dtype. Checks are the Triton twin's (`tilellm.kernels.sparse_mla.check_sparse_mla`).
"""

from __future__ import annotations

import torch

from tilellm.kernels.fp8 import dequantized_rows
from tilellm.kernels.mla import mla_output
from tilellm.kernels.sparse_mla import check_sparse_mla

# Upper bound on the fp32 elements of gathered rows and scores materialised at once (about
# 256 MiB); requests with more tokens x K x (row width + heads) are processed in token chunks.
_MAX_ELEMENTS = 1 << 26


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    topk_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
    plan=None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MLA of packed tokens q [T, H, kv_lora_rank + rope_dim] over their selected latent
    rows (topk_indices [T, K] int32, -1 = empty) -> o [T, H, kv_lora_rank] in q.dtype; kv_cache
    in q.dtype, or FP8 with its float32 one-element `kv_scale` (None = 1.0).

    `plan` (the Triton kernel's tile and split plan) is accepted and ignored."""
    name = "sparse_mla_attention"
    check_sparse_mla(
        name, q, kv_cache, block_table, cu_seqlens_q, topk_indices, seq_lens, kv_lora_rank, scale, kv_scale
    )
    o = mla_output(name, q, kv_lora_rank, out)
    bounds = cu_seqlens_q.tolist()
    kv_lens = seq_lens.tolist()
    block_size = kv_cache.shape[1]
    T, H, width = q.shape
    K = topk_indices.shape[1]
    chunk = max(1, _MAX_ELEMENTS // max(1, K * (width + H)))
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        first_pos = kv_lens[i] - (end - start)  # position of the request's first new token
        for lo in range(start, end, chunk):
            hi = min(end, lo + chunk)
            pos = first_pos + torch.arange(lo - start, hi - start, device=q.device)  # [n]
            idx = topk_indices[lo:hi].long()  # [n, K]
            valid = (idx >= 0) & (idx <= pos[:, None])
            safe = torch.where(valid, idx, 0)
            blocks = torch.where(valid, block_table[i].long()[safe // block_size], 0)
            rows = dequantized_rows(kv_cache[blocks, safe % block_size, 0], kv_scale)  # [n, K, width]
            scores = torch.einsum("nhd,nkd->nhk", q[lo:hi].float(), rows) * float(scale)  # [n, H, K]
            scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            probs = probs.masked_fill(~valid.any(-1)[:, None, None], 0.0)  # no valid entry: zeros
            o[lo:hi] = torch.einsum("nhk,nkc->nhc", probs, rows[..., :kv_lora_rank]).to(o.dtype)
    return o
