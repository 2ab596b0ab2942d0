"""Sparse top-k attention through the block table (DeepSeek-V3.2 style selection).

Each query token attends only to the K logical positions listed in its row of `topk_indices`
(shared by all its heads; -1 = empty). A program owns one token and one KV head with its group
of query heads as tile rows; it gathers the selected keys' rows page by page through the
request's block table and runs the same online softmax as the dense kernels over them. At 64k
context a 2048-key selection reads 1/32 of the cache that dense decode reads. FP8 caches are
widened to q's dtype in registers, with k_scale folded into the scores and v_scale into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation
from tilellm.kernels.config import LOG2_E, dot_precision, interpreting, next_power_of_2
from tilellm.kernels.fp8 import is_fp8, unit_scale
from tilellm.kernels.launch import FastLaunch


@triton.jit
def _sparse_kernel(
    Q,
    K_cache,
    V_cache,
    O,
    k_scale,
    v_scale,
    block_table,
    cu_seqlens_q,
    seq_lens,
    token_request,
    topk,
    qk_scale,
    num_indices,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_tk,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHECK_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    req = tl.load(token_request + tok)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(
        Q + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    if CHECK_CAUSAL:
        # Position of this token: its request's context plus its index among the new tokens.
        q_start = tl.load(cu_seqlens_q + req)
        q_len = tl.load(cu_seqlens_q + req + 1) - q_start
        pos = tl.load(seq_lens + req) - q_len + (tok - q_start)

    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale)
    bt_row = block_table + req.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n in tl.range(0, num_indices, BLOCK_N):
        # -- gather the selected keys of this chunk through the block table --
        in_row = (n + offs_n) < num_indices
        k_pos = tl.load(topk + tok * stride_tk + n + offs_n, mask=in_row, other=-1)
        key_ok = k_pos >= 0
        if CHECK_CAUSAL:
            key_ok = key_ok & (k_pos <= pos)
        block = tl.load(bt_row + k_pos // PAGE, mask=key_ok, other=0)
        row_off = block.to(tl.int64) * stride_cb + (k_pos % PAGE) * stride_cs + kv_head * stride_ch
        k = tl.load(K_cache + row_off[None, :] + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        qk = tl.where(key_ok[None, :], tl.dot(q, k.to(q.dtype), input_precision=PRECISION), float("-inf"))
        # -- online softmax (a chunk may hold no valid index: guard -inf - -inf) --
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ij = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + row_off[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_ij
    if KV_FP8:
        acc = acc * tl.load(v_scale)
    # A token with no valid index outputs zeros.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        O + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(O.dtype.element_ty),
        mask=row_ok[:, None],
    )


_sparse_launch = FastLaunch(_sparse_kernel)


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
    """Attention of each new token over its own top-k selected positions.

    Args:
        q: [T, Hq, D] new tokens, packed.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        block_table: [B, max_blocks_per_seq] int32.
        cu_seqlens_q: [B+1] int32 boundaries of each request's new tokens.
        topk_indices: [T, K] int32 logical positions (shared by the token's heads), -1 = empty.
        seq_lens: optional [B] int32; when given, indices past a token's own position are invalid
            (validation raises on CPU / TILELLM_DEBUG=1; the kernel also masks them).
        k_scale, v_scale: FP8 caches only: [1] float32 dequantization scales (None = 1.0).
    Returns:
        o: [T, Hq, D] in q.dtype; a token with no valid index gets zeros.
    """
    validation.check_sparse(
        "sparse_attention", q, k_cache, v_cache, block_table, cu_seqlens_q, topk_indices, seq_lens
    )
    validation.check_kv_scales("sparse_attention", q, k_cache, v_cache, k_scale, v_scale)
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    o = validation.output_like("sparse_attention", q, out)
    if T == 0:
        return o
    group = Hq // Hkv
    # Request of each packed token, on the device (no host sync).
    positions = torch.arange(T, device=q.device, dtype=cu_seqlens_q.dtype)
    token_request = (torch.searchsorted(cu_seqlens_q, positions, right=True) - 1).to(torch.int32)
    block_n = 16 if interpreting() else 64
    kv_fp8 = is_fp8(k_cache)
    one = unit_scale(q.device) if kv_fp8 else cu_seqlens_q  # unread unless KV_FP8
    _sparse_launch[(T, Hkv)](
        q,
        k_cache,
        v_cache,
        o,
        k_scale if kv_fp8 and k_scale is not None else one,
        v_scale if kv_fp8 and v_scale is not None else one,
        block_table,
        cu_seqlens_q,
        seq_lens if seq_lens is not None else cu_seqlens_q,
        token_request,
        topk_indices,
        validation.resolve_scale(scale, D) * LOG2_E,
        topk_indices.shape[1],
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        topk_indices.stride(0),
        GROUP=group,
        HEAD_DIM=D,
        PAGE=page,
        BLOCK_M=max(16, next_power_of_2(group)),
        BLOCK_N=block_n,
        CHECK_CAUSAL=seq_lens is not None,
        PRECISION=dot_precision(q.dtype),
        KV_FP8=kv_fp8,
        num_warps=4,
        num_stages=1 if interpreting() else 3,
    )
    return o
