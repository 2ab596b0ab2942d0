"""The split-KV planner (`tilellm.kernels.schedule`): the FP8 cache's rule for decode tiles.

The 16-bit rule is covered with the inspector's tile report (tests/inspect/test_tiles.py) and by
the kernels' split tests; here: the FP8 rule's counts on the shapes it was measured on, its
invariants over random batches, that the kernels and the engine's backend plan with it for FP8
pages (and only for them), and that a kernel run on its plan over unequal contexts is right.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tilellm.kernels as tk
from tests.kernels.helpers import assert_close, make_paged_batch, tolerance
from tilellm.attention.backends.base import AttentionSpec
from tilellm.attention.backends.triton import TritonBackend
from tilellm.kernels import reference as ref
from tilellm.kernels import schedule
from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8
from tilellm.kernels.schedule import choose_num_splits, plan_paged

SMS = 132  # an H200


def _decode(batch: int, longest: int, *, kv_fp8: bool, kv_heads: int = 8) -> schedule.SplitPlan:
    return choose_num_splits(batch, kv_heads, 1, None, max_seqlen_k=longest, num_sms=SMS, kv_fp8=kv_fp8)


@pytest.mark.parametrize(
    "batch, longest, fp8_splits, bf16_splits",
    [
        (8, 32768, 16, 32),  # D2: the FP8 sweep's best count is 16
        (1, 131072, 128, 64),  # D3: best 128
        (64, 16384, 8, 5),  # D4 (unequal up to 16k): best 16, 8 within 1.3% of it
        (256, 4096, 1, 1),  # D1-like and E1's decode: enough programs unsplit
        (32, 8192, 4, 8),  # segments of 2048 FP8 keys: the bytes of 1024 16-bit ones
    ],
)
def test_fp8_rule_counts(batch, longest, fp8_splits, bf16_splits):
    assert _decode(batch, longest, kv_fp8=True).num_splits == fp8_splits
    assert _decode(batch, longest, kv_fp8=False).num_splits == bf16_splits


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 512), longest=st.integers(0, 1 << 18), kv_heads=st.sampled_from([1, 2, 8]))
def test_fp8_rule_invariants(batch, longest, kv_heads):
    plan = _decode(batch, longest, kv_fp8=True, kv_heads=kv_heads)
    base, n = batch * kv_heads, plan.num_splits
    assert plan.kv_fp8 and plan.base_programs == base
    if base < SMS:
        return  # the small-batch rule takes over (at least the FP8 rule's count; checked below)
    target = schedule.FP8_PROGRAMS_PER_SM * SMS
    assert 1 <= n <= schedule.FP8_MAX_SPLITS
    if base >= schedule.FILL_SHARE * target or longest < schedule.MIN_CONTEXT_TO_SPLIT:
        assert n == 1, plan.reason
        return
    # segments no longer than FP8_KEYS_PER_SPLIT (up to the cap) and no shorter than the minimum
    assert n >= min(-(-longest // schedule.FP8_KEYS_PER_SPLIT), schedule.FP8_MAX_SPLITS), plan.reason
    assert longest // n >= schedule.MIN_KEYS_PER_SPLIT or n == -(-longest // schedule.FP8_KEYS_PER_SPLIT)
    # halved no further than needed: half the segments would not reach the programs' target
    if n > -(-longest // schedule.FP8_KEYS_PER_SPLIT):
        assert base * (n // 2) < schedule.FILL_SHARE * target, plan.reason


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(1, 16), longest=st.integers(1, 1 << 18))
def test_small_batches_keep_at_least_the_fp8_count(batch, longest):
    base = batch * 8
    plan = _decode(batch, longest, kv_fp8=True)
    alone = schedule._plan_fp8(base, longest, SMS)
    assert plan.num_splits >= alone.num_splits and plan.kv_fp8


@pytest.mark.parametrize(
    "batch, longest, fp8_splits, bf16_splits",
    [
        (1, 8192, 32, 16),  # one request over 8k keys: the FP8 sweeps' best 32 (16: 23-30% slower)
        (2, 16384, 32, 16),  # best 32 (16: 12-19% slower)
        (4, 8192, 16, 16),  # 32 programs: 17 for 4 a SM, rounded down to 16 (32: 3-5% slower)
        (8, 4096, 8, 9),  # 64 programs: 9 for 4 a SM, rounded down to 8 (9: 6% slower)
        (1, 2048, 32, 16),  # best 32 (16: 5-13% slower)
        (1, 1024, 16, 16),  # segments of at least 64 keys
        (16, 512, 4, 5),  # 128 programs: 5 for 4 a SM, rounded down to 4
    ],
)
def test_small_fp8_batches_split_into_a_power_of_two_up_to_32(batch, longest, fp8_splits, bf16_splits):
    """Decode tiles of a small batch over an FP8 cache (and verification tiles of a few tokens,
    planned the same way) take a power of two of segments, up to SMALL_BATCH_MAX_SPLITS_FP8; a
    16-bit cache keeps at most SMALL_BATCH_MAX_SPLITS, any count."""
    assert _decode(batch, longest, kv_fp8=True).num_splits == fp8_splits
    assert _decode(batch, longest, kv_fp8=False).num_splits == bf16_splits


@pytest.mark.parametrize("bound", [1, 2])
@pytest.mark.parametrize("batch, splits", [(16, 5), (17, 4), (24, 3), (32, 3), (33, 1), (64, 1)])
def test_batches_of_few_programs_per_sm_split_short_contexts(monkeypatch, bound, batch, splits):
    """Over a 16-bit cache, decode batches of fewer than SMALL_BATCH_SPLIT_BELOW programs per SM
    split a context too short for the bandwidth rule (into about SMALL_BATCH_PROGRAMS_PER_SM
    programs per SM), the others not; over an FP8 cache only those of fewer programs than SMs."""
    monkeypatch.setattr(schedule, "SMALL_BATCH_SPLIT_BELOW", bound)
    assert schedule.MIN_CONTEXT_TO_SPLIT == 2048
    want = splits if batch * 8 < bound * SMS else 1
    assert _decode(batch, 2047, kv_fp8=False).num_splits == want
    assert (_decode(batch, 2047, kv_fp8=True).num_splits > 1) == (batch * 8 < SMS)
    assert _decode(batch, 192, kv_fp8=False).num_splits == min(want, 192 // schedule.SMALL_BATCH_MIN_KEYS)


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 16), longest=st.integers(1, 1 << 18))
def test_small_fp8_batches_split_within_the_cap(batch, longest):
    """A small batch over an FP8 cache: a power of two of segments (or the FP8 rule's own count,
    when larger), at most SMALL_BATCH_MAX_SPLITS_FP8 of them past that rule, none shorter than
    SMALL_BATCH_MIN_KEYS keys unless the FP8 rule made them."""
    n = _decode(batch, longest, kv_fp8=True).num_splits
    alone = schedule._plan_fp8(batch * 8, longest, SMS).num_splits
    if n > alone:
        assert n & (n - 1) == 0 and n <= schedule.SMALL_BATCH_MAX_SPLITS_FP8
        assert longest // n >= schedule.SMALL_BATCH_MIN_KEYS
    else:
        assert n == alone


def test_plan_paged_splits_fp8_decode_and_verification_alike():
    """`plan_paged` plans a few new tokens a request and one (decode) over an FP8 cache by the
    same small-batch rule: one request over 8192 keys takes 32 segments either way."""
    args = (1, 16, 8, 128, torch.bfloat16, 16)
    kw = dict(max_seqlen_k=8192, num_sms=SMS, kv_fp8=True, allow_gluon=False)
    verify = plan_paged(*args, 4, num_tokens=4, **kw)
    decode = plan_paged(*args, 1, num_tokens=1, is_decode=True, **kw)
    assert (verify.kernel, verify.num_splits) == ("triton", 32)
    assert (decode.kernel, decode.num_splits) == ("triton", 32)
    bf16 = plan_paged(*args, 1, num_tokens=1, is_decode=True, **{**kw, "kv_fp8": False})
    assert bf16.num_splits == 16


def test_empty_and_short_batches_do_not_split():
    """No keys at all (an empty batch, or a length the host does not know) never splits, nor do
    short contexts once the batch has a program per SM (smaller ones split short contexts too)."""
    for batch in (0, 1, 64, 512):
        assert _decode(batch, 0, kv_fp8=True).num_splits == 1
    for longest in (1, 2047):
        for batch in (17, 64, 512):  # 8 KV heads: >= 136 programs
            assert _decode(batch, longest, kv_fp8=True).num_splits == 1
    assert _decode(64, 2048, kv_fp8=True).num_splits == 2  # few programs: halved to 1024 keys


def test_only_small_tiles_take_the_fp8_rule():
    """Tiles of more than 16 rows (verification at larger groups, chunks) keep the rule measured
    for them."""
    batch = dict(max_seqlen_k=65536, num_sms=SMS)
    for rows in (32, 64, 128):
        fp8 = choose_num_splits(16, 8, 1, None, **batch, rows_per_program=rows, kv_fp8=True)
        plain = choose_num_splits(16, 8, 1, None, **batch, rows_per_program=rows)
        assert fp8.num_splits == plain.num_splits and not fp8.kv_fp8


def test_plan_paged_never_picks_gluon_for_fp8_pages(monkeypatch):
    monkeypatch.setattr(schedule, "paged_uses_gluon", lambda *a, **kw: True)  # as on an H200
    args = (8, 32, 8, 128, torch.bfloat16, 128, 4096)
    kw = dict(num_tokens=8 * 4096, max_seqlen_k=8192, num_sms=SMS)
    assert plan_paged(*args, **kw).kernel == "gluon"
    assert plan_paged(*args, **kw, kv_fp8=True).kernel == "triton"


def test_backend_plans_fp8_decode_with_the_fp8_rule():
    """The engine's per-step plan (what its decode CUDA graphs capture) follows the cache dtype."""
    spec = AttentionSpec(16, 8, 128, torch.bfloat16, 16)
    fp8_spec = AttentionSpec(16, 8, 128, torch.bfloat16, 16, cache_dtype=FP8_DTYPE)
    backend = TritonBackend()
    plain = backend.plan_paged(spec, 8, 1, 8, 32768, is_decode=True)
    fp8 = backend.plan_paged(fp8_spec, 8, 1, 8, 32768, is_decode=True)
    expect = choose_num_splits(8, 8, 1, None, max_seqlen_k=32768, kv_fp8=True).num_splits
    assert fp8.split.kv_fp8 and fp8.num_splits == expect
    assert not plain.split.kv_fp8


