"""Input checks shared by the Triton kernels and their PyTorch twins.

Every check raises `ValueError` whose message starts with the public function's name and says
which argument is wrong and how. Two levels:

- always on (cheap, no host sync): ranks, shapes, dtypes, devices, head counts, head dim,
  strides the kernels rely on, and the lengths of the index tensors;
- value checks (`deep_checks_enabled`): they read index tensors (`cu_seqlens`, `seq_lens`,
  `block_table`, `slot_mapping`, `topk_indices`), which costs a device-to-host copy, so they run
  on CPU tensors and, on the GPU, only when `TILELLM_DEBUG=1`.

Layouts (docs/workloads.md uses the same):
    q: [T, Hq, D]        k, v: [T, Hkv, D]        k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    cu_seqlens: [B+1] int32    seq_lens: [B] int32    block_table: [B, max_blocks] int32
    slot_mapping: [T] int32/int64 (-1 = skip)      topk_indices: [T, K] int32 (-1 = empty)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from tilellm.kernels.config import debug_enabled
from tilellm.kernels.fp8 import FP8_DTYPE  # an FP8 KV cache

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: `head_dim ** -0.5` when `scale` is None, else `scale` as a float."""
    if scale is None:
        return float(head_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def deep_checks_enabled(t: torch.Tensor) -> bool:
    """Value checks run on CPU tensors always, on device tensors only when TILELLM_DEBUG=1 and
    not inside a CUDA-graph capture (they read the values on the host, which a capture forbids)."""
    if t.is_cpu:
        return True
    return debug_enabled() and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


# ----------------------------------------------------------------------------------------------
# Public checks, one per kernel
# ----------------------------------------------------------------------------------------------


STORE_MAX_ROW = 4096  # values per cache row the store kernel copies in one program


def check_store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """K and V into their caches, or (v and v_cache None) one cache of rows: MLA's latent rows,
    whose width (kv_lora_rank + rope dims, 576 in DeepSeek) need not be a power of two. The
    caches hold k's dtype, or FP8 with optional scales (`check_cache_dtype`)."""
    name = "store_kvcache"
    _check_layout_once(_check_store_layout, name, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if deep_checks_enabled(k) and k.shape[0] > 0:
        check_slot_values(name, slot_mapping, k_cache)


def check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None) -> None:
    """MLA's latent kv_c [T, L] and rotary key k_pe [T, Dr] into one cache of rows
    [num_blocks, block_size, 1, L + Dr] (kv_c's dtype, or FP8 with an optional scale)."""
    name = "concat_and_cache_mla"
    _check_layout_once(_check_mla_rows_layout, name, kv_c, k_pe, kv_cache, slot_mapping, kv_scale)
    if deep_checks_enabled(kv_c) and kv_c.shape[0] > 0:
        check_slot_values(name, slot_mapping, kv_cache)


def _check_mla_rows_layout(name, kv_c, k_pe, kv_cache, slot_mapping, kv_scale) -> None:
    _check_rank(name, "kv_c", kv_c, 2, "[T, L]")
    _check_rank(name, "k_pe", k_pe, 2, "[T, Dr]")
    _check_float(name, {"kv_c": kv_c, "k_pe": k_pe})
    _check_rank(name, "kv_cache", kv_cache, 4, "[num_blocks, block_size, 1, L + Dr]")
    check_cache_dtype(name, "kv_c", kv_c, {"kv_cache": kv_cache}, {"kv_scale": kv_scale})
    _check_slot_mapping(name, slot_mapping)
    _check_device(name, {"kv_c": kv_c, "k_pe": k_pe, "kv_cache": kv_cache, "slot_mapping": slot_mapping})
    (t, width), dr = kv_c.shape, k_pe.shape[1]
    if k_pe.shape[0] != t or slot_mapping.shape[0] != t:
        raise ValueError(
            f"{name}: kv_c has {t} tokens, k_pe {k_pe.shape[0]} and slot_mapping {slot_mapping.shape[0]}"
        )
    if tuple(kv_cache.shape[2:]) != (1, width + dr):
        raise ValueError(
            f"{name}: kv_cache [num_blocks, block_size, 1, L + Dr] must end in (1, {width + dr}) for "
            f"L = {width} and Dr = {dr}, got {tuple(kv_cache.shape[2:])}"
        )
    if not 1 <= width + dr <= STORE_MAX_ROW:
        raise ValueError(f"{name}: a cache row holds 1..{STORE_MAX_ROW} values, got L + Dr = {width + dr}")
    _check_last_dim_stride(name, {"kv_c": kv_c, "k_pe": k_pe})
    _check_contiguous(name, {"kv_cache": kv_cache, "slot_mapping": slot_mapping})


def _check_slot_mapping(name: str, slot_mapping: torch.Tensor) -> None:
    """slot_mapping [T], int32 or int64 (its values: `check_slot_values`)."""
    _check_rank(name, "slot_mapping", slot_mapping, 1, "[T]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")


def check_slot_values(name: str, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    """Every slot_mapping entry is -1 (padding) or a slot of `cache` [num_blocks, block_size, ...]
    (a host read: callers do it on CPU tensors and under TILELLM_DEBUG=1)."""
    num_slots = cache.shape[0] * cache.shape[1]
    slots = slot_mapping.cpu()
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}: slot_mapping[{t}] = {int(slots[t])} is out of range [-1, {num_slots}) "
            f"(num_blocks * block_size = {cache.shape[0]} * {cache.shape[1]})"
        )


