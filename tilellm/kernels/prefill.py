"""Packed varlen causal prefill: one launch for every request of a step.

Grid = (query heads, requests, query tiles). A program loads its request's start and length
from `cu_seqlens`, exits at once when its query tile lies past the request's end, and walks the
request's key tiles only up to the diagonal:

    key tiles:   0 .. full_end          full_end .. diag_end         diag_end ..
                 wholly below diagonal  crossing the diagonal        future
                 no mask                causal mask in registers      never visited

The causal mask compares positions local to the request (so a request never sees another's
tokens), softmax is computed online (running max `m_i`, running sum `l_i`, rescaled `acc`) in
base 2 with the softmax scale folded into one multiplier, and nothing of the score matrix
reaches memory. Query tiles are issued longest-first (the last tiles of long requests cost
most), and a query head reads its KV head (`head // group`) directly: GQA never copies K/V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation
from tilellm.kernels.config import prefill_config

LOG2_E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2_E)


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    stride_kt,
    stride_vt,
    offs_m,
    offs_n,
    seq_len,
    n_start,
    n_end,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Online softmax over key tiles [n_start, n_end), keys of one request (local positions).

    MASKED tiles build the causal mask `key <= query` (and `key < seq_len`) in registers;
    the others are wholly visible and run without any elementwise mask.
    """
    for n in tl.range(n_start, n_end, BLOCK_N):
        # -- load K [BLOCK_N, D] and compute scores Q K^T --
        if MASKED:
            key_ok = (n + offs_n) < seq_len
            k = tl.load(k_ptrs + n * stride_kt, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs + n * stride_kt)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            visible = key_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= (n + offs_n)[None, :])
            qk = tl.where(visible, qk, float("-inf"))
        # -- online softmax, base 2, scale folded in --
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- accumulate P @ V --
        if MASKED:
            v = tl.load(v_ptrs + n * stride_vt, mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs + n * stride_vt)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    O,
    cu_seqlens,
    stats,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    RECORD_STATS: tl.constexpr,
):
    head = tl.program_id(0)
    req = tl.program_id(1)
    # Longest-first: the last query tiles (most key tiles under the diagonal) are issued first.
    m_tile = tl.num_programs(2) - 1 - tl.program_id(2)

    seq_start = tl.load(cu_seqlens + req)
    seq_len = tl.load(cu_seqlens + req + 1) - seq_start
    m_start = m_tile * BLOCK_M
    if m_start >= seq_len:
        return  # this request has no queries in this tile

    kv_head = head // GROUP
    offs_m = m_start + tl.arange(0, BLOCK_M)  # local query positions
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len

    q_ptrs = Q + (seq_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    base = seq_start.to(tl.int64)
    k_ptrs = K + (base + offs_n)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = V + (base + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if CAUSAL:
        # Tiles ending at or before the first query of this tile are wholly visible.
        full_end = (m_start + 1) // BLOCK_N * BLOCK_N
        diag_end = tl.minimum(m_start + BLOCK_M, seq_len)
    else:
        full_end = seq_len // BLOCK_N * BLOCK_N
        diag_end = seq_len
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kt,
        stride_vt,
        offs_m,
        offs_n,
        seq_len,
        0,
        full_end,
        qk_scale,
        BLOCK_N,
        False,
        CAUSAL,
    )
    acc, l_i, m_i = _attend_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        stride_kt,
        stride_vt,
        offs_m,
        offs_n,
        seq_len,
        full_end,
        diag_end,
        qk_scale,
        BLOCK_N,
        True,
        CAUSAL,
    )

    acc = acc / l_i[:, None]
    o_ptrs = O + (seq_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])

    if RECORD_STATS:
        # The kernel's own account of its tiles: [full, diagonal] per program.
        pid = (req * tl.num_programs(0) + head) * tl.num_programs(2) + m_tile
        tl.store(stats + pid * 2, full_end // BLOCK_N)
        tl.store(stats + pid * 2 + 1, tl.cdiv(diag_end - full_end, BLOCK_N))


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
    """Causal attention of packed requests over their own K/V (no cache).

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (Hq % Hkv == 0), same dtype and device.
        cu_seqlens: [B+1] int32 request boundaries in the packed rows.
        max_seqlen: the longest request (sizes the grid's query-tile axis).
        causal: mask future keys (local positions); False gives full attention per request.
        scale: softmax scale, default D ** -0.5.
        out: optional [T, Hq, D] output buffer.
    Returns:
        o: [T, Hq, D] in q.dtype.
    """
    validation.check_prefill("prefill_attention", q, k, v, cu_seqlens, max_seqlen)
    o = _output(q, out, "prefill_attention")
    _launch(q, k, v, o, cu_seqlens, max_seqlen, causal, validation.resolve_scale(scale, q.shape[-1]))
    return o


def prefill_tile_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
) -> torch.Tensor:
    """Run the kernel and return its own tile counts: [B, Hq, num_m_tiles, 2] (full, diagonal).

    Programs whose tile lies past their request's end record nothing (zeros).
    """
    validation.check_prefill("prefill_attention", q, k, v, cu_seqlens, max_seqlen)
    o = torch.empty_like(q)
    cfg = prefill_config(q.shape[-1], q.dtype)
    num_m = triton.cdiv(max(max_seqlen, 1), cfg.block_m)
    stats = torch.zeros((cu_seqlens.numel() - 1) * q.shape[1] * num_m * 2, dtype=torch.int32, device=q.device)
    _launch(q, k, v, o, cu_seqlens, max_seqlen, causal, validation.resolve_scale(None, q.shape[-1]), stats)
    return stats.view(cu_seqlens.numel() - 1, q.shape[1], num_m, 2)


def _output(q: torch.Tensor, out: torch.Tensor | None, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    validation.check_out(name, out, q.shape, q.dtype, q.device)
    return out


def _launch(q, k, v, o, cu_seqlens, max_seqlen, causal, scale, stats=None) -> None:
    T, Hq, D = q.shape
    batch = cu_seqlens.numel() - 1
    if T == 0 or batch == 0:
        return
    cfg = prefill_config(D, q.dtype)
    grid = (Hq, batch, triton.cdiv(max(max_seqlen, 1), cfg.block_m))
    _prefill_kernel[grid](
        q,
        k,
        v,
        o,
        cu_seqlens,
        stats if stats is not None else cu_seqlens,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        o.stride(0),
        o.stride(1),
        GROUP=Hq // k.shape[1],
        HEAD_DIM=D,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=causal,
        RECORD_STATS=stats is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
