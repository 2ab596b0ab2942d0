"""The Gluon Hopper kernels (`tilellm.kernels.hopper`): packed prefill and paged chunks.

On any machine: both compile for sm_90a (Triton's own ptxas runs without a GPU) into warpgroup
MMAs fed by TMA, with register reallocation between the partitions, without spilling, in the
shared memory an H100/H200 has. On a Hopper GPU: their output against the PyTorch reference
over lengths that cross the 64-row warpgroup halves, the 128-row query tiles and the 128-key
tiles, packed with one-token and empty requests, GQA and MQA, D 64 and 128, bf16 and fp16, with
and without ping-pong, pages of 16 to 256 keys in permuted order; and `prefill_attention` /
`paged_attention` pick them for long batches.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import (
    assert_close,
    compile_for_sm90,
    cu_seqlens,
    make_paged_batch,
    poisoned,
    randn,
    tolerance,
)
from tilellm.inspect.tiles import paged_schedule, prefill_schedule
from tilellm.kernels import config, hopper
from tilellm.kernels import reference as ref
from tilellm.kernels.config import LOG2_E
from tilellm.kernels.paged import paged_tile_stats
from tilellm.kernels.prefill import prefill_tile_stats, rows_view

H100_SHARED = 227 * 1024

COMPILED = [(d, t, pp, 0) for d in (64, 128) for t in ("bf16", "fp16") for pp in (True, False)]
COMPILED += [(128, "bf16", True, page) for page in (16, 64, 256)]
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@pytest.fixture(scope="module")
def compiled() -> dict:
    calls = {
        repr(v): dict(
            head_dim=v[0], dtype=f"torch.{DTYPES[v[1]]}", pingpong=v[2], paged=v[3] > 0, page=v[3] or 16
        )
        for v in COMPILED
    }
    return compile_for_sm90("hopper", calls)


@pytest.mark.parametrize(
    "variant",
    COMPILED,
    ids=lambda v: f"d{v[0]}-{v[1]}-{'pp' if v[2] else 'free'}-{f'page{v[3]}' if v[3] else 'packed'}",
)
def test_compiles_for_sm90_without_spills(compiled, variant):
    k = compiled[repr(variant)]
    assert "wgmma.mma_async" in k["ptx"], "products must be warpgroup MMAs"
    assert "setmaxnreg" in k["ptx"], "partitions must rebalance registers (producer gives, consumers take)"
    assert "cp.async.bulk.tensor" in k["ptx"], "Q and K/V tiles must arrive by TMA"
    assert k["shared"] <= H100_SHARED, f"{k['shared']} B of shared memory"
    assert "LOCAL:0" in k["usage"], f"register spills:\n{k['usage']}"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (H100/H200)")

CASES = [  # (lengths, (Hq, Hkv), D)
    ([1], (8, 2), 128),
    ([63, 64, 65, 127, 128, 129], (8, 2), 128),  # the warpgroup halves and the query tiles
    ([255, 0, 256, 257, 1, 2], (4, 4), 128),  # MHA, an empty request
    ([1000, 1, 1537], (8, 1), 128),  # MQA
    ([4099, 7], (32, 8), 128),
    ([65, 64, 63, 1, 513, 300], (8, 2), 64),
    ([2048, 131], (10, 2), 64),
    # many tiles a program: runs of empty tiles inside (head, request)s, 1-token requests
    ([700, 3001, 1, 0, 129, 2500, 64, 1800] * 3, (16, 4), 128),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}req-{c[1][0]}q{c[1][1]}kv-d{c[2]}")
def test_against_reference(case, dtype, pingpong):
    lengths, (hq, hkv), head_dim = case
    gen = torch.Generator().manual_seed(sum(lengths) + hq)
    T = sum(lengths)
    q = randn((T, hq, head_dim), dtype, "cuda", gen)
    k = randn((T, hkv, head_dim), dtype, "cuda", gen)
    v = randn((T, hkv, head_dim), dtype, "cuda", gen)
    cu = cu_seqlens(lengths, "cuda")
    out = poisoned(q)
    hopper.launch_prefill(
        rows_view(q), rows_view(k), rows_view(v), out, cu, max(lengths), hq // hkv,
        head_dim**-0.5 * LOG2_E, pingpong=pingpong,
    )  # fmt: skip
    expected = ref.prefill_attention(q, k, v, cu, max(lengths))
    assert_close(out, expected, tolerance(dtype, "cuda"), f"{lengths} {hq}q{hkv}kv D={head_dim}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("stages,block_n", [(3, 128), (2, 128), (3, 64)])
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_few_programs_many_tiles(programs, stages, block_n, pingpong, paged, monkeypatch):
    """One or three persistent programs take every tile, so the ring's, the records' and the
    turns' barrier phases wrap many times; max_seqlen_q overstated 4x (most tiles empty) and a
    last request with no tokens (the counter's skip lands on the tile count). Outputs and the
    kernel's tile counts equal those of a launch with a program per SM, bit for bit."""
    lengths, hq, hkv, d = [1, 0, 129, 700, 64, 0], 8, 2, 128
    max_seqlen = 4 * max(lengths)
    gen = torch.Generator().manual_seed(21)
    scale_log2 = d**-0.5 * LOG2_E
    if paged:
        pairs = [(n, n + 300) for n in lengths]
        b = make_paged_batch(pairs, hq, hkv, d, 16, torch.bfloat16, "cuda", seed=21)
        q, expected = b.q, ref.paged_attention(*b.args())

        def call(out, stats):
            cache = (b.k_cache, b.v_cache, out, b.block_table, b.cu_seqlens_q, b.seq_lens)
            hopper.launch_paged(rows_view(q), *cache, max_seqlen, hq // hkv, scale_log2, block_n=block_n,
                                stages=stages, pingpong=pingpong, stats=stats)  # fmt: skip
    else:
        T = sum(lengths)
        q, k, v = (randn((T, h, d), torch.bfloat16, "cuda", gen) for h in (hq, hkv, hkv))
        cu = cu_seqlens(lengths, "cuda")
        expected = ref.prefill_attention(q, k, v, cu, max(lengths))

        def call(out, stats):
            hopper.launch_prefill(rows_view(q), rows_view(k), rows_view(v), out, cu, max_seqlen, hq // hkv,
                                  scale_log2, block_n=block_n, stages=stages, pingpong=pingpong,
                                  stats=stats)  # fmt: skip

    tiles = len(lengths) * hq * config.cdiv(max_seqlen, 128)
    full_out, full_stats = poisoned(q), torch.zeros(tiles * 2, dtype=torch.int32, device="cuda")
    call(full_out, full_stats)
    monkeypatch.setattr(hopper, "num_sms", lambda *_: programs)
    out, stats = poisoned(q), torch.zeros(tiles * 2, dtype=torch.int32, device="cuda")
    call(out, stats)
    assert torch.equal(out, full_out), f"{programs} programs differ from a program per SM"
    assert torch.equal(stats, full_stats)
    assert stats.sum() > 0
    assert_close(out, expected, tolerance(torch.bfloat16, "cuda"), f"{programs} programs")


def test_more_tiles_than_one_launch_numbers_is_refused():
    """Tile ids are int32: a batch of 2^31 tiles or more is refused before anything launches."""
    hq, d, requests = 128, 128, 8192
    x = torch.empty(8, hq, d, dtype=torch.bfloat16)
    cu = torch.zeros(requests + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="more tiles than one launch numbers"):
        hopper.launch_prefill(x.view(8, -1), x.view(8, -1), x.view(8, -1), x, cu, 1 << 18, 1, 1.0)


@pytest.mark.gpu
@needs_hopper
def test_repeated_calls_launch_through_fast_launch():
    """The Gluon kernel launches as every Triton kernel here does (`FastLaunch`): from the second
    call with the same specialisation on, without Triton's `JITFunction.run`, and with the same
    result (TMA descriptors included)."""
    lengths, hq, hkv, head_dim = [300, 1000], 8, 2, 128
    gen = torch.Generator().manual_seed(3)
    T = sum(lengths)
    q, k, v = (randn((T, h, head_dim), torch.bfloat16, "cuda", gen) for h in (hq, hkv, hkv))
    cu = cu_seqlens(lengths, "cuda")
    expected = ref.prefill_attention(q, k, v, cu, max(lengths))
    before = None
    for call in range(3):
        out = poisoned(q)
        scale_log2 = head_dim**-0.5 * LOG2_E
        q_rows, k_rows, v_rows = rows_view(q), rows_view(k), rows_view(v)
        hopper.launch_prefill(q_rows, k_rows, v_rows, out, cu, max(lengths), hq // hkv, scale_log2)
        assert_close(out, expected, tolerance(torch.bfloat16, "cuda"), f"call {call}")
        if call == 0:
            before = hopper._attention_launch.fast_launches
    assert hopper._attention_launch.fast_launches == before + 2


@pytest.mark.gpu
@needs_hopper
def test_prefill_attention_dispatches_long_batches_here():
    assert config.prefill_config(128, torch.bfloat16, 4096).kernel == "gluon"
    assert config.prefill_config(128, torch.bfloat16, 1024).kernel == "triton"  # short: prefill.py
    lengths = [3000, 1, 1200]
    gen = torch.Generator().manual_seed(5)
    T = sum(lengths)
    q = randn((T, 8, 128), torch.bfloat16, "cuda", gen)
    k = randn((T, 2, 128), torch.bfloat16, "cuda", gen)
    v = randn((T, 2, 128), torch.bfloat16, "cuda", gen)
    cu = cu_seqlens(lengths, "cuda")
    out = tk.prefill_attention(q, k, v, cu, max(lengths), out=poisoned(q))
    assert_close(out, ref.prefill_attention(q, k, v, cu, max(lengths)), 2e-2, "public entry point")


PAGED_CASES = [  # ((q_len, kv_len) pairs, (Hq, Hkv), page)
    ([(512, 4608), (512, 4608)], (32, 8), 16),  # C1's shape, two requests
    ([(128, 128), (129, 1000), (1, 17), (300, 301)], (8, 2), 16),  # no prefix, page edges, a decode
    ([(200, 2000), (64, 65), (7, 4096)], (8, 1), 64),  # MQA, a verification beside a chunk
    ([(256, 1280), (1, 1)], (4, 4), 256),  # pages larger than a key tile
    ([(130, 5000)], (10, 2), 32),
    ([(512, 4608), (0, 300), (129, 129), (1, 2000), (640, 1000)] * 6, (16, 4), 16),  # many tiles a program
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", PAGED_CASES, ids=lambda c: f"{len(c[0])}req-{c[1][0]}q{c[1][1]}kv-page{c[2]}"
)
def test_paged_against_reference(case, dtype):
    pairs, (hq, hkv), page = case
    batch = make_paged_batch(pairs, hq, hkv, 128, page, dtype, "cuda", seed=len(pairs) + page)
    out = poisoned(batch.q)
    hopper.launch_paged(
        rows_view(batch.q), batch.k_cache, batch.v_cache, out, batch.block_table, batch.cu_seqlens_q,
        batch.seq_lens, batch.max_seqlen_q, hq // hkv, 128**-0.5 * LOG2_E,
    )  # fmt: skip
    expected = ref.paged_attention(*batch.args())
    assert_close(out, expected, tolerance(dtype, "cuda"), f"{pairs} {hq}q{hkv}kv page {page}")


@pytest.mark.gpu
@needs_hopper
def test_paged_attention_dispatches_chunk_batches_here(monkeypatch):
    calls = []
    real = hopper.launch_paged

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(hopper, "launch_paged", spy)
    # 5 requests x 32 heads x 1 query tile = 160 programs: a full wave on 132 SMs
    batch = make_paged_batch([(128, 2000)] * 4 + [(6, 3000)], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=9)
    out = tk.paged_attention(*batch.args(), out=poisoned(batch.q))
    assert calls == [1], "a chunk batch on Hopper should run the Gluon kernel"
    assert_close(out, ref.paged_attention(*batch.args()), 2e-2, "public entry point")
    small = make_paged_batch([(6, 3000)] * 2, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=10)
    out = tk.paged_attention(*small.args(), out=poisoned(small.q))
    assert calls == [1], "verification-sized batches stay on the Triton kernel"
    assert_close(out, ref.paged_attention(*small.args()), 2e-2, "verification")


@pytest.mark.gpu
@needs_hopper
def test_prefill_report_matches_the_gluon_kernel():
    """Long batches run hopper.py: its own per-program tile counts equal `prefill_schedule`'s."""
    lengths = [1500, 1, 0, 129, 1100]
    gen = torch.Generator().manual_seed(11)
    T, hq, hkv = sum(lengths), 4, 2
    q = randn((T, hq, 128), torch.bfloat16, "cuda", gen)
    k = randn((T, hkv, 128), torch.bfloat16, "cuda", gen)
    v = randn((T, hkv, 128), torch.bfloat16, "cuda", gen)
    stats = prefill_tile_stats(q, k, v, cu_seqlens(lengths, "cuda"), max(lengths)).cpu()
    sched = prefill_schedule(cu_seqlens(lengths, "cpu"), max(lengths), hq, 128, torch.bfloat16)
    assert (sched.block_m, sched.block_n) == (128, 128)
    assert stats.shape == (len(lengths), hq, sched.grid[0], 2)
    for p in sched.programs:
        got = tuple(stats[p.request, p.head, p.q_tile].tolist())
        assert got == (p.full, p.diagonal), f"kernel counted {got} (full, diagonal), report says {p}"


@pytest.mark.gpu
@needs_hopper
def test_paged_report_matches_the_gluon_kernel():
    """A chunk batch wide enough for hopper.py: its own tile counts equal `paged_schedule`'s."""
    pairs = [(128, 2000)] * 3 + [(300, 301), (6, 3000), (129, 4100)]  # 3 query tiles x 32 heads x 6
    b = make_paged_batch(pairs, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=12)
    stats, plan = paged_tile_stats(*b.args())
    sched = paged_schedule(b.cu_seqlens_q.cpu(), b.seq_lens.cpu(), 32, 8, 128, 16, dtype=torch.bfloat16)
    assert sched.kernel == "paged_attention (hopper.py)"
    assert plan.num_splits == sched.split_plan.num_splits == 1
    stats = stats.cpu()
    assert stats.shape == (len(pairs), 32, sched.grid[0], 2)
    for p in sched.programs:
        got = tuple(stats[p.request, p.head, p.q_tile].tolist())
        assert got == (p.full, p.diagonal), f"kernel counted {got} (full, masked), report says {p}"


def test_hopper_paged_report_by_brute_force():
    """The hopper.py report, off the GPU: per program, key tiles seen whole by its first token,
    tiles reaching to its last token's position (masked), never a tile past it."""
    from tilellm.inspect.tiles import gluon_paged_schedule

    pairs = [(128, 2000), (300, 301), (6, 3000), (0, 5), (129, 4100), (1, 1)]
    q_lens, lens = [q for q, _ in pairs], [k for _, k in pairs]
    sched = gluon_paged_schedule(q_lens, lens, 3, 132)
    assert sched.grid == (3, 3, len(pairs)) and sched.split_plan.num_splits == 1
    for p in sched.programs:
        q_len, seq_len = pairs[p.request]
        t0 = p.q_tile * 128
        if t0 >= q_len:
            assert (p.full, p.diagonal, p.first_kv_tile) == (0, 0, -1), p
            continue
        first_pos = seq_len - q_len + t0  # the tile's first token sees keys 0..first_pos
        last_pos = seq_len - q_len + min(t0 + 128, q_len) - 1
        tiles = range(-(-seq_len // 128))
        full = [j for j in tiles if (j + 1) * 128 - 1 <= first_pos]
        visited = [j for j in tiles if j * 128 <= last_pos]
        assert (p.full, p.diagonal) == (len(full), len(visited) - len(full)), p
        assert p.skipped == len(tiles) - len(visited) and p.last_kv_tile == visited[-1], p


PAGES = [(16, True), (32, True), (64, True), (128, True), (256, True)]
PAGES += [(48, False), (80, False), (192, False), (8, False), (1, False)]


@pytest.mark.parametrize("page,ok", PAGES)
def test_pages_the_paged_kernel_takes(page, ok, monkeypatch):
    """Pages must tile a 128-key slot (every TMA box starts on a page): others stay on paged.py,
    and the launcher refuses them."""
    assert config.gluon_page_ok(page) is ok
    monkeypatch.setattr(config, "hopper", lambda *a: True)
    assert config.paged_uses_gluon(128, torch.bfloat16, page, 512, 1000, num_sms_=132) is ok
    if not ok:
        cache = torch.empty(4, page, 1, 128, dtype=torch.bfloat16)
        q = torch.empty(8, 1, 128, dtype=torch.bfloat16)
        cu = torch.tensor([0, 8], dtype=torch.int32)
        with pytest.raises(ValueError, match="do not tile"):
            hopper.launch_paged(q.view(8, -1), cache, cache, q, cu.view(1, 2), cu, cu[1:], 8, 1, 1.0)


def test_paged_gate(monkeypatch):
    monkeypatch.setattr(config, "hopper", lambda *a: True)
    ok = dict(num_tokens=512 * 16, num_requests=16, num_sms_=132)
    assert config.paged_uses_gluon(128, torch.bfloat16, 16, 512, 4 * 32 * 16, **ok)  # C1
    assert not config.paged_uses_gluon(64, torch.bfloat16, 16, 512, 2048, **ok)  # head dim
    assert not config.paged_uses_gluon(128, torch.float32, 16, 512, 2048, **ok)  # dtype
    assert not config.paged_uses_gluon(128, torch.bfloat16, 16, 127, 2048, **ok)  # no full query tile
    assert not config.paged_uses_gluon(128, torch.bfloat16, 16, 512, 131, **ok)  # less than a wave
    # one chunk among many short verifications: packed by paged.py instead
    assert not config.paged_uses_gluon(
        128, torch.bfloat16, 16, 128, 40 * 32, num_tokens=128 + 39 * 6, num_requests=40, num_sms_=132
    )
    monkeypatch.setattr(config, "hopper", lambda *a: False)
    assert not config.paged_uses_gluon(128, torch.bfloat16, 16, 512, 2048, **ok)  # not sm_90


@pytest.mark.parametrize("stages,block_n", [(1, 128), (4, 128), (3, 32)])
def test_pipeline_depth_is_checked(stages, block_n):
    """One stage deadlocks, four overflow shared memory: refused before launching."""
    x = torch.empty(8, 1, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="stages must be 2 or 3"):
        hopper.launch_prefill(x.view(8, -1), x.view(8, -1), x.view(8, -1), x, cu, 8, 1, 1.0, stages=stages,
                              block_n=block_n)  # fmt: skip
