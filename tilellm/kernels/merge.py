"""Combine split-KV partial attention outputs by their log-sum-exp.

Each of S segments of a query's keys produced an output normalised over its own keys, `o_s`,
and the log-sum-exp of its scores, `lse_s`. The full result is

    lse = log(sum_s exp(lse_s)),   o = sum_s exp(lse_s - lse) * o_s

Segments that saw no key carry lse_s = -inf and weigh nothing.

Two ways to run it: `merge_into`'s kernel, launched after the split programs; or
`merge_if_last`, called at the end of every split program of a tile, where the last program to
finish merges (one launch instead of two).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation
from tilellm.kernels.config import LOG2_E, next_power_of_2
from tilellm.kernels.launch import FastLaunch, LaunchKey
from tilellm.kernels.pdl import pdl_flags, pdl_launch_kwargs, pdl_start

LOG2_E_C = tl.constexpr(LOG2_E)  # usable inside @jit


def _splits_pad(num_splits: int) -> int:
    """The kernel's split lanes: few variants (8, 16 or 64 lanes up to the 16-bit planner's 64
    splits; 128 for the FP8 rule's up to 128, planned only for contexts of 128k keys or more, so
    the decode graphs captured for such a max_model_len compile it before serving), so that a new
    split count in the middle of serving does not compile a new kernel. 16 lanes serve the small
    batches' plans (`schedule.SMALL_BATCH_MAX_SPLITS`), which a decode graph makes for its
    longest context: each program loads [lanes, head_dim] partials, and at one request over a
    few hundred keys 64 lanes cost about 1.6 us a call more than 8 (docs/benchmarks.md, "Split-KV
    segments over short contexts")."""
    if num_splits <= 8:
        return 8
    if num_splits <= 16:
        return 16
    return max(64, next_power_of_2(num_splits))


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_pt", "stride_ls", "stride_lt"])
def _merge_kernel(
    O_parts,
    LSE_parts,
    O,
    LSE,
    num_splits,
    num_heads,
    stride_ps,
    stride_pt,
    stride_ph,  # o_parts [S, T, H, D]
    stride_ls,
    stride_lt,  # lse_parts [S, T, H], heads contiguous
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits

    lse = tl.load(LSE_parts + offs_s * stride_ls + tok * stride_lt + head, mask=split_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # All segments empty: weights 0, output 0, lse -inf (no NaN from -inf - -inf).
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.math.exp2((lse - lse_ref) * LOG2_E_C)
    w_sum = tl.sum(w, 0)
    o_parts = tl.load(
        O_parts + offs_s[:, None] * stride_ps + tok * stride_pt + head * stride_ph + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )
    # An empty segment's output is undefined: select, don't multiply (0 * NaN is NaN).
    o = tl.sum(tl.where(w[:, None] > 0.0, o_parts.to(tl.float32) * w[:, None], 0.0), 0) / tl.where(
        w_sum == 0.0, 1.0, w_sum
    )
    tl.store(O + tok * stride_ot + head * stride_oh + offs_d, o.to(O.dtype.element_ty))
    if WRITE_LSE:
        tl.store(LSE + tok * num_heads + head, lse_ref + tl.log(w_sum))


_merge_launch = FastLaunch(_merge_kernel)


# The in-kernel merge runs in one program per tile, at the end of the launch, and reads the
# tile's partials split after split (a few in flight: `merge_unroll`): the 16-bit planner's counts
# (up to 64) are served; more (the FP8 rule's up to 128) keep the separate merge, whose programs
# read all their splits at once.
MERGE_LAST_MAX_SPLITS = 64


def merge_unroll(block_m: int, head_dim: int) -> int:
    """Splits whose partials `merge_if_last` loads at once: four for decode-sized tiles, one where
    a split's [block_m, head_dim] float32 rows already fill the registers (prompt-chunk tiles)."""
    return 4 if block_m * head_dim <= 16 * 128 else 1


@triton.jit
def merge_if_last(
    O, O_parts, LSE_parts, counters, slot, num_splits, num_tokens, num_q_heads,
    q_row, head, row_ok, offs_d, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """The merge inside the split kernel: each of a tile's `num_splits` programs calls this once
    it has stored its partial rows; the last one to arrive merges the tile's rows into O.

    counters[slot] counts the tile's programs that have arrived (int32, 0 before the launch; the
    last program puts it back to 0, ready for the next launch or graph replay). Rows: q_row
    [BLOCK_M] (token of each row, int64), head [BLOCK_M], row_ok [BLOCK_M]. Partials in
    `merge_into`'s layout from part 0: o_parts [S, T, H, D] and lse_parts [S, T, H] (float32,
    contiguous). UNROLL: `merge_unroll(BLOCK_M, HEAD_DIM)`.

    Memory order: the barrier makes every thread's partial stores precede the arrival, which one
    thread makes with a release-acquire atomic at GPU scope; so the last program's acquire sees all
    the tile's partials, and it reads them from L2 (`.cg`: no stale L1 line).

    One pass with a running maximum m of the lse seen: acc and the weights' sum are rescaled by
    exp(m_old - m_new) as it grows, so that o = acc / w_sum = sum_s exp(lse_s - lse) * o_s.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + slot, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        tl.store(counters + slot, 0)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for s in tl.range(0, num_splits, loop_unroll_factor=UNROLL):
            row = (s * num_tokens + q_row) * num_q_heads + head
            lse_s = tl.load(LSE_parts + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
            o_s = tl.load(
                O_parts + row[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m, lse_s)
            # No segment with a key yet: weights stay 0 (no NaN from -inf - -inf).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2((m - m_ref) * LOG2_E_C)
            w = tl.math.exp2((lse_s - m_ref) * LOG2_E_C)
            # An empty segment's output is undefined: select, don't multiply (0 * NaN is NaN).
            acc = acc * alpha[:, None] + tl.where(w[:, None] > 0.0, o_s * w[:, None], 0.0)
            w_sum = w_sum * alpha + w
            m = m_new
        o = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
        tl.store(
            O + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(O.dtype.element_ty),
            mask=row_ok[:, None],
        )


def merge_attention_states(
    o_parts: torch.Tensor, lse_parts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split-KV partial outputs.

    Args:
        o_parts: [S, T, H, D] outputs of S key segments, each normalised over its own keys.
        lse_parts: [S, T, H] float32 natural-log log-sum-exp of each segment's scaled scores.
    Returns:
        (o [T, H, D] in o_parts.dtype, lse [T, H] float32).
    """
    validation.check_merge(o_parts, lse_parts)
    S, T, H, D = o_parts.shape
    o = torch.empty((T, H, D), dtype=o_parts.dtype, device=o_parts.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=o_parts.device)
    merge_into(o_parts, lse_parts, o, lse)
    return o, lse


def merge_into(
    o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor, lse_out: torch.Tensor | None = None
) -> None:
    """Merge into a preallocated `out` [T, H, D] (any dtype, last dim contiguous); internal use."""
    S, T, H, D = o_parts.shape
    if T == 0 or H == 0:
        return
    if o_parts.stride(3) != 1:
        o_parts = o_parts.contiguous()
    if lse_parts.stride(2) != 1:
        lse_parts = lse_parts.contiguous()
    launch = plan_merge(
        o_parts.shape, o_parts.stride(), lse_parts.stride(), out.stride(), out.device, lse_out is not None
    )
    run_merge(launch, o_parts, lse_parts, out, lse_out)


class MergeLaunch(NamedTuple):
    """The merge kernel's launch for a layout of partials and output (`plan_merge`)."""

    grid: tuple[int, int]
    scalars: tuple  # S, H, o_parts' strides (3), lse_parts' strides (2), out's strides (2)
    consts: tuple  # `_merge_constexprs`' arguments
    key: tuple  # `FastLaunch`'s key: the constexprs, H, and the head strides of o_parts and out


def plan_merge(
    parts_shape: tuple[int, ...],
    parts_stride: tuple[int, ...],
    lse_stride: tuple[int, ...],
    out_stride: tuple[int, ...],
    device: torch.device,
    write_lse: bool = False,
) -> MergeLaunch:
    """The launch that merges o_parts [S, T, H, D] (`parts_stride`; last dim contiguous) and
    lse_parts [S, T, H] (`lse_stride`) into out [T, H, D] (`out_stride`)."""
    S, T, H, D = parts_shape
    scalars = (S, H, *parts_stride[:3], *lse_stride[:2], *out_stride[:2])
    consts = (device, D, S, write_lse, pdl_launch_kwargs(device, T)["USE_PDL"])
    return MergeLaunch((T, H), scalars, consts, LaunchKey((consts, scalars[1], scalars[4], scalars[-2:])))


def run_merge(
    launch: MergeLaunch,
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    out: torch.Tensor,
    lse_out: torch.Tensor | None = None,
) -> None:
    """Launch `launch` (from `plan_merge` for these tensors' layouts)."""
    _merge_launch.run(
        launch.grid,
        (o_parts, lse_parts, out, lse_out if lse_out is not None else lse_parts, *launch.scalars),
        lambda: _merge_constexprs(*launch.consts),
        key=launch.key,
    )


def _merge_constexprs(
    device: torch.device, head_dim: int, splits: int, write_lse: bool, use_pdl: bool
) -> dict:
    """The merge kernel's constexprs and launch options for a launch's shape (`use_pdl`: from
    `pdl_launch_kwargs` for its rows)."""
    return dict(
        HEAD_DIM=head_dim, SPLITS_PAD=_splits_pad(splits), WRITE_LSE=write_lse,
        num_warps=4 if head_dim >= 128 else 2, **pdl_flags(use_pdl),
    )  # fmt: skip