def _check_store_layout(name, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    _check_rank(name, "k", k, 3, "[T, Hkv, D]")
    if (v is None) != (v_cache is None):
        raise ValueError(f"{name}: v and v_cache must both be given, or both be None (one cache of rows)")
    if v is not None:
        _check_rank(name, "v", v, 3, "[T, Hkv, D]")
        _check_same_shape(name, "v", v, "k", k)
        _check_cache_pair(name, k_cache, v_cache)
    else:
        _check_rank(name, "k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    pair = (
        {"k": k, "k_cache": k_cache}
        if v is None
        else {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    )
    caches = {"k_cache": k_cache} if v is None else {"k_cache": k_cache, "v_cache": v_cache}
    _check_float(name, {"k": k} if v is None else {"k": k, "v": v})
    check_cache_dtype(name, "k", k, caches, {"k_scale": k_scale, "v_scale": v_scale})
    _check_slot_mapping(name, slot_mapping)
    _check_device(name, {**pair, "slot_mapping": slot_mapping})
    T, Hkv, D = k.shape
    if tuple(k_cache.shape[2:]) != (Hkv, D):
        raise ValueError(
            f"{name}: k_cache [num_blocks, block_size, Hkv, D] has (Hkv, D) = {tuple(k_cache.shape[2:])}, "
            f"but k has (Hkv, D) = {(Hkv, D)}"
        )
    if v is not None:
        _check_head_dim(name, D)
    elif not 1 <= D <= STORE_MAX_ROW:
        raise ValueError(f"{name}: a cache row holds 1..{STORE_MAX_ROW} values, got D = {D}")
    if slot_mapping.shape[0] != T:
        raise ValueError(f"{name}: slot_mapping has {slot_mapping.shape[0]} entries, but k has {T} tokens")
    _check_last_dim_stride(name, {"k": k} if v is None else {"k": k, "v": v})
    _check_contiguous(name, {"slot_mapping": slot_mapping})


def check_prefill(name, q, k, v, cu_seqlens, max_seqlen) -> None:
    """q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]: v's head dim may differ from q's and k's
    (MLA's prefill), and prefill head dims need not be powers of two (`_check_prefill_head_dim`)."""
    _check_layout_once(_check_prefill_layout, name, q, k, v, cu_seqlens)
    _check_max_seqlen_type(name, "max_seqlen", max_seqlen)
    if deep_checks_enabled(q):
        lens = _check_cu_seqlens_values(name, "cu_seqlens", cu_seqlens, q.shape[0])
        _check_max_seqlen_value(name, "max_seqlen", max_seqlen, lens)


def _check_prefill_layout(name, q, k, v, cu_seqlens) -> None:
    _check_rank(name, "q", q, 3, "[T, Hq, D]")
    _check_rank(name, "k", k, 3, "[T, Hkv, D]")
    _check_rank(name, "v", v, 3, "[T, Hkv, Dv]")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"{name}: v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)} in [T, Hkv] "
            "(only its head dim Dv may differ)"
        )
    _check_float(name, {"q": q, "k": k, "v": v})
    _check_rank(name, "cu_seqlens", cu_seqlens, 1, "[B+1]")
    _check_int32(name, {"cu_seqlens": cu_seqlens})
    _check_device(name, {"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens})
    T, Hq, D = q.shape
    if k.shape[0] != T:
        raise ValueError(
            f"{name}: k has {k.shape[0]} tokens but q has {T} (prefill K/V are this step's own tokens)"
        )
    if k.shape[2] != D:
        raise ValueError(f"{name}: head dim of k ({k.shape[2]}) differs from q's ({D})")
    _check_heads(name, Hq, k.shape[1])
    _check_prefill_head_dim(name, "Dqk", D)
    _check_prefill_head_dim(name, "Dv", v.shape[2])
    _check_last_dim_stride(name, {"q": q, "k": k, "v": v})
    _check_cu_seqlens_len(name, "cu_seqlens", cu_seqlens)


def prefill_output(name, q: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The output of a prefill call, [T, Hq, Dv] in q's dtype: `out` once checked, else a new one."""
    shape = (*q.shape[:2], v.shape[2])
    if out is None:
        return q.new_empty(shape)
    check_out(name, out, shape, q.dtype, q.device)
    return out


def check_paged(name, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q) -> None:
    _check_layout_once(_check_paged_layout, name, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens)
    _check_max_seqlen_type(name, "max_seqlen_q", max_seqlen_q)
    if not deep_checks_enabled(q):
        return
    q_lens = _check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, q.shape[0])
    _check_max_seqlen_value(name, "max_seqlen_q", max_seqlen_q, q_lens)
    kv_lens = _check_seq_lens_values(name, seq_lens, q_lens)
    _check_block_table_values(name, block_table, kv_lens, k_cache.shape[0], k_cache.shape[1])


def _check_paged_layout(name, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens) -> None:
    _check_rank(name, "q", q, 3, "[T, Hq, D]")
    _check_cache_pair(name, k_cache, v_cache)
    _check_float(name, {"q": q})
    check_cache_dtype(name, "q", q, {"k_cache": k_cache, "v_cache": v_cache}, {})
    _check_rank(name, "block_table", block_table, 2, "[B, max_blocks_per_seq]")
    _check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    _check_rank(name, "seq_lens", seq_lens, 1, "[B]")
    _check_int32(name, {"block_table": block_table, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens})
    _check_device(
        name,
        {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_table": block_table,
            "cu_seqlens_q": cu_seqlens_q,
            "seq_lens": seq_lens,
        },
    )
    _check_q_against_cache(name, q, k_cache)
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
    _check_contiguous(name, {"block_table": block_table, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens})


def check_decode(name, q, k_cache, v_cache, block_table, seq_lens) -> None:
    _check_layout_once(_check_decode_layout, name, q, k_cache, v_cache, block_table, seq_lens)
    if not deep_checks_enabled(q):
        return
    kv_lens = _check_seq_lens_values(name, seq_lens, torch.ones(q.shape[0], dtype=torch.int64))
    _check_block_table_values(name, block_table, kv_lens, k_cache.shape[0], k_cache.shape[1])


def _check_decode_layout(name, q, k_cache, v_cache, block_table, seq_lens) -> None:
    _check_rank(name, "q", q, 3, "[B, Hq, D]")
    _check_cache_pair(name, k_cache, v_cache)
    _check_float(name, {"q": q})
    check_cache_dtype(name, "q", q, {"k_cache": k_cache, "v_cache": v_cache}, {})
    _check_rank(name, "block_table", block_table, 2, "[B, max_blocks_per_seq]")
    _check_rank(name, "seq_lens", seq_lens, 1, "[B]")
    _check_int32(name, {"block_table": block_table, "seq_lens": seq_lens})
    _check_device(
        name,
        {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table, "seq_lens": seq_lens},
    )
    _check_q_against_cache(name, q, k_cache)
    batch = q.shape[0]
    if block_table.shape[0] != batch:
        raise ValueError(
            f"{name}: block_table must have B = {batch} rows (one per query of q [B, Hq, D]), "
            f"got {block_table.shape[0]}"
        )
    if seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (one per query of q [B, Hq, D]), got {seq_lens.shape[0]}"
        )
    _check_contiguous(name, {"block_table": block_table, "seq_lens": seq_lens})


def check_sparse(name, q, k_cache, v_cache, block_table, cu_seqlens_q, topk_indices, seq_lens) -> None:
    _check_rank(name, "q", q, 3, "[T, Hq, D]")
    _check_cache_pair(name, k_cache, v_cache)
    _check_float(name, {"q": q})
    check_cache_dtype(name, "q", q, {"k_cache": k_cache, "v_cache": v_cache}, {})
    _check_rank(name, "block_table", block_table, 2, "[B, max_blocks_per_seq]")
    _check_rank(name, "cu_seqlens_q", cu_seqlens_q, 1, "[B+1]")
    _check_rank(name, "topk_indices", topk_indices, 2, "[T, K]")
    indices = {"block_table": block_table, "cu_seqlens_q": cu_seqlens_q, "topk_indices": topk_indices}
    if seq_lens is not None:
        _check_rank(name, "seq_lens", seq_lens, 1, "[B]")
        indices["seq_lens"] = seq_lens
    _check_int32(name, indices)
    _check_device(name, {"q": q, "k_cache": k_cache, "v_cache": v_cache, **indices})
    T = q.shape[0]
    _check_q_against_cache(name, q, k_cache)
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"{name}: cu_seqlens_q must have B+1 = {batch + 1} entries (block_table has B = {batch} rows), "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if topk_indices.shape[0] != T:
        raise ValueError(
            f"{name}: topk_indices [T, K] must have one row per query token (T = {T}), got {topk_indices.shape[0]} rows"
        )
    if seq_lens is not None and seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: seq_lens must have B = {batch} entries (block_table has {batch} rows), got {seq_lens.shape[0]}"
        )
    _check_contiguous(name, indices)
    if not deep_checks_enabled(q):
        return
    q_lens = _check_cu_seqlens_values(name, "cu_seqlens_q", cu_seqlens_q, T)
    topk = topk_indices.cpu().long()
    bad = topk < -1
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_indices[{t}, {j}] = {int(topk[t, j])} is negative (only -1 marks an empty entry)"
        )
    block_size = k_cache.shape[1]
    if seq_lens is not None:
        kv_lens = _check_seq_lens_values(name, seq_lens, q_lens)
        # The j-th new token of request i sits at position seq_lens[i] - q_len_i + j.
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
        _check_block_table_values(name, block_table, kv_lens, k_cache.shape[0], block_size)
        return
    # Without seq_lens: every valid index must land in a mapped, in-range block of its request.
    capacity = block_table.shape[1] * block_size
    bad = topk >= capacity
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_indices[{t}, {j}] = {int(topk[t, j])} lies past the block table "
            f"({block_table.shape[1]} blocks of {block_size} = {capacity} positions)"
        )
    if T == 0 or topk.numel() == 0:
        return
    req = torch.repeat_interleave(torch.arange(batch), q_lens)
    table = block_table.cpu().long()
    valid = topk >= 0
    blocks = table[req[:, None].expand_as(topk), topk.clamp(min=0) // block_size]
    bad = valid & ((blocks < 0) | (blocks >= k_cache.shape[0]))
    if bool(bad.any()):
        t, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_indices[{t}, {j}] = {int(topk[t, j])} maps to block_table[{int(req[t])}, "
            f"{int(topk[t, j]) // block_size}] = {int(blocks[t, j])}, outside [0, {k_cache.shape[0]}) (num_blocks)"
        )


def check_merge(o_parts, lse_parts) -> None:
    name = "merge_attention_states"
    _check_rank(name, "o_parts", o_parts, 4, "[S, T, H, D]")
    _check_rank(name, "lse_parts", lse_parts, 3, "[S, T, H]")
    _check_float(name, {"o_parts": o_parts})
    if lse_parts.dtype != torch.float32:
        raise ValueError(f"{name}: lse_parts must be float32, got {lse_parts.dtype}")
    _check_device(name, {"o_parts": o_parts, "lse_parts": lse_parts})
    if tuple(lse_parts.shape) != tuple(o_parts.shape[:3]):
        raise ValueError(
            f"{name}: lse_parts shape {tuple(lse_parts.shape)} must equal o_parts' [S, T, H] = {tuple(o_parts.shape[:3])}"
        )
    if o_parts.shape[0] < 1:
        raise ValueError(f"{name}: o_parts needs at least one part (S >= 1), got S = 0")
    _check_head_dim(name, o_parts.shape[3])
    _check_last_dim_stride(name, {"o_parts": o_parts, "lse_parts": lse_parts})


def check_split_hints(name, num_splits, max_seqlen_k, seq_lens) -> None:
    """Optional split-KV arguments of paged/decode attention: `num_splits` >= 1, `max_seqlen_k` >= max(seq_lens).

    `num_splits` may also be a `tilellm.kernels.schedule.SplitPlan` (planned on the host).
    """
    if num_splits is None and max_seqlen_k is None:
        return  # (the usual call: nothing to check)
    num_splits = getattr(num_splits, "num_splits", num_splits)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
            raise ValueError(f"{name}: num_splits must be an int or None, got {type(num_splits).__name__}")
        if num_splits < 1:
            raise ValueError(f"{name}: num_splits must be >= 1, got {num_splits}")
    if max_seqlen_k is None:
        return
    _check_max_seqlen_type(name, "max_seqlen_k", max_seqlen_k)
    if deep_checks_enabled(seq_lens) and seq_lens.numel():
        longest = int(seq_lens.max())
        if max_seqlen_k < longest:
            raise ValueError(
                f"{name}: max_seqlen_k = {max_seqlen_k} is smaller than the longest seq_lens entry ({longest})"
            )


def check_out(name, out, like_shape, dtype, device) -> None:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name}: out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(like_shape):
        raise ValueError(f"{name}: out must have shape {tuple(like_shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name}: out must have dtype {dtype}, got {out.dtype}")
    if out.device != torch.device(device):
        raise ValueError(f"{name}: out must be on {device}, got {out.device}")
    _check_last_dim_stride(name, {"out": out})


