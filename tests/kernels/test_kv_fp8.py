"""FP8 (e4m3) KV caches: the store kernel quantizes, the attention kernels dequantize in registers.

Each kernel with an FP8 cache and scales is checked against its PyTorch twin given the same FP8
cache and scales, and the twin itself against the twin run on the dequantized cache (so the
twin's reading of an FP8 cache is checked too). Scales are not 1, and differ between K and V,
so a kernel that drops or swaps one is wrong. The store kernel must write the very bytes the
twin writes.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import DTYPES, assert_close, make_paged_batch, poisoned, sparse_indices, tolerance
from tilellm.kernels import reference as ref
from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8

MIXED = [(1, 75), (5, 18), (23, 41), (0, 7), (16, 16)]  # decode, verify, chunk, empty, fresh prompt


def _scale(x: torch.Tensor, headroom: float) -> torch.Tensor:
    return (x.float().abs().amax() / FP8_MAX * headroom).reshape(1).to(torch.float32)


def fp8_batch(pairs, hq, hkv, dtype, device, seed=0):
    """A paged batch whose caches are quantized to FP8 with K and V scales of their own, and the
    same batch with the dequantized caches in `dtype` (what the FP8 one stands for)."""
    b = make_paged_batch(pairs, hq, hkv, 64, 16, dtype, device, seed=seed)
    k_scale, v_scale = _scale(b.k_cache, 1.7), _scale(b.v_cache, 0.6)  # 0.6: some values saturate
    k8, v8 = quantize_fp8(b.k_cache, k_scale), quantize_fp8(b.v_cache, v_scale)
    plain = make_paged_batch(pairs, hq, hkv, 64, 16, dtype, device, seed=seed)
    plain.k_cache, plain.v_cache = dequantize_fp8(k8, k_scale, dtype), dequantize_fp8(v8, v_scale, dtype)
    b.k_cache, b.v_cache = k8, v8
    return b, plain, {"k_scale": k_scale, "v_scale": v_scale}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_v", [True, False], ids=["kv", "rows"])
def test_store_writes_the_twins_bytes(dtype, with_v, device):
    gen = torch.Generator().manual_seed(1)
    T, H, D = 37, 2, 64
    k = (torch.randn(T, H, D, generator=gen) * 30).to(device=device, dtype=dtype)  # beyond +-448 too
    v = (torch.randn(T, H, D, generator=gen) * 3).to(device=device, dtype=dtype) if with_v else None
    slots = torch.randperm(8 * 16, generator=gen)[:T].to(torch.int32)
    slots[::5] = -1  # padding rows are skipped
    slots = slots.to(device)
    scales = {"k_scale": torch.tensor([0.37], device=device), "v_scale": torch.tensor([0.011], device=device)}
    caches = []
    for store in (tk.store_kvcache, ref.store_kvcache):
        kc = torch.full((8, 16, H, D), 1.5, device=device).to(FP8_DTYPE)  # untouched slots keep 1.5
        vc = torch.full((8, 16, H, D), -2.0, device=device).to(FP8_DTYPE) if with_v else None
        store(k, v, kc, vc, slots, **scales)
        caches.append((kc, vc))
    (kc, vc), (kc_ref, vc_ref) = caches
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    if with_v:
        assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    kept = slots[slots >= 0].long().cpu()
    stored = kc_ref.view(-1, H, D)[kept].float().cpu() * 0.37
    wanted = k[(slots >= 0).cpu()].float().cpu().clamp(-FP8_MAX * 0.37, FP8_MAX * 0.37)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4, beside subnormals near zero
    assert torch.all((stored - wanted).abs() <= wanted.abs() * 2**-4 + 0.37 * 2**-10)
    untouched = torch.ones(8 * 16, dtype=torch.bool)
    untouched[kept] = False
    assert torch.all(kc_ref.view(-1, H, D)[untouched].float() == 1.5)


# GQA groups of 4 and 5 (padded tile rows) in each dtype the interpreter runs, bf16 on the GPU
PAGED_CASES = [
    pytest.param((8, 2), torch.float16, id="8q2kv-fp16"),
    pytest.param((5, 1), torch.float32, id="5q1kv-fp32"),
    pytest.param((8, 2), torch.bfloat16, id="8q2kv-bf16", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("heads, dtype", PAGED_CASES)
def test_paged_fp8_cache(heads, dtype, device):
    b, plain, scales = fp8_batch(MIXED, *heads, dtype, device, seed=heads[0])
    tol = tolerance(dtype, device)
    expected = ref.paged_attention(*plain.args())
    assert_close(ref.paged_attention(*b.args(), **scales), expected, tol, "twin on FP8")
    for splits in (None, 3):
        out = poisoned(b.q)
        tk.paged_attention(*b.args(), out=out, num_splits=splits, **scales)
        assert_close(out, expected, tol, f"kernel, num_splits={splits}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_cascade_fp8_cache(dtype, device):
    # four requests sharing their first two blocks (cascade), with their own suffixes
    b, plain, scales = fp8_batch([(1, 50), (1, 37), (1, 64), (1, 33)], 8, 2, dtype, device, seed=3)
    for t in (b, plain):
        t.block_table[:, :2] = t.block_table[0, :2]
    tol = tolerance(dtype, device)
    q = b.q
    expected = ref.decode_attention(q, plain.k_cache, plain.v_cache, plain.block_table, plain.seq_lens)
    args = (q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    assert_close(ref.decode_attention(*args, **scales), expected, tol, "twin decode")
    for splits in (None, 4):
        assert_close(
            tk.decode_attention(*args, num_splits=splits, **scales), expected, tol, f"decode {splits}"
        )
    prefix = torch.tensor([32], dtype=torch.int32, device=device)
    got = tk.cascade_decode_attention(*args, prefix, **scales)
    assert_close(got, expected, tol, "cascade")
    assert_close(ref.cascade_decode_attention(*args, prefix, **scales), expected, tol, "twin cascade")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_fp8_cache(dtype, device):
    pairs = [(3, 40), (1, 70)]
    b, plain, scales = fp8_batch(pairs, 4, 2, dtype, device, seed=5)
    topk = sparse_indices(pairs, 24, torch.Generator().manual_seed(5)).to(device)
    args = (b.block_table, b.cu_seqlens_q, topk)
    expected = ref.sparse_attention(plain.q, plain.k_cache, plain.v_cache, *args, seq_lens=plain.seq_lens)
    tol = tolerance(dtype, device)
    for fn in (ref.sparse_attention, tk.sparse_attention):
        got = fn(b.q, b.k_cache, b.v_cache, *args, seq_lens=b.seq_lens, **scales)
        assert_close(got, expected, tol, fn.__module__)


def test_fp8_cache_without_scales_reads_unit_scale(device):
    b, _, _ = fp8_batch([(1, 30), (4, 20)], 4, 2, torch.float32, device)
    one = torch.ones(1, device=device)
    got = tk.paged_attention(*b.args())
    assert_close(got, ref.paged_attention(*b.args(), k_scale=one, v_scale=one), 1e-4, "no scales = 1.0")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"k_scale": torch.ones(2)}, "k_scale must be a float32 tensor of one element"),
        ({"v_scale": torch.ones(1, dtype=torch.float64)}, "v_scale must be a float32 tensor"),
        ({"k_scale": 0.5}, "k_scale must be a float32 tensor"),
    ],
)
def test_bad_scales_are_named(bad, message):
    b, _, _ = fp8_batch([(1, 20)], 4, 2, torch.float32, "cpu")
    for fn in (tk.paged_attention, ref.paged_attention):
        with pytest.raises(ValueError, match=message):
            fn(*b.args(), **bad)


def test_mismatched_cache_dtypes_are_named():
    b, _, _ = fp8_batch([(1, 20)], 4, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="v_cache dtype torch.float32 differs from k_cache"):
        tk.paged_attention(b.q, b.k_cache, b.v_cache.float(), *b.args()[3:])
    with pytest.raises(ValueError, match="k_cache must have q's dtype torch.float16 or float8_e4m3fn"):
        tk.decode_attention(b.q[:1].half(), b.k_cache.float(), b.v_cache.float(), b.block_table, b.seq_lens)
