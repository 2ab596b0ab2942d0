"""Pure-PyTorch twins of the Triton kernels in `tilellm.kernels`, with the same signatures.

This package holds every twin: the attention kernels here, the fused element-wise ops in
`tilellm.kernels.reference.fused`, the Gumbel sampler's next to its kernel (`kernels.sampling`).

They are the tests' oracle and the engine's CPU attention backend, so they stay readable (one
loop over requests, the K/V of a request gathered through its block table) and avoid loops over
tokens. Scores, softmax and accumulation run in fp32; outputs come back in `q.dtype`. Inputs are
never modified (except the caches that `store_kvcache` and `concat_and_cache_mla` write), and
every function validates its arguments with `tilellm.kernels.validation` exactly as its Triton
twin does.

FP8 caches (float8_e4m3fn, with `k_scale` / `v_scale` [1] float32 tensors, None = 1.0): the store
quantizes (`tilellm.kernels.fp8.quantize_fp8`), and attention dequantizes the gathered rows
(`stored * scale` in fp32) before computing exactly as for a 16/32-bit cache.

Positions: the j-th new token of request i sits at absolute position `seq_lens[i] - q_len_i + j`
and attends to keys `0..pos`. GQA: query head h reads KV head `h // (Hq // Hkv)`.
"""

from __future__ import annotations

import torch

from tilellm.kernels import validation
from tilellm.kernels.fp8 import dequantized_rows, is_fp8, quantize_fp8