# ----------------------------------------------------------------------------------------------
# Always-on helpers
# ----------------------------------------------------------------------------------------------

# The always-on checks read only each tensor's type, shape, strides, dtype and device: a call
# whose tensors match, in all five, a call that passed them passes them too. Remembering those layouts
# saves an eager call most of its checks' host time (decode: about 8 us of 10 on a 3 GHz host).
_PASSED_LAYOUTS: set[tuple] = set()
_MAX_PASSED_LAYOUTS = 4096


def layout_key(name: str, *tensors) -> tuple | None:
    """(name, then type, shape, strides, dtype and device of each tensor, or None for a None), one
    flat tuple (cheaper to build and to compare than a tuple of tuples); None if an argument is
    neither a tensor nor None."""
    key = [name]
    try:
        for t in tensors:
            if t is None:
                key.append(None)
            else:
                key += (type(t), t.shape, t.stride(), t.dtype, t.device)
    except (AttributeError, TypeError):
        return None  # not a tensor: the checks say which
    return tuple(key)


def call_key(name: str, tensors: tuple, scalars: tuple) -> tuple | None:
    """The key of an eager kernel call by its layout: `layout_key` of its tensors, then its
    scalar arguments' values and types (True == 1, but num_splits=True is an error); None if an
    argument meant as a tensor is not one. A scalar may be unhashable: the key's lookup says so."""
    key = layout_key(name, *tensors)
    return None if key is None else key + scalars + tuple(map(type, scalars))


