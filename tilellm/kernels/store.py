"""Write this step's K/V rows into their slots of the paged cache.

One program per token: it reads the token's slot from `slot_mapping` and copies the token's
`Hkv x D` K and V values there (or, with no V, one row: MLA's latent cache);
`concat_and_cache_mla` writes MLA's row [latent | k_pe] from its two parts, with no
concatenated copy in between. Slot -1 marks padding (e.g. the dummy rows of a CUDA-graph batch):
the program returns without touching the cache. An FP8 cache (float8_e4m3fn) stores `k / k_scale`
and `v / v_scale`, saturated to +-448 (`tilellm.kernels.fp8.to_cache`); the scales are read from
device memory, so a CUDA graph replays with their current values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels import validation
from tilellm.kernels.config import next_power_of_2
from tilellm.kernels.fp8 import is_fp8, to_cache, unit_scale
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
    # Cache rows are [Hkv, D] contiguous: a slot is one row of Hkv * D values.
    tl.store(K_cache + slot * stride_cslot + offs, to_cache(k, k_scale, QUANTIZE), mask=ok)
    if HAS_V:
        v = tl.load(V + tok.to(tl.int64) * stride_vt + head * stride_vh + d, mask=ok)
        tl.store(V_cache + slot * stride_cslot + offs, to_cache(v, v_scale, QUANTIZE), mask=ok)


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
    scalars = (
        k.stride(0), k.stride(1), v.stride(0) if has_v else 0, v.stride(1) if has_v else 0, k_cache.stride(1)
    )  # fmt: skip
    pdl = pdl_launch_kwargs(k.device, T)
    consts = (
        k.device,
        Hkv,
        D,
        has_v,
        quantize,
        pdl["USE_PDL"],
    )  # with the scalars, the launch key (`FastLaunch`)
    _store_launch.run(
        (T,),
        (
            k, v, k_cache, v_cache, slot_mapping,  # (v, v_cache: None without HAS_V)
            (k_scale if k_scale is not None else one) if quantize else None,  # unread unless QUANTIZE
            (v_scale if v_scale is not None else one) if quantize else None,
            *scalars,
        ),
        lambda: dict(
            HEADS=Hkv, HEAD_DIM=D, BLOCK=next_power_of_2(Hkv * D), HAS_V=has_v, QUANTIZE=quantize,
            num_warps=4 if Hkv * D >= 1024 else 1, **pdl,
        ),
        key=(consts, scalars),
    )  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=["slot_mapping"])
def _mla_rows_kernel(
    KV_C, K_PE, Cache, slot_mapping, scale, stride_ct, stride_pt, stride_cslot,
    L: tl.constexpr, DR: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    QUANTIZE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Token t's row [kv_c[t] | k_pe[t]] into slot slot_mapping[t] (-1: nothing), as
    `_store_kernel` stores a row: e4m3 of x / scale for an FP8 cache."""
    pdl_start(USE_PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot < 0:
        return
    row = Cache + slot * stride_cslot
    offs_l = tl.arange(0, BLOCK_L)
    c = tl.load(KV_C + tok.to(tl.int64) * stride_ct + offs_l, mask=offs_l < L)
    offs_r = tl.arange(0, BLOCK_R)
    pe = tl.load(K_PE + tok.to(tl.int64) * stride_pt + offs_r, mask=offs_r < DR)
    tl.store(row + offs_l, to_cache(c, scale, QUANTIZE), mask=offs_l < L)
    tl.store(row + L + offs_r, to_cache(pe, scale, QUANTIZE), mask=offs_r < DR)


_mla_rows_launch = FastLaunch(_mla_rows_kernel)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store MLA's cache rows from their two parts (vLLM's `concat_and_cache_mla`):
    `store_kvcache(cat((kv_c, k_pe), -1)[:, None], None, kv_cache, None, slot_mapping,
    k_scale=kv_scale)` in one launch, without the concatenated copy.

    Args:
        kv_c: [T, L] the normalised latents; k_pe: [T, Dr] the rotated keys (last dims contiguous).
        kv_cache: [num_blocks, block_size, 1, L + Dr], contiguous, in kv_c's dtype or FP8.
        slot_mapping: [T] int32/int64; -1 skips the token.
        kv_scale: an FP8 cache's [1] float32 scale (None = 1.0): the cache stores x / kv_scale.
    """
    validation.check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)
    t, width = kv_c.shape
    if t == 0:
        return
    dr = k_pe.shape[1]
    quantize = is_fp8(kv_cache)
    scale = kv_scale if kv_scale is not None else (unit_scale(kv_c.device) if quantize else kv_c)
    _mla_rows_launch[(t,)](
        kv_c, k_pe, kv_cache, slot_mapping, scale, kv_c.stride(0), k_pe.stride(0), kv_cache.stride(1),
        L=width, DR=dr, BLOCK_L=next_power_of_2(width), BLOCK_R=next_power_of_2(dr), QUANTIZE=quantize,
        num_warps=4 if width + dr >= 1024 else 1, **pdl_launch_kwargs(kv_c.device, t),
    )  # fmt: skip
