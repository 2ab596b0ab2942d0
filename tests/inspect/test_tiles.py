"""The tile-schedule report (`tilellm.inspect.tiles`): its promises, and that it describes the kernels.

Invariants, checked on hand-picked and on generated batches:
- no future tile is ever visited: every visited key tile of a causal program starts at or before
  the program's last query position, and every `full` tile is visible to the program's first row;
- nothing visible is missed: the visited tiles run contiguously up to the last query position;
- full + diagonal + skipped = the key tiles of the request (summed over split-KV segments);
- a program whose query tile lies past its request's end visits nothing.
Then the kernels' own tile counts (`prefill_tile_stats`, `paged_tile_stats`) must equal the report,
and the split plan must pick 1 for many short requests, > 1 for one long one, and honour forced counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.helpers import cu_seqlens, make_paged_batch, randn
from tilellm.inspect.tiles import column_tokens, paged_schedule, prefill_schedule
from tilellm.kernels import schedule
from tilellm.kernels.paged import paged_tile_stats
from tilellm.kernels.prefill import prefill_tile_stats
from tilellm.kernels.schedule import plan_split_kv


def cdiv(a, b):
    return -(-a // b)


def visited(p):
    return p.full + p.diagonal


# ----------------------------------------------------------------------------------------------
# Invariant checkers
# ----------------------------------------------------------------------------------------------


def check_prefill_schedule(sched, lengths, num_heads, causal=True):
    bm, bn = sched.block_m, sched.block_n
    num_m = cdiv(max(max(lengths, default=0), 1), bm)
    assert sched.grid == (num_m, num_heads, len(lengths))
    assert len(sched.programs) == num_heads * len(lengths) * num_m
    seen = set()
    for p in sched.programs:
        seen.add((p.request, p.head, p.q_tile))
        length = lengths[p.request]
        m_start = p.q_tile * bm
        where = f"request {p.request} (len {length}) head {p.head} q_tile {p.q_tile}: {p}"
        if m_start >= length:
            assert (visited(p), p.skipped, p.first_kv_tile, p.last_kv_tile) == (0, 0, -1, -1), where
            continue
        last_q = min(m_start + bm, length) - 1  # the program's last query position
        assert p.full + p.diagonal + p.skipped == cdiv(length, bn), where
        assert p.first_kv_tile == 0 and p.last_kv_tile == visited(p) - 1, where
        if causal:
            assert p.last_kv_tile * bn <= last_q, f"future tile visited: {where}"
            assert (p.last_kv_tile + 1) * bn > last_q, f"visible keys missed: {where}"
            assert p.full * bn <= m_start + 1, f"a 'full' tile is not visible to the first row: {where}"
        else:
            assert p.skipped == 0 and visited(p) == cdiv(length, bn), where
    assert len(seen) == len(sched.programs), "a program is listed twice"


def check_paged_schedule(sched, pairs, num_kv_heads, forced_splits=None):
    bn, block_q = sched.block_n, sched.block_q
    plan = sched.split_plan
    splits = plan.num_splits
    if forced_splits is not None:
        assert splits == forced_splits, plan
    max_q = max((q for q, _ in pairs), default=1)
    q_tiles = cdiv(max(max_q, 1), block_q)
    if q_tiles > 1:  # several query tiles: a request's tiles launch side by side
        assert sched.grid == (q_tiles * splits, num_kv_heads, len(pairs))
    else:
        assert sched.grid == (num_kv_heads, len(pairs), splits)
    assert len(sched.programs) == num_kv_heads * len(pairs) * q_tiles * splits
    by_tile = {}
    for p in sched.programs:
        by_tile.setdefault((p.request, p.head, p.q_tile), []).append(p)
    for (req, head, q_tile), progs in by_tile.items():
        q_len, seq_len = pairs[req]
        context = seq_len - q_len
        t0 = q_tile * block_q
        where = f"request {req} ({q_len}, {seq_len}) kv_head {head} q_tile {q_tile}: {progs}"
        assert sorted(p.split for p in progs) == list(range(splits)), where
        if t0 >= q_len:
            assert all(visited(p) == 0 and p.skipped == 0 and p.first_kv_tile == -1 for p in progs), where
            continue
        first_q = context + t0
        last_q = context + min(t0 + block_q, q_len) - 1
        assert sum(p.full + p.diagonal + p.skipped for p in progs) == cdiv(seq_len, bn), where
        # Segments in split order visit disjoint, contiguous ranges starting at tile 0.
        next_tile = 0
        for p in sorted(progs, key=lambda p: p.split):
            if visited(p) == 0:
                assert p.first_kv_tile == -1 and p.last_kv_tile == -1, where
                continue
            assert p.first_kv_tile == next_tile, f"gap or overlap between segments: {where}"
            assert p.last_kv_tile == p.first_kv_tile + visited(p) - 1, where
            assert p.last_kv_tile * bn <= last_q, f"future tile visited: {where}"
            full_last = p.first_kv_tile + p.full - 1  # last unmasked tile of this segment
            assert p.full == 0 or (full_last + 1) * bn <= first_q + 1, (
                f"'full' tile not visible to row 0: {where}"
            )
            next_tile = p.last_kv_tile + 1
        assert next_tile * bn > last_q, f"visible keys missed: {where}"


# ----------------------------------------------------------------------------------------------
# Hand-picked batches
# ----------------------------------------------------------------------------------------------

PREFILL_BATCHES = [[1], [0, 5, 0], [15, 16, 17, 31, 32, 33], [129, 1, 2, 65], [300]]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lengths", PREFILL_BATCHES, ids=str)
def test_prefill_schedule_invariants(lengths, causal):
    sched = prefill_schedule(cu_seqlens(lengths, "cpu"), max(lengths), 3, 64, causal=causal)
    check_prefill_schedule(sched, lengths, 3, causal)


def test_prefill_schedule_counts_past_the_end():
    sched = prefill_schedule([0, 1, 300], 299, 2, 64)  # lists are accepted too
    tiles = cdiv(299, sched.block_m)
    assert sched.num_empty_programs == 2 * (tiles - 1)  # request 0 (1 token) uses one query tile
    assert sched.num_full + sched.num_diagonal + sched.num_skipped == 2 * (
        cdiv(1, sched.block_n) + tiles * cdiv(299, sched.block_n)
    )


PAGED_BATCHES = [
    [(1, 1)],
    [(1, 1328), (5, 18), (129, 463)],
    [(1, 75), (5, 18), (23, 41), (0, 7), (16, 16)],
    [(64, 64), (1, 4096)],
]


@pytest.mark.parametrize("num_splits", [None, 1, 2, 7])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("pairs", PAGED_BATCHES, ids=lambda p: f"B{len(p)}")
def test_paged_schedule_invariants(pairs, heads, num_splits):
    cu = cu_seqlens([q for q, _ in pairs], "cpu")
    seq_lens = torch.tensor([kv for _, kv in pairs], dtype=torch.int32)
    sched = paged_schedule(cu, seq_lens, *heads, 128, 16, num_splits=num_splits)
    check_paged_schedule(sched, pairs, heads[1], num_splits)
    listed = paged_schedule(cu.tolist(), seq_lens.tolist(), *heads, 128, 16, num_splits=num_splits)
    assert listed.programs == sched.programs, "lists and CPU tensors must give the same schedule"


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 80), st.integers(0, 300)).map(lambda t: (t[0], t[0] + t[1])),
        min_size=1,
        max_size=5,
    ),
    group=st.sampled_from([1, 2, 5, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    num_splits=st.sampled_from([None, 1, 2, 3, 7]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    head_dim=st.sampled_from([64, 128, 256]),
)
def test_paged_schedule_invariants_generated(pairs, group, num_kv_heads, num_splits, dtype, head_dim):
    cu = [0]
    for q, _ in pairs:
        cu.append(cu[-1] + q)
    sched = paged_schedule(
        cu,
        [kv for _, kv in pairs],
        group * num_kv_heads,
        num_kv_heads,
        head_dim,
        16,
        num_splits=num_splits,
        dtype=dtype,
    )
    check_paged_schedule(sched, pairs, num_kv_heads, num_splits)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 400), min_size=1, max_size=6),
    causal=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    head_dim=st.sampled_from([64, 128, 256]),
)
def test_prefill_schedule_invariants_generated(lengths, causal, dtype, head_dim):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    sched = prefill_schedule(cu, max(lengths), 2, head_dim, dtype, causal=causal)
    check_prefill_schedule(sched, lengths, 2, causal)


# ----------------------------------------------------------------------------------------------
# The report describes what the kernels do
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_prefill_report_matches_kernel(causal, device):
    lengths = [1, 15, 0, 33, 70]
    gen = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = sum(lengths), 2, 1, 16
    q = randn((T, Hq, D), torch.float32, device, gen)
    k = randn((T, Hkv, D), torch.float32, device, gen)
    v = randn((T, Hkv, D), torch.float32, device, gen)
    stats = prefill_tile_stats(q, k, v, cu_seqlens(lengths, device), 70, causal=causal).cpu()
    sched = prefill_schedule(cu_seqlens(lengths, "cpu"), 70, Hq, D, torch.float32, causal=causal)
    check_prefill_schedule(sched, lengths, Hq, causal)
    assert stats.shape == (len(lengths), Hq, sched.grid[0], 2)
    for p in sched.programs:
        got = tuple(stats[p.request, p.head, p.q_tile].tolist())
        assert got == (p.full, p.diagonal), f"kernel counted {got} (full, diagonal), report says {p}"


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_paged_report_matches_kernel(num_splits, device):
    pairs = [(1, 75), (5, 18), (23, 41), (0, 7), (16, 16)]
    if num_splits is None:
        pairs.append((1, 3 * schedule.MIN_KEYS_PER_SPLIT + 5))  # long enough for the heuristic to split
    b = make_paged_batch(pairs, 4, 1, 16, 16, torch.float32, device, seed=1)
    stats, plan = paged_tile_stats(*b.args(), num_splits=num_splits)
    sched = paged_schedule(
        b.cu_seqlens_q.cpu(), b.seq_lens.cpu(), 4, 1, 16, 16, num_splits=num_splits, dtype=torch.float32
    )
    assert plan.num_splits == sched.split_plan.num_splits, (plan, sched.split_plan)
    if num_splits is None:
        assert plan.num_splits > 1, plan.reason
        # A chosen plan keeps segments >= its minimum: shorter requests are not cut. This batch
        # of 6 programs is a small one (fewer than the SMs): its minimum is the small-batch one
        # where its tiles are decode-sized (the interpreter's), else the bandwidth rule's (a GPU's
        # fp32 tiles of more rows).
        minimum = plan.min_keys_per_split
        decode_sized = sched.block_m <= schedule.DECODE_ROWS
        assert minimum == (schedule.SMALL_BATCH_MIN_KEYS if decode_sized else schedule.MIN_KEYS_PER_SPLIT)
        for p in sched.programs:
            if pairs[p.request][1] <= minimum and p.split > 0:
                assert p.full + p.diagonal == 0, p
        long_segments = [p for p in sched.programs if p.request == len(pairs) - 1 and p.full + p.diagonal]
        assert len(long_segments) > 1
        for p in long_segments[:-1]:  # every segment but the last holds at least the minimum
            assert (p.full + p.diagonal) * sched.block_n >= minimum, long_segments
    stats = stats.cpu()
    assert stats.shape == (len(pairs), 1, cdiv(max(q for q, _ in pairs), sched.block_q) * plan.num_splits, 2)
    splits = plan.num_splits
    for p in sched.programs:
        got = tuple(stats[p.request, p.head, p.q_tile * splits + p.split].tolist())
        assert got == (p.full, p.diagonal), f"kernel counted {got} (full, masked), report says {p}"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_stats_do_not_depend_on_launch_order(num_splits, device):
    """Query tiles first or KV heads first: every program records its tiles at the same place."""
    from tilellm.kernels import paged

    pairs = [(1, 75), (5, 18), (23, 41), (0, 7), (16, 16)]
    b = make_paged_batch(pairs, 8, 2, 16, 16, torch.float32, device, seed=2)
    stats = {}
    for tiles_fastest in (True, False):
        stats[tiles_fastest], _ = paged._launch(
            *b.args(), torch.empty_like(b.q), None, num_splits, None,
            is_decode=False, record_stats=True, tiles_fastest=tiles_fastest,
        )  # fmt: skip
    assert stats[True].shape[2] > num_splits  # several query tiles
    assert torch.equal(stats[True].cpu(), stats[False].cpu())
    assert int(stats[True].sum()) > 0


def test_chunk_tiles_fit_the_gpus_shared_memory(monkeypatch):
    """The 64-key chunk tile needs 128 KB of shared memory: GPUs with ~99 KB get 32-key tiles."""
    from tilellm.kernels import config

    monkeypatch.setattr(config, "interpreting", lambda: False)
    monkeypatch.setattr(config, "max_shared_memory", lambda device_index=None: 227 * 1024)
    assert config.paged_config(128, torch.bfloat16, 4, 512)[0].block_n == 64
    monkeypatch.setattr(config, "max_shared_memory", lambda device_index=None: 99 * 1024)
    cfg, _ = config.paged_config(128, torch.bfloat16, 4, 512)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (128, 32, 4)


# ----------------------------------------------------------------------------------------------
# Split plan
# ----------------------------------------------------------------------------------------------


def test_no_split_for_a_big_batch_of_short_requests():
    cu = list(range(257))  # 256 decodes
    plan = plan_split_kv(cu, [300] * 256, 32, 8, head_dim=128, num_sms=132)
    assert plan.num_splits == 1, plan.reason
    assert plan.base_programs >= 256 * 8


def test_split_for_one_long_request():
    plan = plan_split_kv([0, 1], [131072], 32, 8, head_dim=128, num_sms=132)
    assert plan.num_splits > 1, plan.reason
    assert plan.num_splits <= schedule.MAX_SPLITS
    assert plan.num_splits * plan.kv_len_per_split >= 131072, "segments must cover the whole context"


@pytest.mark.parametrize("forced", [1, 2, 7, 64])
def test_forced_splits_are_honoured(forced):
    for cu, lens in [(list(range(257)), [300] * 256), ([0, 1], [131072]), ([0, 5], [5])]:
        plan = plan_split_kv(cu, lens, 32, 8, num_splits=forced, num_sms=132)
        assert plan.num_splits == forced, plan
    sched = paged_schedule([0, 1, 6], [4000, 5], 32, 8, 128, 16, num_splits=forced, num_sms=132)
    q_tiles = cdiv(5, sched.block_q)
    assert sched.grid == ((q_tiles * forced, 8, 2) if q_tiles > 1 else (8, 2, forced))
    assert sched.split_plan.num_splits == forced


def test_invalid_forced_splits():
    with pytest.raises(ValueError, match="num_splits"):
        plan_split_kv([0, 1], [100], 8, 2, num_splits=0)


def test_longer_context_never_gets_fewer_segments():
    counts = [
        plan_split_kv([0, 1], [n], 32, 8, num_sms=132).num_splits for n in (256, 1024, 8192, 65536, 131072)
    ]
    assert counts == sorted(counts), counts


def test_verification_batch_that_fills_one_wave_is_not_split():
    """V1 (32 requests x 6 new tokens over 8192 keys, 32-row tiles): its 256 programs are almost
    two waves on 132 SMs; measured on an H200, 1 segment beat 2 and 5."""
    # (The GPU's verification tile; the interpreter's tiles are smaller, so the rule is called directly.)
    plan = schedule.choose_num_splits(32, 8, 1, None, max_seqlen_k=8198, num_sms=132, rows_per_program=32)
    assert plan.num_splits == 1, plan.reason
    # Half the requests: 128 programs are under one wave, so the rule splits them.
    half = schedule.choose_num_splits(16, 8, 1, None, max_seqlen_k=8198, num_sms=132, rows_per_program=32)
    assert half.num_splits == 2, half.reason
    assert schedule.target_programs(32, 132) == 198 and schedule.target_programs(16, 132) == 16 * 132


def test_larger_query_tiles_need_fewer_programs_to_fill_the_gpu():
    """C1's shape (16 requests x 512 new tokens over 4096 cached keys) runs 128-row tiles, each
    eight times a decode tile's work per key: its 1024 programs fill 132 SMs without split-KV,
    while 16 one-token requests over the same contexts split."""
    cu = [512 * i for i in range(17)]
    chunk = plan_split_kv(cu, [4096 + 512] * 16, 16, 8, head_dim=128, num_sms=132)
    assert chunk.num_splits == 1, chunk.reason
    decode = plan_split_kv(list(range(17)), [4096 + 512] * 16, 16, 8, head_dim=128, num_sms=132)
    assert decode.num_splits > 1, decode.reason
    # The same rule by hand: 16 programs of 16 rows per SM, or 1.5 of larger tiles.
    few = schedule.choose_num_splits(1, 8, 1, None, max_seqlen_k=131072, num_sms=132, rows_per_program=128)
    many = schedule.choose_num_splits(1, 8, 1, None, max_seqlen_k=131072, num_sms=132)
    assert few.num_splits < many.num_splits


def test_fp8_cache_schedule_and_words():
    """An FP8 cache's schedule is the FP8 rule's (D2's 8 x 32k: 16 segments, not 32), and the
    plan's sentence says why."""
    from tilellm.inspect.model import describe_batch
    from tilellm.inspect.tiles import paged_schedule
    from tilellm.inspect.words import split_plan

    cu, lens = list(range(9)), [32768] * 8
    plain = paged_schedule(cu, lens, 32, 8, 128, 16, num_sms=132)
    fp8 = paged_schedule(cu, lens, 32, 8, 128, 16, num_sms=132, kv_fp8=True)
    assert plain.split_plan.num_splits == 32 and not plain.split_plan.kv_fp8
    assert fp8.split_plan.num_splits == 16 and fp8.split_plan.kv_fp8
    insp = describe_batch([(1, n) for n in [32768] * 20], num_q_heads=32, num_kv_heads=8)
    fp8_insp = dataclasses.replace(
        insp, schedule=paged_schedule(list(range(21)), [32768] * 20, 32, 8, 128, 16, kv_fp8=True)
    )
    assert "FP8 cache holds half the bytes per key" in split_plan(fp8_insp)
    assert "FP8" not in split_plan(insp)


def test_fp8_decode_on_hopper_shows_the_gluon_kernel(monkeypatch):
    """Where the plan gives FP8 decode to `decode_fp8.py` (Hopper with Gluon, made so here), the
    schedule names it: the group's heads in 8 MMA columns, 32-key tiles, the plan's segments;
    a chunk over the same cache, or a 16-bit cache, stays `paged_attention`."""
    from tilellm.kernels import config
    from tilellm.kernels.paged import _plan_for_shape

    monkeypatch.setattr(config, "gluon_ok", lambda device_index=None: True)
    monkeypatch.setattr(config, "_gluon_module_disabled", {})
    _plan_for_shape.cache_clear()
    lens = [1, 31, 32, 33, 700]
    sched = paged_schedule(list(range(6)), lens, 16, 8, 128, 16, num_sms=132, kv_fp8=True, num_splits=1)
    assert (sched.kernel, sched.block_m, sched.block_n, sched.grid) == ("decode_fp8", 8, 32, (8, 5, 1))
    for p in sched.programs:
        assert p.full + p.diagonal == -(-lens[p.request] // 32)
    split = paged_schedule(list(range(6)), lens, 16, 8, 128, 16, num_sms=132, kv_fp8=True)
    assert split.kernel == "decode_fp8" and split.split_plan.kv_fp8
    chunk = paged_schedule([0, 1, 2, 3, 4, 40], lens, 16, 8, 128, 16, num_sms=132, kv_fp8=True)
    assert chunk.kernel == "paged_attention"
    # verification of up to 6 tokens x 4 heads (24 rows), where opted in: two programs of 16
    # columns a request, each walking the request's keys (the second's 8 rows are tokens 4 and 5)
    q_lens, verify_lens = [6, 3, 6, 1, 6], [40, 300, 700, 33, 6]
    cu = [0, *np.cumsum(q_lens).tolist()]
    default = paged_schedule(cu, verify_lens, 32, 8, 128, 16, num_sms=132, kv_fp8=True, num_splits=1)
    assert default.kernel == "paged_attention"
    monkeypatch.setenv("TILELLM_FP8_VERIFY", "gluon")
    _plan_for_shape.cache_clear()
    verify = paged_schedule(cu, verify_lens, 32, 8, 128, 16, num_sms=132, kv_fp8=True, num_splits=1)
    assert (verify.kernel, verify.block_m, verify.block_n, verify.grid) == ("decode_fp8", 16, 32, (16, 5, 1))
    for p in verify.programs:
        if p.q_tile == 1 and q_lens[p.request] <= 4:  # no token in the second column group
            assert p.full + p.diagonal == 0
        else:
            assert p.full + p.diagonal == -(-verify_lens[p.request] // 32)
    # (token, head) columns t * 3 + h, 16 a program: tokens 0-5 (5's head 0), then 5 and 6
    assert column_tokens(0, 16, 3, 7) == (0, 6) and column_tokens(1, 16, 3, 7) == (5, 7)
    assert paged_schedule(list(range(6)), lens, 16, 8, 128, 16, num_sms=132).kernel == "paged_attention"
    _plan_for_shape.cache_clear()