# The launches of eager calls remembered by `call_key` (`paged.py`, `prefill.py`, `fused.py`):
# each module's table holds at most MAX_REMEMBERED and forgets them all at once when full.
MAX_REMEMBERED = 4096


def remembered(table: dict, call: tuple | None) -> Any:
    """The launch `table` holds for `call`; None for none, for no key, or for a key with an
    unhashable scalar argument (the checks then say what is wrong)."""
    if call is None:
        return None
    try:
        return table.get(call)
    except TypeError:
        return None


def remember(table: dict, call: tuple | None, launch: Any) -> None:
    """Keep `launch` in `table` under `call` (nothing for no key or an unhashable one)."""
    if call is None:
        return
    if len(table) >= MAX_REMEMBERED:
        table.clear()
    try:
        table[call] = launch
    except TypeError:
        pass


def _check_layout_once(check, name: str, *tensors) -> None:
    """`check(name, *tensors)` unless these layouts passed it before (`layout_key`)."""
    key = layout_key(name, *tensors)
    if key in _PASSED_LAYOUTS:
        return
    check(name, *tensors)
    if key is None:
        return
    if len(_PASSED_LAYOUTS) >= _MAX_PASSED_LAYOUTS:
        _PASSED_LAYOUTS.clear()
    _PASSED_LAYOUTS.add(key)


