"""Sparse MLA: DeepSeek-V3.2's DSA attention over the paged latent cache, in the absorbed form.

The cache is MLA's (`tilellm.kernels.mla`): one row per token, `[c, k_pe]` (kv_lora_rank
latent values, then rope_dim rotated key values), kv_cache [num_blocks, block_size, 1,
kv_lora_rank + rope_dim], shared by every query head. DeepSeek-V3.2 adds a selection: an indexer
picks, for each query token t, the K logical positions it attends to (top-2048), `topk_indices[t]`
(-1 = empty), and

    score_h(r) = scale * (q_nope_h . c_r + q_pe_h . k_pe_r)    for r in topk_indices[t]
    o_h        = softmax_r(score_h) @ c

An entry counts when 0 <= r <= the token's position (token j of request i sits at
`seq_lens[i] - q_len_i + j`); anything else (-1 padding, and on the GPU without TILELLM_DEBUG=1
any other negative or future position, which the checks reject where they read values) is
skipped. A token with no valid entry outputs zeros. Entries are a list: the indexer returns a
set, and a duplicate would count twice.
"""

from __future__ import annotations

import torch

from tilellm.kernels import validation as v
from tilellm.kernels.mla import _check_common

# ----------------------------------------------------------------------------------------------
# Argument checks (shared with the PyTorch twin, tilellm.kernels.reference.sparse_mla)
# ----------------------------------------------------------------------------------------------


def check_sparse_mla(
    name, q, kv_cache, block_table, cu_seqlens_q, topk_indices, seq_lens, kv_lora_rank, scale
):
    """Arguments of `sparse_mla_attention`: MLA's checks of q against the latent cache, plus
    topk_indices [T, K] int32 (one row per query token). Where values are read (CPU tensors, or
    TILELLM_DEBUG=1): entries must be -1 or a position 0..own position of the token's request."""
    v._check_rank(name, "q", q, 3, "[T, H, kv_lora_rank + rope_dim]")
    v._check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    v._check_rank(name, "topk_indices", topk_indices, 2, "[T, K]")
    _check_common(
        name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale,
        {"cu_seqlens_q": cu_seqlens_q, "topk_indices": topk_indices},
    )  # fmt: skip
    batch = block_table.shape[0]
    T = q.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"{name}: cu_seqlens_q must have B+1 = {batch + 1} entries (block_table has B = {batch} rows), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (block_table has {batch} rows), got {seq_lens.shape[0]}"
        )
    if topk_indices.shape[0] != T:
        raise ValueError(
            f"{name}: topk_indices [T, K] must have one row per query token (T = {T}), "
            f"got {topk_indices.shape[0]} rows"
        )
    if not v.deep_checks_enabled(q):
        return
    q_lens = v._check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, T)
    kv_lens = v._check_seq_lens_values(name, seq_lens, q_lens)
    v._check_block_table_values(name, block_table, kv_lens, kv_cache.shape[0], kv_cache.shape[1])
    _check_topk_values(name, topk_indices, q_lens, kv_lens)


def _check_topk_values(name, topk_indices, q_lens, kv_lens) -> None:
    """Every entry -1 or a causal position of its token (host values)."""
    topk = topk_indices.cpu().long()
    if topk.numel() == 0:
        return
    bad = topk < -1
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_indices[{t}, {j}] = {int(topk[t, j])} is negative (only -1 marks an empty entry)"
        )
    batch = q_lens.shape[0]
    T = topk.shape[0]
    req = torch.repeat_interleave(torch.arange(batch), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    own_pos = kv_lens[req] - q_lens[req] + (torch.arange(T) - starts[req])
    bad = topk > own_pos[:, None]
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_indices[{t}, {j}] = {int(topk[t, j])} is a future position: token {t} "
            f"(request {int(req[t])}) sits at position {int(own_pos[t])} and may only attend to 0..{int(own_pos[t])}"
        )
