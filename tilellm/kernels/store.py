"""Write this step's K/V rows into their slots of the paged cache.

One program per token: it reads the token's slot from `slot_mapping` and copies the token's
`Hkv x D` K and V values there (or, with no V, one row: MLA's latent cache). Slot -1 marks
padding (e.g. the dummy rows of a CUDA-graph batch): the program returns without touching the
cache. An FP8 cache (float8_e4m3fn) stores `k / k_scale` and `v / v_scale`, saturated to +-448
(`tilellm.kernels.fp8.to_fp8`); the scales are read from device memory, so a CUDA graph replays
with their current values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation
from tilellm.kernels.config import next_power_of_2
from tilellm.kernels.fp8 import is_fp8, to_fp8, unit_scale
from tilellm.kernels.launch import FastLaunch
from tilellm.kernels.pdl import pdl_launch_kwargs, pdl_start


@triton.jit(do_not_specialize_on_alignment=["slot_mapping"])
def _store_kernel(
    K,
    V,
    K_cache,
    V_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_V: tl.constexpr,
    QUANTIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    ok = offs < HEADS * HEAD_DIM
    head = offs // HEAD_DIM
    d = offs % HEAD_DIM
    k = tl.load(K + tok.to(tl.int64) * stride_kt + head * stride_kh + d, mask=ok)
    if QUANTIZE:
        k = to_fp8(tl.div_rn(k.to(tl.float32), tl.load(k_scale)))  # div_rn: torch's exact division
    # Cache rows are [Hkv, D] contiguous: a slot is one row of Hkv * D values.
    tl.store(K_cache + slot * stride_cslot + offs, k, mask=ok)
    if HAS_V:
        v = tl.load(V + tok.to(tl.int64) * stride_vt + head * stride_vh + d, mask=ok)
        if QUANTIZE:
            v = to_fp8(tl.div_rn(v.to(tl.float32), tl.load(v_scale)))
        tl.store(V_cache + slot * stride_cslot + offs, v, mask=ok)


_store_launch = FastLaunch(_store_kernel)


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
    """Store K/V rows in the paged cache.

    Args:
        k, v: [T, Hkv, D] this step's keys and values (the last dim contiguous); v None (with
            v_cache None) stores k alone: MLA's latent rows, any D up to 4096.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous.
        slot_mapping: [T] int32/int64 slot of each token (`block * block_size + offset`); -1 skips it.
        k_scale, v_scale: FP8 caches only: [1] float32 dequantization scales (None = 1.0); the
            cache stores k / k_scale and v / v_scale in e4m3.
    """
    validation.check_store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T, Hkv, D = k.shape
    if T == 0:
        return
    has_v = v is not None
    quantize = is_fp8(k_cache)
    one = unit_scale(k.device) if quantize and (k_scale is None or v_scale is None) else None
    _store_launch[(T,)](
        k,
        v if has_v else k,
        k_cache,
        v_cache if has_v else k_cache,
        slot_mapping,
        k_scale if k_scale is not None else (one if quantize else k),  # unread unless QUANTIZE
        v_scale if v_scale is not None else (one if quantize else k),
        k.stride(0),
        k.stride(1),
        v.stride(0) if has_v else 0,
        v.stride(1) if has_v else 0,
        k_cache.stride(1),
        HEADS=Hkv,
        HEAD_DIM=D,
        BLOCK=next_power_of_2(Hkv * D),
        HAS_V=has_v,
        QUANTIZE=quantize,
        num_warps=4 if Hkv * D >= 1024 else 1,
        **pdl_launch_kwargs(k.device),
    )
