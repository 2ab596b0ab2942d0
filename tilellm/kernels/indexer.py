"""DeepSeek-V3.2's lightning indexer (DSA): index scores through the block table, top-k per token.

Each token s caches one indexer key k_s (D values, 128 in DeepSeek) in its own paged cache,
index_cache [num_blocks, block_size, 1, D] (the latent cache's block ids); each new token t has
Hi indexer heads q_t,h (Hi = 64) and per-head weights w_t,h, and

    score(t, s) = sum_h w_t,h * relu(scale * q_t,h . k_s)        for s <= pos(t), else excluded

Token t then attends to the `topk` keys of largest score (all its keys when it has fewer).

The Triton kernels follow; this module holds the argument checks the PyTorch twin
(`tilellm.kernels.reference.indexer`) shares.
"""

from __future__ import annotations

import numbers

import torch

from tilellm.kernels import validation as v

# ----------------------------------------------------------------------------------------------
# Argument checks (shared with the PyTorch twin, tilellm.kernels.reference.indexer)
# ----------------------------------------------------------------------------------------------

MAX_INDEX_HEADS = 128  # a decode tile holds one token's Hi heads as rows


def check_index_topk(
    name, q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, topk, scale,
    max_seqlen_k,
) -> None:  # fmt: skip
    """Arguments of `index_topk`: ranks, dtypes, devices and shapes always; index values (a host
    read) on CPU tensors and under TILELLM_DEBUG=1 (`validation.deep_checks_enabled`)."""
    v._check_rank(name, "q", q, 3, "[T, Hi, D]")
    v._check_rank(name, "weights", weights, 2, "[T, Hi]")
    v._check_rank(name, "index_cache", index_cache, 4, "[num_blocks, block_size, 1, D]")
    v._check_rank(name, "block_table", block_table, 2, "[B, max_blocks]")
    v._check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    v._check_rank(name, "seq_lens", seq_lens, 1, "[B]")
    v._check_float(name, {"q": q, "index_cache": index_cache})
    if weights.dtype != torch.float32:
        raise ValueError(f"{name}: weights [T, Hi] must be float32, got {weights.dtype}")
    indices = {"block_table": block_table, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens}
    v._check_int32(name, indices)
    v._check_device(name, {"q": q, "weights": weights, "index_cache": index_cache, **indices})
    T, Hi, D = q.shape
    if not 1 <= Hi <= MAX_INDEX_HEADS:
        raise ValueError(f"{name}: q [T, Hi, D] must have 1..{MAX_INDEX_HEADS} indexer heads, got Hi = {Hi}")
    v._check_head_dim(name, D)
    if tuple(weights.shape) != (T, Hi):
        raise ValueError(
            f"{name}: weights must have shape [T, Hi] = {(T, Hi)} (as q), got {tuple(weights.shape)}"
        )
    if index_cache.shape[1] < 1:
        raise ValueError(f"{name}: block_size (index_cache dim 1) must be >= 1, got {index_cache.shape[1]}")
    if index_cache.shape[2] != 1 or index_cache.shape[3] != D:
        raise ValueError(
            f"{name}: index_cache must be [num_blocks, block_size, 1, D] with D = {D} (q's head dim), "
            f"got shape {tuple(index_cache.shape)}"
        )
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"{name}: cu_seqlens_q must have B+1 = {batch + 1} entries (block_table has B = {batch} rows), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (block_table has {batch} rows), got {seq_lens.shape[0]}"
        )
    v._check_last_dim_stride(name, {"q": q, "weights": weights})
    v._check_contiguous(name, {"index_cache": index_cache, **indices})
    v._check_max_seqlen_type(name, "max_seqlen_q", max_seqlen_q)
    if isinstance(topk, bool) or not isinstance(topk, numbers.Integral) or topk < 1:
        raise ValueError(f"{name}: topk must be an int >= 1, got {topk!r}")
    _check_scale(name, scale)
    if max_seqlen_k is not None:
        v._check_max_seqlen_type(name, "max_seqlen_k", max_seqlen_k)
    if not v.deep_checks_enabled(q):
        return
    q_lens = v._check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, T)
    v._check_max_seqlen_value(name, "max_seqlen_q", max_seqlen_q, q_lens)
    kv_lens = v._check_seq_lens_values(name, seq_lens, q_lens)
    if max_seqlen_k is not None and kv_lens.numel() and max_seqlen_k < int(kv_lens.max()):
        raise ValueError(
            f"{name}: max_seqlen_k = {max_seqlen_k} is smaller than the longest seq_lens entry ({int(kv_lens.max())})"
        )
    v._check_block_table_values(name, block_table, kv_lens, index_cache.shape[0], index_cache.shape[1])


def index_output(name, q, topk, out) -> torch.Tensor:
    """The output [T, topk] int32: `out` once checked, else a new one."""
    shape = (q.shape[0], topk)
    if out is None:
        return torch.empty(shape, dtype=torch.int32, device=q.device)
    v.check_out(name, out, shape, torch.int32, q.device)
    return out


def _check_scale(name, scale) -> None:
    if scale is None:
        raise ValueError(f"{name}: scale is required (DeepSeek-V3.2's is index_head_dim ** -0.5)")
    try:
        v.resolve_scale(scale, 1)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