def test_kernel_on_an_fp8_plan_over_unequal_contexts(device):
    """A decode batch split by the FP8 rule (segments of >= 1024 keys: the short requests get
    fewer non-empty segments than the long one) gives the twin's result."""
    lens = [5000, 1500, 3100, 1]
    b = make_paged_batch([(1, n) for n in lens], 4, 2, 32, 16, torch.float32, device, seed=11)
    plan = plan_paged(len(lens), 4, 2, 32, torch.float32, 16, 1, max_seqlen_k=max(lens), num_sms=4,
                      is_decode=True, kv_fp8=True)  # fmt: skip
    assert plan.split.kv_fp8 and plan.num_splits == 3 and plan.split.min_keys_per_split == 1024, plan.split
    scales = {}
    for name in ("k", "v"):
        cache = getattr(b, f"{name}_cache")
        scale = (cache.abs().amax() / FP8_MAX * 1.3).reshape(1).to(torch.float32)
        setattr(b, f"{name}_cache", quantize_fp8(cache, scale))
        scales[f"{name}_scale"] = scale
    q = b.q.view(len(lens), 4, 32)
    caches = (b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    out = tk.decode_attention(q, *caches, num_splits=plan.split, **scales)
    k_plain = dequantize_fp8(b.k_cache, scales["k_scale"], torch.float32)
    v_plain = dequantize_fp8(b.v_cache, scales["v_scale"], torch.float32)
    expected = ref.decode_attention(q, k_plain, v_plain, b.block_table, b.seq_lens)
    assert_close(out, expected, tolerance(torch.float32, device), "FP8 plan over unequal contexts")
