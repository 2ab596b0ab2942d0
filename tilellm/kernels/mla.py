"""DeepSeek's multi-head latent attention (MLA) over a paged latent cache, in the absorbed form.

(The Triton kernels follow in the next commit; this holds the argument checks the PyTorch twin
`tilellm.kernels.reference.mla` shares.)
"""

from __future__ import annotations

import numbers

import torch

from tilellm.kernels import validation as v

MAX_KV_LORA_RANK = 1024  # one program holds [rows, kv_lora_rank] fp32 accumulators
MAX_ROPE_DIM = 256


def check_mla_paged(
    name, q, kv_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, kv_lora_rank, scale
):
    """Arguments of `mla_paged_attention`: q [T, H, kv_lora_rank + rope_dim] against the latent cache."""
    v._check_rank(name, "q", q, 3, "[T, H, kv_lora_rank + rope_dim]")
    v._check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    _check_common(
        name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, {"cu_seqlens_q": cu_seqlens_q}
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
    v._check_max_seqlen_type(name, "max_seqlen_q", max_seqlen_q)
    if not v.deep_checks_enabled(q):
        return
    q_lens = v._check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    v._check_max_seqlen_value(name, "max_seqlen_q", max_seqlen_q, q_lens)
    kv_lens = v._check_seq_lens_values(name, seq_lens, q_lens)
    v._check_block_table_values(name, block_table, kv_lens, kv_cache.shape[0], kv_cache.shape[1])


def check_mla_decode(name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale):
    """Arguments of `mla_decode_attention`: q [B, H, kv_lora_rank + rope_dim], one token per request."""
    v._check_rank(name, "q", q, 3, "[B, H, kv_lora_rank + rope_dim]")
    _check_common(name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, {})
    batch = q.shape[0]
    if block_table.shape[0] != batch:
        raise ValueError(
            f"{name}: block_table must have B = {batch} rows (one per query of q [B, H, D]), got {block_table.shape[0]}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (one per query of q [B, H, D]), got {seq_lens.shape[0]}"
        )
    if not v.deep_checks_enabled(q):
        return
    kv_lens = v._check_seq_lens_values(name, seq_lens, torch.ones(batch, dtype=torch.int64))
    v._check_block_table_values(name, block_table, kv_lens, kv_cache.shape[0], kv_cache.shape[1])


def check_mla_hints(name, num_splits, max_seqlen_k, seq_lens) -> None:
    """`num_splits` (int, `MlaPlan` or None) and `max_seqlen_k` (>= every seq_lens entry)."""
    v.check_split_hints(name, num_splits, max_seqlen_k, seq_lens)


def mla_output(name, q, kv_lora_rank, out) -> torch.Tensor:
    """The output buffer [T, H, kv_lora_rank] in q.dtype: `out` once checked, else a new one."""
    shape = (q.shape[0], q.shape[1], kv_lora_rank)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    v.check_out(name, out, shape, q.dtype, q.device)
    return out


def _check_common(name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, extra_indices) -> None:
    v._check_rank(name, "kv_cache", kv_cache, 4, "[num_blocks, block_size, 1, kv_lora_rank + rope_dim]")
    v._check_rank(name, "block_table", block_table, 2, "[B, max_blocks_per_seq]")
    v._check_rank(name, "seq_lens", seq_lens, 1, "[B]")
    v._check_float(name, {"q": q, "kv_cache": kv_cache})
    indices = {"block_table": block_table, **extra_indices, "seq_lens": seq_lens}
    v._check_int32(name, indices)
    v._check_device(name, {"q": q, "kv_cache": kv_cache, **indices})
    _check_rank_value(name, kv_lora_rank)
    _check_scale(name, scale)
    width = q.shape[2]
    rope_dim = width - kv_lora_rank
    if not 1 <= rope_dim <= MAX_ROPE_DIM:
        raise ValueError(
            f"{name}: q's last dim ({width}) must be kv_lora_rank + rope_dim with kv_lora_rank = {kv_lora_rank} "
            f"and 1 <= rope_dim <= {MAX_ROPE_DIM}, got rope_dim = {rope_dim}"
        )
    if kv_cache.shape[2] != 1:
        raise ValueError(
            f"{name}: kv_cache must have one KV head (dim 2 of [num_blocks, block_size, 1, D]: the latent row "
            f"all query heads share), got {kv_cache.shape[2]}"
        )
    if kv_cache.shape[3] != width:
        raise ValueError(
            f"{name}: kv_cache's last dim ({kv_cache.shape[3]}) must equal q's kv_lora_rank + rope_dim = {width}"
        )
    if kv_cache.shape[1] < 1:
        raise ValueError(f"{name}: block_size (kv_cache dim 1) must be >= 1, got {kv_cache.shape[1]}")
    if q.shape[1] < 1:
        raise ValueError(f"{name}: q must have at least one head, got shape {tuple(q.shape)}")
    v._check_last_dim_stride(name, {"q": q})
    v._check_contiguous(name, {"kv_cache": kv_cache, **indices})


def _check_rank_value(name, kv_lora_rank) -> None:
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, numbers.Integral):
        raise ValueError(f"{name}: kv_lora_rank must be a Python int, got {type(kv_lora_rank).__name__}")
    if not 1 <= kv_lora_rank <= MAX_KV_LORA_RANK:
        raise ValueError(f"{name}: kv_lora_rank must be in 1..{MAX_KV_LORA_RANK}, got {kv_lora_rank}")


def _check_scale(name, scale) -> None:
    if scale is None:
        raise ValueError(
            f"{name}: scale is required (MLA's is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, "
            "which the absorbed width does not give)"
        )
    try:
        v.resolve_scale(scale, 1)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
