"""`paged_attention` (Triton) against its PyTorch twin.

One launch mixes decode (q_len 1), verification (a few tokens), chunked prefill over a cached
prefix, a fresh prompt (q_len == kv_len) and an empty request. Outputs are poisoned with NaN
before each call, block tables are random permutations with unused columns pointing at blocks
of random data, and cache rows past a request's end hold random data too: reading anything the
request does not own changes the answer.

CPU sizes are small (the interpreter runs every program in Python); the GPU cases at the end
run real shapes.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import (
    DTYPES,
    PagedBatch,
    assert_close,
    count_planned_launches,
    make_paged_batch,
    poisoned,
    tolerance,
)
from tilellm.kernels import reference as ref
from tilellm.kernels import schedule
from tilellm.kernels.schedule import plan_split_kv

GQA = [(4, 4), (8, 4), (8, 2), (5, 1), (10, 2), (32, 1)]  # the last: more heads per group than tile rows
# decode, verify, chunked prefill over a prefix, empty request, fresh prompt
MIXED = [(1, 75), (5, 18), (23, 41), (0, 7), (16, 16)]


def run_and_check(b: PagedBatch, device: str, what: str, **kw) -> torch.Tensor:
    out = poisoned(b.q)
    o = tk.paged_attention(*b.args(), out=out, **kw)
    assert o is out
    expected = ref.paged_attention(*b.args(), scale=kw.get("scale"))
    assert_close(o, expected, tolerance(b.q.dtype, device), what)
    return o


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_mixed_batch_gqa(heads, dtype, device):
    b = make_paged_batch(MIXED, *heads, 32, 16, dtype, device, seed=heads[0] * 10 + heads[1])
    run_and_check(b, device, f"heads={heads} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_head_dims(head_dim, dtype, device):
    pairs = [(1, 40), (6, 23)] if head_dim >= 128 else [(1, 40), (6, 23), (17, 17)]
    b = make_paged_batch(pairs, 4, 2, head_dim, 16, dtype, device, seed=head_dim)
    run_and_check(b, device, f"D={head_dim}")


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
def test_block_sizes_around_boundaries(block_size, device):
    bs = block_size
    pairs = [(1, 1), (1, max(bs - 1, 1)), (min(2, bs), bs), (2, bs + 1), (3, 2 * bs + 3), (5, 31)]
    b = make_paged_batch(pairs, 8, 2, 32, bs, torch.float32, device, seed=bs)
    run_and_check(b, device, f"block_size={bs}")


@pytest.mark.parametrize(
    "num_splits, dtype",
    [(1, torch.float32), (1, torch.float16), (3, torch.float16)],
    ids=["1-fp32", "1-fp16", "3-fp16"],
)
def test_k_gathered_as_rows(num_splits, dtype, device):
    """The K-as-rows gather (`TileConfig.k_rows`, a tile-table option) gives the same answer.

    Both dtypes on one segment, and 3 segments in fp16: the gather's addresses do not depend on
    the dtype, so fp32 with 3 segments repeated a covered path."""
    from tilellm.kernels import config

    b = make_paged_batch(MIXED, 8, 2, 32, 16, dtype, device, seed=11)
    with config.override(paged=config.TileConfig(32, 16, 4, 1, k_rows=True)):
        assert config.paged_config(32, dtype, 4, 23)[0].k_rows  # the option reaches the launch
        run_and_check(b, device, f"k_rows splits={num_splits}", num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("tiles_fastest", [False, True])
def test_both_launch_orders(tiles_fastest, num_splits, device):
    """Query tiles fastest (the default when a request has several) or KV heads fastest: the grid's
    order changes which programs run together, never the answer."""
    b = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float16, device, seed=12)
    out = poisoned(b.q)
    split = schedule.choose_num_splits(b.seq_lens.numel(), b.k_cache.shape[2], 1, None, num_splits=num_splits)
    plan = schedule.PagedPlan("triton", split, tiles_first=tiles_fastest)
    tk.paged_attention(*b.args(), num_splits=plan, out=out)
    expected = ref.paged_attention(*b.args())
    assert_close(out, expected, tolerance(b.q.dtype, device), f"tiles_fastest={tiles_fastest}")


def test_prime_lengths(device):
    b = make_paged_batch([(3, 37), (1, 101), (7, 53), (2, 2)], 10, 2, 32, 16, torch.float16, device, seed=5)
    run_and_check(b, device, "primes")


def test_vllm_style_batch(device):
    """The classic mix: long decode, short verify, a chunk of 129 tokens over a 334-token prefix."""
    b = make_paged_batch([(1, 1328), (5, 18), (129, 463)], 1, 1, 16, 16, torch.float16, device, seed=6)
    run_and_check(b, device, "vllm pairs")


_PLANNED: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the planned count's output


@pytest.mark.parametrize("num_splits", [1, 2, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_splits_agree(num_splits, dtype, device):
    """Forced split-KV counts give the reference's answer and agree with the planned count."""
    b = make_paged_batch([(1, 150), (4, 37), (9, 9)], 8, 2, 32, 16, dtype, device, seed=7)
    o = run_and_check(b, device, f"num_splits={num_splits}", num_splits=num_splits)
    # The batch is the same for every num_splits: the planned launch runs once per dtype.
    if (dtype, device) not in _PLANNED:
        _PLANNED[dtype, device] = tk.paged_attention(*b.args())
    assert_close(o, _PLANNED[dtype, device], tolerance(dtype, device), f"num_splits={num_splits} vs None")