def _check_rank(name, arg, t, ndim, layout) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {arg} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: {arg} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_same_shape(name, arg, t, ref_arg, ref) -> None:
    if t.shape != ref.shape:
        raise ValueError(
            f"{name}: {arg} shape {tuple(t.shape)} must equal {ref_arg} shape {tuple(ref.shape)}"
        )


def _check_float(name, tensors: dict) -> None:
    items = list(tensors.items())
    for arg, t in items:
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: {arg} must be float16, bfloat16 or float32, got {t.dtype}")
    first_arg, first = items[0]
    for arg, t in items[1:]:
        if t.dtype != first.dtype:
            raise ValueError(f"{name}: {arg} dtype {t.dtype} differs from {first_arg} dtype {first.dtype}")


def check_cache_dtype(name, ref_arg, ref, caches: dict, scales: dict) -> None:
    """Caches in `ref`'s dtype, or FP8 (e4m3) ones, each with an optional dequantization scale
    (None = 1.0): a float32 tensor of one element on the cache's device, read by the kernel (so
    a CUDA graph replays with the current value). Scales given with 16/32-bit caches are unused.

    caches: {arg: cache tensor}; scales: {arg: scale or None}, e.g. {"k_scale": ..., "v_scale": ...}.
    """
    for arg, cache in caches.items():
        if cache.dtype not in (ref.dtype, FP8_DTYPE):
            raise ValueError(
                f"{name}: {arg} must have {ref_arg}'s dtype {ref.dtype} or float8_e4m3fn (an FP8 cache), "
                f"got {cache.dtype}"
            )
    (first_arg, first), *rest = caches.items()
    for arg, cache in rest:
        if cache.dtype != first.dtype:
            raise ValueError(
                f"{name}: {arg} dtype {cache.dtype} differs from {first_arg} dtype {first.dtype}"
            )
    _check_scales(name, scales, first.device)


