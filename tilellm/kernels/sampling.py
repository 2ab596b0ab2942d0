"""Sampling kernels: Gumbel-max draws from a counter-based hash, with their PyTorch twin.

The token of a random row is `argmax(logits / temperature + g)` with `g = -log(-log(u))` and `u`
uniform, which samples exactly from `softmax(logits / temperature)`. The uniforms come from a
counter-based hash of (the sequence's seed, the index of the token being sampled, the vocabulary
index), so a seeded sequence draws the same noise whatever else is in the batch, after a
preemption, on any step. `gumbel_argmax_triton` fuses noise, scaling and the argmax into one read
of the logits; `gumbel_argmax_torch` is its twin.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tilellm.kernels.config import cdiv
from tilellm.kernels.launch import FastLaunch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


# -- counter-based hash -------------------------------------------------------------------------
# lowbias32 (a 32-bit integer finaliser): two xor-shift-multiply rounds.
_M1, _M2 = 0x7FEB352D, 0x846CA68B


def _mix32_np(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(_M1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_M2)
    x ^= x >> np.uint32(16)
    return x


def seed_keys(seeds: np.ndarray) -> np.ndarray:
    """uint32 key of each 64-bit seed (uint64), computed once per sequence."""
    seeds = seeds.astype(np.uint64)
    lo = (seeds & np.uint64(_MASK32)).astype(np.uint32)
    hi = (seeds >> np.uint64(32)).astype(np.uint32)
    return _mix32_np(lo ^ _mix32_np(hi))


def row_keys(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """uint32 noise key of each row from its 64-bit seed and the index of the token it samples.

    The sampler computes the same on the device from `seed_keys(seeds)` and `steps`."""
    return _mix32_np(seed_keys(seeds) ^ _mix32_np(steps.astype(np.uint32) ^ np.uint32(_GOLDEN)))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x < 2**32 held in int64, without overflowing int64.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def _uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] float32 uniforms in (0, 1); row i depends only on keys[i] (int64 holding a uint32)."""
    idx = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    k = keys.to(torch.int64)[:, None]
    h = _mix32_torch(idx[None, :] ^ k)
    h = _mix32_torch((h + k) & _MASK32)
    # 23 bits: (2**23 - 1 + 0.5) / 2**23 is exact in float32 and below 1, so the noise is finite
    # (24 bits would round the largest value up to 1.0, whose Gumbel noise is +inf).
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] float32 Gumbel(0, 1) noise; row i depends only on keys[i] (int64 holding a uint32)."""
    return -torch.log(-torch.log(_uniforms(keys, vocab_size)))


def uniform_noise(keys: torch.Tensor) -> torch.Tensor:
    """[N] float32 uniforms in (0, 1), one per key (the hash's first entry of each row)."""
    return _uniforms(keys, 1)[:, 0]


def device_row_keys(seed_keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`row_keys` on the device: int64 tensors holding uint32 values."""
    return _mix32_torch(seed_keys ^ _mix32_torch((steps & _MASK32) ^ _GOLDEN))


def gumbel_argmax_torch(
    logits: torch.Tensor, inv_temp: torch.Tensor, seed_keys: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """argmax_v(logits[i, v] * inv_temp[i] + g[i, v]); [N] int64. Pure PyTorch."""
    noise = gumbel_noise(device_row_keys(seed_keys, steps), logits.shape[1])
    return (logits.float() * inv_temp[:, None] + noise).argmax(dim=-1)


# -- the Triton kernel: noise, scaling and the argmax in one read of the logits ---------------


@triton.jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    stride_row,
    inv_temp_ptr,
    seed_keys_ptr,
    steps_ptr,
    part_val_ptr,
    part_idx_ptr,
    V,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, chunk): the max of logits * inv_temp + gumbel noise over one vocab chunk."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temp_ptr + row)
    # -- row key: the same as device_row_keys() --
    step = (tl.load(steps_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32_tl(tl.load(seed_keys_ptr + row).to(tl.uint32) ^ _mix32_tl(step ^ 0x9E3779B9))
    # Per-lane running best: elementwise selects in the loop, one reduction at the end.
    lane_val = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        in_vocab = idx < V
        x = tl.load(logits_ptr + row * stride_row + idx, mask=in_vocab, other=float("-inf"))
        # -- noise: the same hash as gumbel_noise() --
        h = _mix32_tl(idx.to(tl.uint32) ^ key)
        h = _mix32_tl(h + key)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as _uniforms: below 1
        v = x.to(tl.float32) * inv_t - tl.log(-tl.log(u))
        v = tl.where(in_vocab, v, float("-inf"))
        better = v > lane_val  # strict: a lane keeps its first index on ties
        lane_idx = tl.where(better, idx, lane_idx)
        lane_val = tl.where(better, v, lane_val)
    best_val = tl.max(lane_val, axis=0)
    # The smallest index among the lanes holding the maximum: the chunk's first best.
    best_idx = tl.min(tl.where(lane_val == best_val, lane_idx, 2147483647), axis=0)
    tl.store(part_val_ptr + row * num_chunks + chunk, best_val)
    tl.store(part_idx_ptr + row * num_chunks + chunk, best_idx.to(tl.int64))


_gumbel_argmax_launch = FastLaunch(_gumbel_argmax_kernel)


GUMBEL_BLOCK = 2048
GUMBEL_CHUNK = 4 * GUMBEL_BLOCK  # vocab entries per program: V=151936 -> 19 programs per row


def gumbel_argmax_triton(
    logits: torch.Tensor, inv_temp: torch.Tensor, seed_keys: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """Same result as `gumbel_argmax_torch` (up to float rounding): (rows x vocab chunks)
    programs each find their chunk's best, then the first best chunk of each row wins."""
    n, v = logits.shape
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    chunks = cdiv(v, GUMBEL_CHUNK)
    part_val = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((n, chunks), dtype=torch.int64, device=logits.device)
    _gumbel_argmax_launch[(n, chunks)](
        logits,
        logits.stride(0),
        inv_temp,
        seed_keys,
        steps,
        part_val,
        part_idx,
        v,
        chunks,
        CHUNK=GUMBEL_CHUNK,
        BLOCK=GUMBEL_BLOCK,
    )
    best_chunk = part_val.argmax(dim=1, keepdim=True)  # first maximum: ties keep the lowest index
    return part_idx.gather(1, best_chunk)[:, 0]