def test_heuristic_split_on_long_context(device):
    """num_splits=None splits one long request (few programs, long context) and stays correct."""
    pairs = [(1, 3 * schedule.MIN_KEYS_PER_SPLIT + 37), (2, 40)]
    b = make_paged_batch(pairs, 4, 1, 32, 16, torch.float32, device, seed=8)
    plan = plan_split_kv(b.cu_seqlens_q, b.seq_lens, 4, 1, head_dim=32, dtype=torch.float32)
    assert plan.num_splits > 1, plan.reason
    run_and_check(b, device, "num_splits=None (split)")


def test_host_planned_split(device):
    """The engine passes a SplitPlan made on the host (no sync); the kernel uses it as is."""
    pairs = [(1, 150), (4, 37), (9, 9)]
    b = make_paged_batch(pairs, 8, 2, 32, 16, torch.float32, device, seed=14)
    plan = plan_split_kv(
        [0, 1, 5, 14], [kv for _, kv in pairs], 8, 2, head_dim=32, dtype=torch.float32, num_splits=3
    )
    run_and_check(b, device, "SplitPlan(3)", num_splits=plan, max_seqlen_k=150)


def test_large_scores(device):
    """Scores in the hundreds: the online softmax must rescale, not overflow exp."""
    b = make_paged_batch([(1, 75), (5, 18), (23, 41)], 4, 1, 32, 16, torch.float32, device, seed=15)
    b.q = b.q * 30
    run_and_check(b, device, "large scores")
    run_and_check(b, device, "large scores, split", num_splits=3)


def test_custom_scale(device):
    b = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, device, seed=9)
    run_and_check(b, device, "scale=0.3", scale=0.3)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_strided_q_and_out(num_splits, device):
    """q as a view of a fused qkv projection, out as a view of a wider buffer (also through the merge)."""
    b = make_paged_batch([(1, 75), (5, 18), (23, 41), (0, 7)], 8, 2, 32, 16, torch.float32, device, seed=10)
    T = b.q.shape[0]
    qkv = torch.randn(T, 12, 32, device=device)
    qkv[:, :8] = b.q
    q = qkv[:, :8]
    wide = torch.full((T, 12, 32), float("nan"), device=device)
    out = wide[:, 2:10]
    strided = PagedBatch(
        q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q, b.pairs
    )
    o = tk.paged_attention(*strided.args(), out=out, num_splits=num_splits)
    assert_close(o, ref.paged_attention(*b.args()), tolerance(torch.float32, device), "strided")
    assert torch.isnan(wide[:, :2]).all() and torch.isnan(wide[:, 10:]).all(), "wrote outside out's view"


def test_inputs_unchanged(device):
    b = make_paged_batch([(1, 30), (4, 20)], 8, 2, 16, 16, torch.float32, device, seed=11)
    before = [t.clone() for t in b.args()[:6]]
    tk.paged_attention(*b.args(), num_splits=2)
    for t, t0 in zip(b.args()[:6], before):
        assert torch.equal(t, t0)


def test_no_tokens(device):
    b = make_paged_batch([(0, 5), (0, 9)], 4, 2, 16, 16, torch.float32, device)
    assert tk.paged_attention(*b.args()).shape == (0, 4, 16)


def test_max_seqlen_q_larger_than_needed(device):
    """A generous max_seqlen_q (e.g. the scheduler's budget) only adds empty programs."""
    b = make_paged_batch([(3, 20), (1, 9)], 8, 2, 16, 16, torch.float32, device, seed=12)
    b.max_seqlen_q = 40
    run_and_check(b, device, "max_seqlen_q=40")


def test_block_ids_past_int32_offsets(device):
    """Block ids so large that `block_id * stride(0)` overflows int32 (2^31 elements).

    The cache is a 4 GiB `torch.empty`: only the used blocks near its top are ever written, so
    on CPU it costs address space, not memory. A kernel doing the offset in int32 reads the
    wrong rows (or faults).
    """
    block_size, Hkv, D = 16, 2, 64
    first = (1 << 31) // (block_size * Hkv * D) + 8  # the first used block starts past 2^31 elements
    b = make_paged_batch(
        [(1, 40), (3, 21)], 4, Hkv, D, block_size, torch.float16, device, seed=13, first_block=first
    )
    assert b.block_table.min() * b.k_cache.stride(0) >= 2**31
    run_and_check(b, device, "huge block ids")
    run_and_check(b, device, "huge block ids, split", num_splits=2)