def check_kv_scales(name, q, k_cache, v_cache, k_scale, v_scale) -> None:
    """The optional dequantization scales of an attention call's K and V caches (whose dtypes
    `check_paged` / `check_decode` / `check_sparse` have checked)."""
    if k_scale is None and v_scale is None:
        return  # (the usual call: nothing to check)
    _check_scales(name, {"k_scale": k_scale, "v_scale": v_scale}, k_cache.device)


def _check_scales(name, scales: dict, device: torch.device) -> None:
    for arg, scale in scales.items():
        if scale is None:
            continue
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
            got = (
                f"{scale.dtype} of shape {tuple(scale.shape)}"
                if isinstance(scale, torch.Tensor)
                else type(scale).__name__
            )
            raise ValueError(f"{name}: {arg} must be a float32 tensor of one element, got {got}")
        if scale.device != device:
            raise ValueError(f"{name}: {arg} is on {scale.device} but the cache is on {device}")


def _check_int32(name, tensors: dict) -> None:
    for arg, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: {arg} must be int32, got {t.dtype}")


def _check_device(name, tensors: dict) -> None:
    items = list(tensors.items())
    first_arg, first = items[0]
    for arg, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but {first_arg} is on {first.device}")


def _check_cache_pair(name, k_cache, v_cache) -> None:
    _check_rank(name, "k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    _check_rank(name, "v_cache", v_cache, 4, "[num_blocks, block_size, Hkv, D]")
    _check_same_shape(name, "v_cache", v_cache, "k_cache", k_cache)
    if k_cache.shape[1] < 1:
        raise ValueError(f"{name}: block_size (k_cache dim 1) must be >= 1, got {k_cache.shape[1]}")
    if k_cache.shape[2] < 1:
        raise ValueError(f"{name}: k_cache must have at least one KV head, got shape {tuple(k_cache.shape)}")
    # The kernels address a slot as block * stride(0) + offset * stride(1) + head * stride(2) + d.
    _check_contiguous(name, {"k_cache": k_cache, "v_cache": v_cache})


def _check_q_against_cache(name, q, k_cache) -> None:
    Hq, D = q.shape[1], q.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"{name}: head dim of k_cache ({k_cache.shape[3]}) differs from q's ({D})")
    _check_heads(name, Hq, k_cache.shape[2])
    _check_head_dim(name, D)
    _check_last_dim_stride(name, {"q": q})


