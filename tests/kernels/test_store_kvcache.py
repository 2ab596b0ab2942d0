"""`store_kvcache` (Triton) against its PyTorch twin.

Caches are poisoned with NaN: written slots must equal the reference bit for bit, every other
slot (including those of -1 tokens) must stay NaN, and k/v must be left as they were.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import randn
from tilellm.kernels import reference as ref

# bf16 is a plain copy here (no tl.dot), so the interpreter handles it on CPU too.
STORE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(T, Hkv, D, num_blocks, block_size, dtype, device, slot_dtype=torch.int32, seed=0, skip=0.25):
    gen = torch.Generator().manual_seed(seed)
    k = randn((T, Hkv, D), dtype, device, gen)
    v = randn((T, Hkv, D), dtype, device, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < skip] = -1
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype, device=device)
    return k, v, k_cache, k_cache.clone(), slots.to(device=device, dtype=slot_dtype)


def check(k, v, k_cache, v_cache, slots):
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.store_kvcache(k, v, expected_k, expected_v, slots)
    k0, v0 = k.clone(), v.clone()
    tk.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k, k0) and torch.equal(v, v0), "store_kvcache modified k or v"
    for name, got, want in [("k_cache", k_cache, expected_k), ("v_cache", v_cache, expected_v)]:
        nan_got, nan_want = torch.isnan(got), torch.isnan(want)
        wrong = torch.nonzero((nan_got != nan_want).flatten(0, 1).any(-1).any(-1)).flatten()
        assert wrong.numel() == 0, f"{name}: slots {wrong[:8].tolist()} written / skipped wrongly"
        assert torch.equal(got[~nan_got], want[~nan_want]), f"{name}: stored values differ"
    written = slots[slots >= 0]
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=k.device)
    untouched[written.long()] = False
    assert torch.isnan(k_cache.flatten(0, 1)[untouched]).all(), "a slot nobody wrote lost its poison"


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", STORE_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("Hkv", "D", "block_size"), [(1, 16, 1), (2, 64, 16), (8, 128, 16), (4, 256, 64), (3, 32, 256)]
)
def test_store(Hkv, D, block_size, dtype, slot_dtype, device):
    num_blocks = max(2, 64 // block_size) + 3
    check(*make(37, Hkv, D, num_blocks, block_size, dtype, device, slot_dtype, seed=Hkv * D))


def test_all_slots_skipped(device):
    check(*make(9, 2, 16, 4, 16, torch.float16, device, skip=1.1))


def test_no_tokens(device):
    check(*make(0, 2, 16, 4, 16, torch.float16, device))


def test_strided_k_v_from_fused_projection(device):
    T, Hq, Hkv, D = 21, 8, 2, 32
    gen = torch.Generator().manual_seed(3)
    qkv = randn((T, (Hq + 2 * Hkv) * D), torch.float16, device, gen)
    _, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=1))
    _, _, k_cache, v_cache, slots = make(T, Hkv, D, 5, 16, torch.float16, device, seed=3)
    check(k, v, k_cache, v_cache, slots)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_slots_past_int32_offsets(slot_dtype, device):
    """Slots whose element offset `slot * Hkv * D` exceeds 2^31 (a 4 GiB cache, only its top touched)."""
    T, Hkv, D, block_size = 12, 2, 64, 16
    num_blocks = (1 << 31) // (block_size * Hkv * D) + 16
    gen = torch.Generator().manual_seed(4)
    k = randn((T, Hkv, D), torch.float16, device, gen)
    v = randn((T, Hkv, D), torch.float16, device, gen)
    top = num_blocks * block_size
    slots = (top - 1 - torch.randperm(128, generator=gen)[:T]).to(device=device, dtype=slot_dtype)
    slots[3] = -1
    assert int(slots.max()) * Hkv * D >= 2**31
    k_cache = torch.empty((num_blocks, block_size, Hkv, D), dtype=torch.float16, device=device)
    v_cache = torch.empty_like(k_cache)
    tail = slice(num_blocks - 10, num_blocks)  # covers every slot used
    k_cache[tail] = float("nan")
    v_cache[tail] = float("nan")
    tk.store_kvcache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t]), f"token {t} (slot {s})"
    assert int(torch.isnan(k_cache[tail]).flatten(0, 1).all(-1).all(-1).sum()) == 10 * block_size - (T - 1)


@pytest.mark.gpu
def test_gpu_real_shapes(device):
    check(*make(8192, 8, 128, 2048, 16, torch.bfloat16, device, torch.int64, seed=5))


@pytest.mark.parametrize("dtype", STORE_DTYPES, ids=str)
@pytest.mark.parametrize(("D", "block_size"), [(48, 16), (576, 64), (576, 1)])
def test_one_cache_of_rows_matches_reference(device, dtype, D, block_size):
    """v = v_cache = None: MLA's latent rows (one "head" of any width, e.g. 512 + 64) alone."""
    k, _, cache, _, slots = make(37, 1, D, -(-48 // block_size) + 1, block_size, dtype, device)
    expected = cache.clone()
    ref.store_kvcache(k, None, expected, None, slots)
    tk.store_kvcache(k, None, cache, None, slots)
    assert torch.equal(torch.isnan(cache), torch.isnan(expected))
    assert torch.equal(cache[~torch.isnan(cache)], expected[~torch.isnan(expected)])
    assert (slots >= 0).any() and torch.isnan(cache).any()  # some written, some left alone


@pytest.mark.parametrize("impl", [tk.store_kvcache, ref.store_kvcache], ids=["triton", "reference"])
def test_one_cache_needs_both_none(device, impl):
    k, v, k_cache, v_cache, slots = make(4, 1, 48, 4, 16, torch.float32, device)
    with pytest.raises(ValueError, match="both be None"):
        impl(k, v, k_cache, None, slots)
    with pytest.raises(ValueError, match="power of two"):  # K and V caches keep the kernels' head dims
        impl(k, v, k_cache, v_cache, slots)


# ---------------------------------------------------------------------------------------------
# concat_and_cache_mla: MLA's row [latent | k_pe] from its two parts
# ---------------------------------------------------------------------------------------------


def _mla_parts(T, L, Dr, num_blocks, block_size, dtype, device, seed=0):
    """kv_c and k_pe as row-strided views of one projection (as the model has them), a NaN cache."""
    gen = torch.Generator().manual_seed(seed)
    packed = randn((T, L + Dr + 8), dtype, device, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.25] = -1
    cache = torch.full((num_blocks, block_size, 1, L + Dr), float("nan"), dtype=dtype, device=device)
    return packed[:, 8 : 8 + L], packed[:, 8 + L :], cache, slots.to(device)


@pytest.mark.parametrize("dtype", STORE_DTYPES, ids=str)
@pytest.mark.parametrize(("L", "Dr", "block_size"), [(32, 16, 16), (512, 64, 64), (40, 8, 1)])
def test_concat_and_cache_mla_equals_storing_the_concatenation(device, dtype, L, Dr, block_size):
    """The same cache bits as `store_kvcache` of cat((kv_c, k_pe)), on strided parts; the twin
    too; -1 slots untouched."""
    kv_c, k_pe, cache, slots = _mla_parts(37, L, Dr, -(-48 // block_size) + 1, block_size, dtype, device)
    expected = cache.clone()
    tk.store_kvcache(torch.cat((kv_c, k_pe), dim=-1).unsqueeze(1), None, expected, None, slots)
    for impl in (tk.concat_and_cache_mla, ref.concat_and_cache_mla):
        got = cache.clone()
        impl(kv_c, k_pe, got, slots)
        assert torch.equal(torch.isnan(got), torch.isnan(expected))
        assert torch.equal(got[~torch.isnan(got)], expected[~torch.isnan(expected)])
    assert (slots >= 0).any() and torch.isnan(expected).any()


@pytest.mark.parametrize("with_scale", [False, True])
def test_concat_and_cache_mla_fp8_cache(device, with_scale):
    """An e4m3 cache stores x / kv_scale (1.0 without one) as `store_kvcache` does."""
    kv_c, k_pe, _, slots = _mla_parts(21, 64, 16, 4, 16, torch.bfloat16, device, seed=3)
    cache = torch.zeros(4, 16, 1, 80, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.tensor([0.05], device=device) if with_scale else None
    expected = cache.clone()
    rows = torch.cat((kv_c, k_pe), dim=-1).unsqueeze(1)
    tk.store_kvcache(rows, None, expected, None, slots, k_scale=scale)
    for impl in (tk.concat_and_cache_mla, ref.concat_and_cache_mla):
        got = cache.clone()
        impl(kv_c, k_pe, got, slots, kv_scale=scale)
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_concat_and_cache_mla_no_tokens(device):
    kv_c, k_pe, cache, slots = _mla_parts(0, 32, 16, 2, 16, torch.float32, device)
    tk.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    assert torch.isnan(cache).all()


@pytest.mark.parametrize(
    "impl", [tk.concat_and_cache_mla, ref.concat_and_cache_mla], ids=["triton", "reference"]
)
@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "k_pe": a["k_pe"][:3]}, "kv_c has 5 tokens, k_pe 3"),
        (lambda a: {**a, "kv_cache": a["kv_cache"][..., :40]}, "must end in"),
        (lambda a: {**a, "kv_c": a["kv_c"].unsqueeze(1)}, "kv_c must be 2-D"),
        (lambda a: {**a, "k_pe": a["k_pe"].half()}, "k_pe"),
        (lambda a: {**a, "slot_mapping": a["slot_mapping"].float()}, "int32 or int64"),
    ],
)
def test_concat_and_cache_mla_rejects_bad_input(impl, change, match):
    kv_c, k_pe, cache, slots = _mla_parts(5, 32, 16, 2, 16, torch.float32, "cpu")
    args = change({"kv_c": kv_c, "k_pe": k_pe, "kv_cache": cache, "slot_mapping": slots})
    with pytest.raises(ValueError, match=match):
        impl(args["kv_c"], args["k_pe"], args["kv_cache"], args["slot_mapping"])
