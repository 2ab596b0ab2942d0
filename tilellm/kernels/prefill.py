"""Packed varlen causal prefill: one launch for every request of a step.

Grid = (query tiles, query heads, requests). A program loads its request's start and length
from `cu_seqlens`, exits at once when its query tile lies past the request's end, and walks the
request's key tiles only up to the diagonal:

    key tiles:   0 .. full_end          full_end .. diag_end         diag_end ..
                 wholly below diagonal  crossing the diagonal        future
                 no mask                causal mask in registers      never visited

The causal mask compares positions local to the request (so a request never sees another's
tokens), softmax is computed online (running max `m_i`, running sum `l_i`, rescaled `acc`) in
base 2 with the softmax scale folded into one multiplier, and nothing of the score matrix
reaches memory. A query head reads its KV head (`head // group`) directly: GQA never copies K/V.

Head dims: q and k share `Dqk`, v has its own `Dv` (DeepSeek MLA's up-projected prefill: Dqk = 192
= 128 nope + 64 rope, Dv = 128); both multiples of 8 in 16..256. A tile's dims must be powers of
two, so the kernel covers `Dqk` with two column blocks, `QK_MAIN` (the largest power of two <= Dqk)
and `QK_TAIL` (the rest rounded up to a power of two >= 16, or none), and computes the scores as
two dots into one accumulator: Q[:, :main] K[:, :main]^T + Q[:, main:] K[:, main:]^T. For 192
that is 128 + 64 with nothing padded, where padding to 256 would load, hold and multiply a third
more of Q and K (a fifth more tensor-core work per key tile, counting P V). A tail that is padded
(24 = 16 + 8 in a 16-wide block) reads the next head's columns (or zeros past the row): they are
zeroed in registers, in Q once per program and in each K tile. `Dv` is padded to one power-of-two
block (`V_BLOCK`); its extra columns only reach accumulator columns that are never stored.

Launch order: query tiles fastest, longest-first (the last tiles, with the most keys under the
diagonal, start first), then heads (the heads of one KV group are neighbours), then requests. The
programs running at any moment then read the K/V of one or a few heads, which stays in L2
(H200: P1 466 TFLOP/s in this order, 420 with heads fastest).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tilellm.kernels import validation
from tilellm.kernels.config import (
    LOG2_E,
    cdiv,
    dot_precision,
    launch_gluon,
    next_power_of_2,
    overridden,
    prefill_config,
)
from tilellm.kernels.launch import DescriptorTemplate, FastLaunch, LaunchKey


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_tail, k_desc, k_tail_desc, v_desc,
    kv_row0, k_col, v_col, offs_m, offs_n, seq_len, n_start, n_end, qk_scale,
    QK_DIM: tl.constexpr, QK_MAIN: tl.constexpr, QK_TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over key tiles [n_start, n_end) of one request (local key positions).

    MASKED tiles build the causal mask `key <= query` (and `key < seq_len`) in registers; the
    others are wholly visible and run without any elementwise mask. Rows a tile loads past the
    request's end belong to the next request (or are zero-filled past the tensor): they are
    always masked out, never used.
    """
    for n in tl.range(n_start, n_end, BLOCK_N):
        # -- scores: Q [BLOCK_M, Dqk] @ K^T [Dqk, BLOCK_N], the main columns then the tail's --
        k = k_desc.load([kv_row0 + n, k_col])
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if QK_TAIL > 0:
            k_tail = k_tail_desc.load([kv_row0 + n, k_col + QK_MAIN])
            if QK_MAIN + QK_TAIL > QK_DIM:  # padded: the block's last columns are not this head's
                k_tail = tl.where((tl.arange(0, QK_TAIL) < QK_DIM - QK_MAIN)[None, :], k_tail, 0.0)
            qk = tl.dot(q_tail, tl.trans(k_tail), qk, input_precision=PRECISION)
        if MASKED:
            visible = ((n + offs_n) < seq_len)[None, :]
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= (n + offs_n)[None, :])
            qk = tl.where(visible, qk, float("-inf"))
        # -- online softmax, base 2, softmax scale folded into qk_scale --
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- accumulate P @ V --
        v = v_desc.load([kv_row0 + n, v_col])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _store_rows(
    O, acc, l_i, seq_start, offs_m, seq_len, head, stride_ot, stride_oh,
    V_DIM: tl.constexpr, V_BLOCK: tl.constexpr,
):  # fmt: skip
    """Normalise the accumulator by the softmax sum and store this tile's rows of one head
    (rows past the request's end, and the columns of a padded `V_BLOCK` past `V_DIM`, are not
    written)."""
    acc = acc / l_i[:, None]
    offs_d = tl.arange(0, V_BLOCK)
    o_ptrs = O + (seq_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    mask = (offs_m < seq_len)[:, None]
    if V_BLOCK > V_DIM:
        mask = mask & (offs_d < V_DIM)[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_kernel(
    q_desc, q_tail_desc, k_desc, k_tail_desc, v_desc, O, cu_seqlens, stats,
    qk_scale, stride_ot, stride_oh,
    GROUP: tl.constexpr, QK_DIM: tl.constexpr, QK_MAIN: tl.constexpr, QK_TAIL: tl.constexpr,
    V_DIM: tl.constexpr, V_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, RECORD_STATS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest-first
    head = tl.program_id(1)
    req = tl.program_id(2)

    seq_start = tl.load(cu_seqlens + req)
    seq_len = tl.load(cu_seqlens + req + 1) - seq_start
    m_start = m_tile * BLOCK_M
    if m_start >= seq_len:
        return  # this request has no queries in this tile

    offs_m = m_start + tl.arange(0, BLOCK_M)  # local query positions
    offs_n = tl.arange(0, BLOCK_N)
    # Q, K, V are 2-D views [T, heads * D]: a head is a column block; GQA reads KV head head // GROUP.
    q = q_desc.load([seq_start + m_start, head * QK_DIM])
    q_tail = q
    if QK_TAIL > 0:
        q_tail = q_tail_desc.load([seq_start + m_start, head * QK_DIM + QK_MAIN])
        if QK_MAIN + QK_TAIL > QK_DIM:  # padded: zero the next head's columns
            q_tail = tl.where((tl.arange(0, QK_TAIL) < QK_DIM - QK_MAIN)[None, :], q_tail, 0.0)
    k_col = (head // GROUP) * QK_DIM
    v_col = (head // GROUP) * V_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_BLOCK], dtype=tl.float32)

    if CAUSAL:
        # Key tiles ending at or before this tile's first query are wholly visible.
        full_end = (m_start + 1) // BLOCK_N * BLOCK_N
        diag_end = tl.minimum(m_start + BLOCK_M, seq_len)
    else:
        full_end = seq_len // BLOCK_N * BLOCK_N
        diag_end = seq_len
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_tail, k_desc, k_tail_desc, v_desc, seq_start, k_col, v_col, offs_m, offs_n,
        seq_len, 0, full_end, qk_scale, QK_DIM, QK_MAIN, QK_TAIL, BLOCK_N, False, CAUSAL, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_tail, k_desc, k_tail_desc, v_desc, seq_start, k_col, v_col, offs_m, offs_n,
        seq_len, full_end, diag_end, qk_scale, QK_DIM, QK_MAIN, QK_TAIL, BLOCK_N, True, CAUSAL, PRECISION,
    )  # fmt: skip

    _store_rows(O, acc, l_i, seq_start, offs_m, seq_len, head, stride_ot, stride_oh, V_DIM, V_BLOCK)

    if RECORD_STATS:
        # The kernel's own account of its tiles: [full, diagonal] per program.
        pid = (req * tl.num_programs(1) + head) * tl.num_programs(0) + m_tile
        tl.store(stats + pid * 2, full_end // BLOCK_N)
        tl.store(stats + pid * 2 + 1, tl.cdiv(diag_end - full_end, BLOCK_N))


_prefill_launch = FastLaunch(_prefill_kernel)


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
        q: [T, Hq, Dqk]; k: [T, Hkv, Dqk]; v: [T, Hkv, Dv] (Hq % Hkv == 0; Dqk, Dv multiples
            of 8 in 16..256, Dv may differ from Dqk), same dtype and device.
        cu_seqlens: [B+1] int32 request boundaries in the packed rows.
        max_seqlen: the longest request (sizes the grid's query-tile axis).
        causal: mask future keys (local positions); False gives full attention per request.
        scale: softmax scale, default Dqk ** -0.5.
        out: optional [T, Hq, Dv] output buffer.
    Returns:
        o: [T, Hq, Dv] in q.dtype.
    """
    scalars = (max_seqlen, causal, scale)
    call = (
        None
        if overridden()
        else validation.call_key("prefill_attention", (q, k, v, cu_seqlens, out), scalars)
    )
    launch = validation.remembered(_REMEMBERED, call)
    if launch is not None and not validation.deep_checks_enabled(q):
        if out is not None:
            o = out
        elif launch.o_like_q:  # (cheaper than new_empty with a shape; dense like the first call's)
            o = torch.empty_like(q, memory_format=torch.contiguous_format)
        else:
            o = q.new_empty((*q.shape[:2], v.shape[2]))
        launch.run(q, k, v, o, cu_seqlens)
        return o
    validation.check_prefill("prefill_attention", q, k, v, cu_seqlens, max_seqlen)
    o = validation.prefill_output("prefill_attention", q, v, out)
    launch = _launch(q, k, v, o, cu_seqlens, max_seqlen, causal, validation.resolve_scale(scale, q.shape[-1]))
    if launch is not None:
        validation.remember(_REMEMBERED, call, launch)
    return o


class _PrefillLaunch(NamedTuple):
    """`prefill.py`'s launch for one layout of a call (what `_launch` plans from the shapes,
    dtypes and scalar arguments): `prefill_attention` remembers it per layout, so that a later
    eager call of that layout launches without planning or checks (as `paged.py` does)."""

    grid: tuple[int, int, int]
    # the descriptors' templates over q's, q's tail, k's, k's tail and v's [T, H * D] rows
    # (None: no tail); the call's layout is fixed, so each keeps its checked fields
    descriptors: tuple[DescriptorTemplate | None, ...]
    scalars: tuple  # qk_scale (base 2), o's token and head strides
    consts: dict  # the constexprs and launch options
    key: tuple  # `FastLaunch`'s key
    o_like_q: bool  # the output has q's shape (v's head dim is q's)

    def run(self, q, k, v, o, cu_seqlens, stats=None) -> None:
        q_desc, q_tail, k_desc, k_tail, v_desc = self.descriptors
        _prefill_launch.run(
            self.grid,
            (
                q_desc.over(q), q_tail and q_tail.over(q), k_desc.over(k), k_tail and k_tail.over(k),
                v_desc.over(v), o, cu_seqlens, stats if stats is not None else cu_seqlens, *self.scalars,
            ),
            self.consts,
            key=self.key,
        )  # fmt: skip


# The launches of eager `prefill_attention` calls by the call's layout (`validation.layout_key`
# of its tensors, and its scalar arguments): a call that matches a remembered one passed the
# same checks and gets the same launch. Calls that run `hopper.py` are not remembered.
_REMEMBERED: dict[tuple, _PrefillLaunch] = {}


def clear_plans() -> None:
    """Forget every remembered launch (after patching the planner's inputs, as tests do)."""
    _REMEMBERED.clear()


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
    o = validation.prefill_output("prefill_attention", q, v, None)
    cfg = prefill_config(q.shape[-1], q.dtype, max_seqlen, v_head_dim=v.shape[-1])
    num_m = cdiv(max(max_seqlen, 1), cfg.block_m)
    stats = torch.zeros((cu_seqlens.numel() - 1) * q.shape[1] * num_m * 2, dtype=torch.int32, device=q.device)
    _launch(q, k, v, o, cu_seqlens, max_seqlen, causal, validation.resolve_scale(None, q.shape[-1]), stats)
    return stats.view(cu_seqlens.numel() - 1, q.shape[1], num_m, 2)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [T, H * D] without a copy when heads are packed (the layout TMA reads)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


def _rows_template(block: list[int] | None) -> DescriptorTemplate | None:
    """Descriptors of `block` boxes over a [T, H, D] tensor's [T, H * D] rows (`rows_view`); None
    for no tail block: the kernel never reads it (no tensor map to build)."""
    return None if block is None else DescriptorTemplate(TensorDescriptor, block, view=rows_view)


def head_dim_blocks(head_dim: int) -> tuple[int, int]:
    """The power-of-two column blocks (main, tail) that cover a head dim: main is the largest
    power of two <= head_dim, tail the rest rounded up to a power of two >= 16 (0 when nothing
    is left). 192 -> (128, 64), 96 -> (64, 32), 24 -> (16, 16), 128 -> (128, 0)."""
    main = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - main
    return main, 0 if rest == 0 else max(16, 1 << (rest - 1).bit_length())


def _launch(q, k, v, o, cu_seqlens, max_seqlen, causal, scale, stats=None) -> _PrefillLaunch | None:
    """Launch the prefill over the batch: `hopper.py`'s kernel where it serves the call (None
    returned), else this file's, whose launch is returned (for `prefill_attention` to remember)."""
    T, Hq, D = q.shape
    Dv = v.shape[-1]
    batch = cu_seqlens.numel() - 1
    if T == 0 or batch == 0:
        return None
    cfg = prefill_config(D, q.dtype, max_seqlen, v_head_dim=Dv)
    # hopper.py serves one power-of-two head dim for q, k and v: other shapes never reach it,
    # even under a forced `config.override(prefill=...)`
    gluon_dims = D == Dv and D & (D - 1) == 0
    if cfg.kernel == "gluon" and causal and q.is_cuda and gluon_dims:
        # same tiles and causal walk, FlashAttention-3's schedule (see hopper.py)
        q_rows, k_rows, v_rows = rows_view(q), rows_view(k), rows_view(v)
        if launch_gluon(lambda hopper: hopper.launch_prefill(
            q_rows, k_rows, v_rows, o, cu_seqlens, max_seqlen, Hq // k.shape[1], scale * LOG2_E,
            block_n=cfg.block_n, stages=cfg.num_stages, stats=stats,
        )):  # fmt: skip
            return None
        cfg = prefill_config(
            D, q.dtype, max_seqlen, v_head_dim=Dv
        )  # this Triton cannot build it: the portable kernel
    qk_main, qk_tail = head_dim_blocks(D)
    v_block = max(16, next_power_of_2(Dv))
    group = Hq // k.shape[1]
    consts = (q.device, group, D, qk_main, qk_tail, Dv, v_block, cfg, causal, stats is not None, q.dtype)
    launch = _PrefillLaunch(
        grid=(cdiv(max(max_seqlen, 1), cfg.block_m), Hq, batch),
        descriptors=(
            _rows_template([cfg.block_m, qk_main]), _rows_template([cfg.block_m, qk_tail] if qk_tail else None),
            _rows_template([cfg.block_n, qk_main]), _rows_template([cfg.block_n, qk_tail] if qk_tail else None),
            _rows_template([cfg.block_n, v_block]),
        ),
        scalars=(scale * LOG2_E, o.stride(0), o.stride(1)),
        consts=dict(
            GROUP=group, QK_DIM=D, QK_MAIN=qk_main, QK_TAIL=qk_tail, V_DIM=Dv, V_BLOCK=v_block,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, RECORD_STATS=stats is not None,
            PRECISION=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ),
        # the launch key: the constexprs (the descriptors' blocks among them), the element types
        # and the strides the kernel specialises on
        key=LaunchKey((consts, k.dtype, v.dtype, o.stride(0), o.stride(1))),
        o_like_q=Dv == D,
    )  # fmt: skip
    launch.run(q, k, v, o, cu_seqlens, stats)
    return launch