def _check_heads(name, num_q_heads, num_kv_heads) -> None:
    if num_kv_heads < 1 or num_q_heads < 1:
        raise ValueError(f"{name}: need at least one head, got Hq = {num_q_heads}, Hkv = {num_kv_heads}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{name}: Hq % Hkv must be 0 (each KV head serves a whole group of query heads), "
            f"got Hq = {num_q_heads}, Hkv = {num_kv_heads}"
        )


def _check_head_dim(name, head_dim) -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM) or head_dim & (head_dim - 1):
        raise ValueError(
            f"{name}: head dim D must be a power of two in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got D = {head_dim}"
        )


PREFILL_HEAD_DIM_MULTIPLE = 8  # 16-byte rows for 16-bit dtypes, which the kernel's TMA tiles need


def _check_prefill_head_dim(name, arg, head_dim) -> None:
    """Prefill's head dims: multiples of 8 in 16..256 (its kernel covers one with at most two
    power-of-two column blocks, the second padded where needed: 192 = 128 + 64, 24 = 16 + 16)."""
    m = PREFILL_HEAD_DIM_MULTIPLE
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM) or head_dim % m:
        raise ValueError(
            f"{name}: head dim {arg} must be a multiple of {m} in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, "
            f"got {arg} = {head_dim}"
        )


def _check_last_dim_stride(name, tensors: dict) -> None:
    for arg, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name}: {arg} must have stride 1 in its last dim (got strides {t.stride()}); call .contiguous()"
            )


def _check_contiguous(name, tensors: dict) -> None:
    for arg, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(
                f"{name}: {arg} must be contiguous (got strides {t.stride()}); call .contiguous()"
            )


def _check_cu_seqlens_len(name, arg, cu_seqlens) -> None:
    if cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name}: {arg} must have B+1 >= 1 entries, got none")