# Upper bound on the fp32 score elements materialised at once (about 256 MiB); longer requests
# are processed in chunks of query rows.
_MAX_SCORE_ELEMENTS = 1 << 26


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes token t's K/V ([T, Hkv, D]) into slot `slot_mapping[t]` of the caches; -1 skips the
    token. v and v_cache None: k alone into k_cache (MLA's latent rows). FP8 caches store
    k / k_scale and v / v_scale."""
    validation.check_store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = _to_cache(k[keep], k_cache, k_scale)
    if v is not None:
        v_cache[blocks, offsets] = _to_cache(v[keep], v_cache, v_scale)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """MLA's rows [kv_c | k_pe] ([T, L] and [T, Dr]) into kv_cache [num_blocks, block_size, 1,
    L + Dr]: `store_kvcache` of their concatenation."""
    validation.check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)
    rows = torch.cat((kv_c, k_pe), dim=-1).unsqueeze(1)
    store_kvcache(rows, None, kv_cache, None, slot_mapping, k_scale=kv_scale)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed requests over their own K/V: q [T, Hq, Dqk], k [T, Hkv, Dqk],
    v [T, Hkv, Dv] -> o [T, Hq, Dv]; the scale defaults to Dqk ** -0.5."""
    name = "prefill_attention"
    validation.check_prefill(name, q, k, v, cu_seqlens, max_seqlen)
    scale = validation.resolve_scale(scale, q.shape[-1])
    o = validation.prefill_output(name, q, v, out)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        positions = torch.arange(end - start, device=q.device)
        o[start:end] = _attend(q[start:end], k[start:end], v[start:end], positions if causal else None, scale)
    return o


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens q [T, Hq, D] over each request's paged K/V (prefix + new tokens).

    `num_splits` and `max_seqlen_k` (the Triton version's split-plan hints) are checked and
    otherwise ignored: the reference never splits.
    """
    name = "paged_attention"
    validation.check_paged(name, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q)
    validation.check_kv_scales(name, q, k_cache, v_cache, k_scale, v_scale)
    validation.check_split_hints(name, num_splits, max_seqlen_k, seq_lens)
    scale = validation.resolve_scale(scale, q.shape[-1])
    o = validation.output_like(name, q, out)
    caches = (k_cache, v_cache, k_scale, v_scale)
    _paged(q, caches, block_table, cu_seqlens_q.tolist(), seq_lens.tolist(), scale, o)
    return o


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request, q [B, Hq, D], at position `seq_lens[i] - 1` (the q_len = 1 case of paged)."""
    name = "decode_attention"
    validation.check_decode(name, q, k_cache, v_cache, block_table, seq_lens)
    validation.check_kv_scales(name, q, k_cache, v_cache, k_scale, v_scale)
    validation.check_split_hints(name, num_splits, max_seqlen_k, seq_lens)
    scale = validation.resolve_scale(scale, q.shape[-1])
    o = validation.output_like(name, q, out)
    caches = (k_cache, v_cache, k_scale, v_scale)
    _paged(q, caches, block_table, list(range(q.shape[0] + 1)), seq_lens.tolist(), scale, o)
    return o


def cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_len: torch.Tensor,
    *,
    scale: float | None = None,
    prefix_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode of requests sharing their first `prefix_len` keys: mathematically plain decode."""
    name = "cascade_decode_attention"
    validation.check_decode(name, q, k_cache, v_cache, block_table, seq_lens)
    validation.check_kv_scales(name, q, k_cache, v_cache, k_scale, v_scale)
    validation.check_cascade_prefix(name, q, block_table, seq_lens, prefix_len, k_cache.shape[1])
    scale = validation.resolve_scale(scale, q.shape[-1])
    o = validation.output_like(name, q, out)
    caches = (k_cache, v_cache, k_scale, v_scale)
    _paged(q, caches, block_table, list(range(q.shape[0] + 1)), seq_lens.tolist(), scale, o)
    return o


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token attends only to its own top-k logical positions `topk_indices[t]` (shared by its heads).

    Entries equal to -1 are ignored; a token without any valid entry gets a zero output. A position
    listed twice counts twice (the kernel treats the K entries as a list, not a set).
    """
    name = "sparse_attention"
    validation.check_sparse(name, q, k_cache, v_cache, block_table, cu_seqlens_q, topk_indices, seq_lens)
    validation.check_kv_scales(name, q, k_cache, v_cache, k_scale, v_scale)
    scale = validation.resolve_scale(scale, q.shape[-1])
    o = validation.output_like(name, q, out)
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    bounds = cu_seqlens_q.tolist()
    num_k = max(topk_indices.shape[1], 1)
    rows_per_chunk = max(1, _MAX_SCORE_ELEMENTS // (num_k * max(Hq, D * Hkv)))
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        for lo in range(start, end, rows_per_chunk):
            hi = min(end, lo + rows_per_chunk)
            idx = topk_indices[lo:hi].long()  # [n, K]
            valid = idx >= 0
            pos = idx.clamp(min=0)
            blocks = block_table[i].long()[pos // block_size]
            keys = dequantized_rows(k_cache[blocks, pos % block_size], k_scale)  # [n, K, Hkv, D] fp32
            values = dequantized_rows(v_cache[blocks, pos % block_size], v_scale)
            qg = q[lo:hi].float().view(hi - lo, Hkv, Hq // Hkv, D)
            scores = torch.einsum("nhgd,nkhd->nhgk", qg, keys) * scale
            probs = _masked_softmax(scores, valid[:, None, None, :])
            o[lo:hi] = torch.einsum("nhgk,nkhd->nhgd", probs, values).reshape(hi - lo, Hq, D).to(q.dtype)
    return o


def merge_attention_states(
    o_parts: torch.Tensor, lse_parts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines S partial attentions over disjoint key sets: o_parts [S, T, H, D], lse_parts [S, T, H].

        lse = logsumexp_s(lse_s),    o = sum_s exp(lse_s - lse) * o_s

    Parts with lse = -inf (no keys) contribute nothing, whatever their o; when every part is
    empty, o = 0 and lse = -inf. Returns o in o_parts.dtype and lse in float32.
    """
    validation.check_merge(o_parts, lse_parts)
    lse = torch.logsumexp(lse_parts, dim=0)  # [T, H]; -inf where every part is -inf
    empty = lse_parts == float("-inf")
    weights = torch.exp(lse_parts - torch.where(torch.isinf(lse), 0.0, lse)).masked_fill(empty, 0.0)
    parts = o_parts.float().masked_fill(empty[..., None], 0.0)
    o = (weights[..., None] * parts).sum(dim=0)
    return o.to(o_parts.dtype), lse


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows as the cache stores them: e4m3 of x / scale for an FP8 cache, else x unchanged."""
    return quantize_fp8(x, scale if scale is not None else 1.0) if is_fp8(cache) else x


def _paged(q, caches, block_table, bounds, kv_lens, scale, o) -> None:
    """Per request: gather its K/V through the block table (`caches` = (k_cache, v_cache,
    k_scale, v_scale)), then causal attention of its new tokens."""
    k_cache, v_cache, k_scale, v_scale = caches
    block_size = k_cache.shape[1]
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        kv_len = kv_lens[i]
        positions = torch.arange(kv_len, device=q.device)
        blocks = block_table[i].long()[positions // block_size]
        keys = dequantized_rows(k_cache[blocks, positions % block_size], k_scale)  # [kv_len, Hkv, D]
        values = dequantized_rows(v_cache[blocks, positions % block_size], v_scale)
        q_positions = positions[kv_len - (end - start) :]
        o[start:end] = _attend(q[start:end], keys, values, q_positions, scale)


def _attend(q, k, v, q_positions, scale) -> torch.Tensor:
    """q [M, Hq, D] over k [N, Hkv, D], v [N, Hkv, Dv] -> [M, Hq, Dv]; row m sees keys
    0..q_positions[m] (all keys if None)."""
    M, Hq, D = q.shape
    N, Hkv, _ = k.shape
    Dv = v.shape[-1]
    group = Hq // Hkv
    k32, v32 = k.float(), v.float()
    out = torch.empty(M, Hq, Dv, dtype=q.dtype, device=q.device)
    rows = max(1, _MAX_SCORE_ELEMENTS // max(1, N * Hq))
    for lo in range(0, M, rows):
        hi = min(M, lo + rows)
        qg = q[lo:hi].float().view(hi - lo, Hkv, group, D)
        scores = torch.einsum("mhgd,nhd->hgmn", qg, k32) * scale  # [Hkv, G, m, N]
        if q_positions is None:
            visible = torch.ones(hi - lo, N, dtype=torch.bool, device=q.device)
        else:
            visible = torch.arange(N, device=q.device)[None, :] <= q_positions[lo:hi, None]
        probs = _masked_softmax(scores, visible)
        out[lo:hi] = torch.einsum("hgmn,nhd->mhgd", probs, v32).reshape(hi - lo, Hq, Dv).to(q.dtype)
    return out


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of fp32 `scores` restricted to `visible`; rows seeing nothing give 0."""
    if scores.shape[-1] == 0:
        return scores
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), 0.0, row_max)
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    return p / torch.where(denom == 0, 1.0, denom)


# The twins of the FP8 GEMM, MLA, MoE, indexer and sparse MLA kernels live beside these (one module each),
# re-exported here so that this package holds every twin under its kernel's name.
from tilellm.kernels.reference.fp8_gemm import per_token_group_quant_fp8 as per_token_group_quant_fp8  # noqa: E402
from tilellm.kernels.reference.fp8_gemm import w8a8_block_fp8_linear as w8a8_block_fp8_linear  # noqa: E402
from tilellm.kernels.reference.fp8_gemm import w8a8_block_fp8_matmul as w8a8_block_fp8_matmul  # noqa: E402
from tilellm.kernels.reference.indexer import index_topk as index_topk  # noqa: E402
from tilellm.kernels.reference.indexer import store_index_keys as store_index_keys  # noqa: E402
from tilellm.kernels.reference.mla import mla_decode_attention as mla_decode_attention  # noqa: E402
from tilellm.kernels.reference.mla import mla_paged_attention as mla_paged_attention  # noqa: E402
from tilellm.kernels.reference.moe import fused_moe as fused_moe  # noqa: E402
from tilellm.kernels.reference.sparse_mla import sparse_mla_attention as sparse_mla_attention  # noqa: E402