# ----------------------------------------------------------------------------------------------
# GPU only: real shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_gpu_real_shapes(block_size, dtype, num_splits, device):
    pairs = [(1, 8191), (1, 17), (7, 3000), (512, 1024), (300, 300), (64, 4097)]
    b = make_paged_batch(pairs, 32, 8, 128, block_size, dtype, device, seed=block_size)
    run_and_check(b, device, f"gpu bs={block_size}", num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", GQA + [(64, 8), (16, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_gqa_head_dims(heads, head_dim, device):
    b = make_paged_batch([(1, 2000), (4, 513), (200, 700)], *heads, head_dim, 16, torch.bfloat16, device)
    run_and_check(b, device, f"gpu heads={heads} D={head_dim}")


@pytest.mark.gpu
def test_gpu_long_single_decode_splits(device):
    b = make_paged_batch([(1, 131072)], 32, 8, 128, 16, torch.bfloat16, device, seed=3)
    plan = plan_split_kv(b.cu_seqlens_q, b.seq_lens, 32, 8, head_dim=128, dtype=torch.bfloat16)
    assert plan.num_splits > 1, plan.reason
    run_and_check(b, device, "131072-token decode")


def test_forced_decode_tile_keeps_its_rows(device):
    """A forced 64-row tile stays 64 rows on a decode batch of GQA group 2 (rows past the group
    masked), and gives the twin's answer; unforced decode tiles keep 16 rows."""
    from tilellm.kernels import config

    assert config.paged_config(32, torch.float16, 2, 1)[0].block_m == 16
    b = make_paged_batch([(1, 75), (1, 18), (1, 1), (1, 40)], 4, 2, 32, 16, torch.float16, device, seed=13)
    with config.override(paged=config.TileConfig(64, 16, 4, 1)):
        assert config.paged_config(32, torch.float16, 2, 1)[0].block_m == 64
        run_and_check(b, device, "64-row decode tile")


# -- eager calls remember their launch per layout --


@pytest.fixture
def remembered_launches(monkeypatch):
    """Counts the calls that plan their launch (`paged._launch`; `helpers.count_planned_launches`)."""
    from tilellm.kernels import paged

    yield count_planned_launches(monkeypatch, paged)
    paged.clear_plans()


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_a_layout_seen_before_runs_its_remembered_launch(num_splits, remembered_launches, device):
    """A second call with new tensors of the same layout (shapes, strides, dtypes, device) and
    the same scalar arguments skips the planning and gives the twin's answer; another layout
    plans again."""
    kw = dict(num_splits=num_splits, max_seqlen_k=41)  # (on the CPU, no max_seqlen_k plans from seq_lens)
    for seed in (1, 2):
        b = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, device, seed=seed)
        run_and_check(b, device, f"seed {seed}", **kw)
    assert remembered_launches == [1]
    b = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, device, seed=3)
    run_and_check(b, device, "a strided q", **kw)  # the same layout again
    q = torch.empty(b.q.shape[0], b.q.shape[1] + 3, b.q.shape[2], device=device)[:, 2:-1]
    q.copy_(b.q)
    b.q = q
    run_and_check(b, device, "a strided q", **kw)
    run_and_check(b, device, "another scale", scale=0.3, **kw)
    assert remembered_launches == [1, 1, 1]


def test_a_remembered_layout_still_rejects_bad_arguments(remembered_launches, device):
    """The remembered launch is found by the arguments' layout and their scalars' types and
    values too: a call that differs in any of them is checked again."""
    b = make_paged_batch([(1, 30), (2, 17)], 4, 2, 32, 16, torch.float32, device, seed=4)
    tk.paged_attention(*b.args(), num_splits=1, max_seqlen_k=30)
    with pytest.raises(ValueError, match="num_splits must be an int"):
        tk.paged_attention(*b.args(), num_splits=True, max_seqlen_k=30)
    with pytest.raises(ValueError, match="scale must be finite"):
        tk.paged_attention(*b.args(), num_splits=1, max_seqlen_k=30, scale=float("nan"))
    with pytest.raises(ValueError, match="block_table"):
        tk.paged_attention(
            *b.args()[:3], b.block_table.to(torch.int64), *b.args()[4:], num_splits=1, max_seqlen_k=30
        )


def test_remembered_decode_calls(remembered_launches, device):
    """`decode_attention` remembers its launches too: split (with the merge of its partials) and not."""
    for num_splits in (1, 2):
        for seed in (5, 6):
            b = make_paged_batch([(1, 40), (1, 9), (1, 33)], 8, 2, 32, 16, torch.float32, device, seed=seed)
            args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
            out = tk.decode_attention(*args, num_splits=num_splits, max_seqlen_k=40)
            assert_close(
                out, ref.decode_attention(*args), tolerance(b.q.dtype, device), f"{num_splits} splits"
            )
    assert remembered_launches == [1, 1]
