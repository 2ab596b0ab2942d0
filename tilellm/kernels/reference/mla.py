"""PyTorch twin of `tilellm.kernels.mla`: multi-head latent attention over a paged latent cache.

The absorbed form (DeepSeek-V2/V3). The cache holds one row per token, `[c, k_pe]`: the
normalised latent `c` (kv_lora_rank values) and the rotated shared key `k_pe` (rope_dim
values), kv_cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim]. Query head h arrives
already absorbed, `q_h = [q_nope_h @ W_UK_h, q_pe_h]`, so for key row r

    score_h(r) = scale * q_h . row_r          (all kv_lora_rank + rope_dim values)
    o_h        = softmax_r(score_h) @ c       (the values are each row's first kv_lora_rank)

and `o_h @ W_UV_h` is the non-absorbed head output (tests/kernels/test_mla.py checks that
algebra against attention over up-projected keys and values). Every head reads the same row:
MQA with one KV head.

Positions as in `paged_attention`: the j-th new token of request i sits at
`seq_lens[i] - q_len_i + j` and attends to keys `0..pos`. One loop over requests, rows
gathered through the block table, fp32 scores / softmax / accumulation, outputs in q.dtype.
An FP8 (e4m3) cache's gathered rows are dequantized first (`stored.float() * kv_scale`), then
used as above. Checks are the Triton twin's (`tilellm.kernels.mla.check_mla_*`); `num_splits` and
`max_seqlen_k` are checked and otherwise ignored (the reference never splits).
"""

from __future__ import annotations

import torch

from tilellm.kernels.fp8 import dequantized_rows
from tilellm.kernels.mla import check_mla_decode, check_mla_hints, check_mla_paged, mla_output

# Upper bound on the fp32 score elements materialised at once (about 256 MiB); requests with
# more new tokens x heads x keys are processed in chunks of query tokens.
_MAX_SCORE_ELEMENTS = 1 << 26


def mla_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits=None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal MLA of new tokens q [T, H, kv_lora_rank + rope_dim] over each request's latent rows
    (kv_cache in q.dtype, or FP8 with its float32 one-element `kv_scale`, None = 1.0).

    Returns o [T, H, kv_lora_rank] in q.dtype.
    """
    name = "mla_paged_attention"
    check_mla_paged(
        name, q, kv_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, kv_lora_rank, scale, kv_scale
    )
    check_mla_hints(name, num_splits, max_seqlen_k, seq_lens)
    o = mla_output(name, q, kv_lora_rank, out)
    bounds = cu_seqlens_q.tolist()
    _mla(q, kv_cache, kv_scale, block_table, bounds, seq_lens.tolist(), kv_lora_rank, float(scale), o)
    return o


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    num_splits=None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request, q [B, H, kv_lora_rank + rope_dim] at `seq_lens[i] - 1` -> [B, H, kv_lora_rank]."""
    name = "mla_decode_attention"
    check_mla_decode(name, q, kv_cache, block_table, seq_lens, kv_lora_rank, scale, kv_scale)
    check_mla_hints(name, num_splits, max_seqlen_k, seq_lens)
    o = mla_output(name, q, kv_lora_rank, out)
    bounds = list(range(q.shape[0] + 1))
    _mla(q, kv_cache, kv_scale, block_table, bounds, seq_lens.tolist(), kv_lora_rank, float(scale), o)
    return o


def _mla(q, kv_cache, kv_scale, block_table, bounds, kv_lens, kv_lora_rank, scale, o) -> None:
    """Per request: gather its latent rows through the block table, then causal attention of its new tokens."""
    block_size = kv_cache.shape[1]
    H = q.shape[1]
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        kv_len = kv_lens[i]
        positions = torch.arange(kv_len, device=q.device)
        blocks = block_table[i].long()[positions // block_size]
        rows = dequantized_rows(kv_cache[blocks, positions % block_size, 0], kv_scale)  # [N, lora + rope]
        values = rows[:, :kv_lora_rank]  # [N, kv_lora_rank]
        q_positions = positions[kv_len - (end - start) :]  # [M]
        chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, kv_len * H))
        for lo in range(start, end, chunk):
            hi = min(end, lo + chunk)
            scores = torch.einsum("mhd,nd->mhn", q[lo:hi].float(), rows) * scale  # [m, H, N]
            visible = positions[None, :] <= q_positions[lo - start : hi - start, None]  # [m, N]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # each token sees at least its own key
            o[lo:hi] = torch.einsum("mhn,nc->mhc", probs, values).to(o.dtype)