def _check_max_seqlen_type(name, arg, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: {arg} must be a Python int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: {arg} must be >= 0, got {value}")


# ----------------------------------------------------------------------------------------------
# Value helpers (read index tensors on the host)
# ----------------------------------------------------------------------------------------------


def _check_cu_seqlens_values(name, arg, cu_seqlens, num_tokens) -> torch.Tensor:
    """Checks `cu_seqlens` against `num_tokens` rows and returns the request lengths [B] (int64, CPU)."""
    cu = cu_seqlens.cpu().long()
    if int(cu[0]) != 0:
        raise ValueError(f"{name}: {arg}[0] must be 0, got {int(cu[0])}")
    lens = cu[1:] - cu[:-1]
    if bool((lens < 0).any()):
        i = int((lens < 0).nonzero()[0, 0])
        raise ValueError(
            f"{name}: {arg} must be non-decreasing, but {arg}[{i + 1}] = {int(cu[i + 1])} < {arg}[{i}] = {int(cu[i])}"
        )
    if int(cu[-1]) != num_tokens:
        raise ValueError(
            f"{name}: {arg}[-1] = {int(cu[-1])} must equal the number of query tokens T = {num_tokens}"
        )
    return lens


def _check_max_seqlen_value(name, arg, value, lens) -> None:
    longest = int(lens.max()) if lens.numel() else 0
    if value < longest:
        raise ValueError(
            f"{name}: {arg} = {value} is smaller than the longest request ({longest} tokens, "
            f"request {int(lens.argmax())}); the kernel would silently drop its last queries"
        )


def _check_seq_lens_values(name, seq_lens, q_lens) -> torch.Tensor:
    """Checks seq_lens[i] >= q_len_i (the new tokens are part of the KV) and returns them (int64, CPU)."""
    kv = seq_lens.cpu().long()
    bad = kv < q_lens
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}: seq_lens[{i}] = {int(kv[i])} is smaller than request {i}'s {int(q_lens[i])} new tokens "
            f"(seq_lens counts the cached prefix plus the new tokens)"
        )
    return kv


def _check_block_table_values(name, block_table, kv_lens, num_blocks, block_size) -> None:
    needed = (kv_lens + block_size - 1) // block_size
    columns = block_table.shape[1]
    if needed.numel() and int(needed.max()) > columns:
        i = int(needed.argmax())
        raise ValueError(
            f"{name}: block_table too short: request {i} needs {int(needed[i])} blocks for seq_len {int(kv_lens[i])} "
            f"with block_size {block_size}, table has {columns} columns"
        )
    if block_table.numel() == 0:
        return
    table = block_table.cpu()
    used = torch.arange(columns)[None, :] < needed[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: block_table[{i}, {j}] = {int(table[i, j])} is out of range [0, {num_blocks}) (num_blocks) "
            f"but request {i} uses it (seq_len {int(kv_lens[i])})"
        )


def check_cascade_prefix(name, q, block_table, seq_lens, prefix_len, block_size) -> None:
    """`prefix_len` ([1] int tensor) keys are shared: <= every seq_len, same leading blocks in every row."""
    if not isinstance(prefix_len, torch.Tensor) or tuple(prefix_len.shape) != (1,):
        raise ValueError(
            f"{name}: prefix_len must be a 1-element int tensor of shape [1], got {prefix_len!r}"
        )
    if prefix_len.dtype not in (torch.int32, torch.int64) or prefix_len.device != q.device:
        raise ValueError(
            f"{name}: prefix_len must be int32/int64 on {q.device}, got {prefix_len.dtype} on {prefix_len.device}"
        )
    if not deep_checks_enabled(seq_lens):
        return
    p = int(prefix_len.item())
    shortest = int(seq_lens.min()) if seq_lens.numel() else 0
    if p < 0 or p > shortest:
        raise ValueError(f"{name}: prefix_len {p} must be in [0, min(seq_lens) = {shortest}]")
    nb = -(-p // block_size)
    if nb and not bool((block_table[:, :nb] == block_table[:1, :nb]).all()):
        raise ValueError(
            f"{name}: the first {nb} blocks of every block_table row must be the shared prefix's"
        )


def output_like(name, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The output buffer of an attention call: `out` once checked against q, else a new one."""
    if out is None:
        return torch.empty_like(q)
    check_out(name, out, q.shape, q.dtype, q.device)
    return out
