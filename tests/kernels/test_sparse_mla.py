"""Sparse MLA (`tilellm.kernels.sparse_mla`, Triton) against its PyTorch twin, and the twin
against dense MLA.

The cache is MLA's latent cache (one KV head of kv_lora_rank + rope_dim values); each token
attends to the positions of its row of `topk_indices` only. Shapes are tiny DeepSeek-like ones
(32/16 and 48/8: both parts padded, one to a non-power of two) so the interpreter stays fast;
the GPU cases at the end run DeepSeek's 512/64 at 16 and 128 heads in bf16. As in test_mla.py,
outputs are poisoned with NaN, block tables are random permutations whose unused columns point
at blocks of random data, and every block holds random data: a row read from the wrong place
changes the answer. Index rows list distinct causal positions in random order with -1 entries
anywhere (`helpers.sparse_indices`).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import assert_close, make_paged_batch, poisoned, sparse_indices, tolerance
from tilellm.kernels import sparse_mla, validation
from tilellm.kernels.reference import mla as ref_mla
from tilellm.kernels.reference import sparse_mla as ref

DIMS = [(32, 16), (48, 8)]  # (kv_lora_rank, rope_dim)
SCALE = 0.15
PAIRS = {1: [(9, 30)], 3: [(1, 37), (4, 20), (9, 40)]}  # (q_len, kv_len) per request


def make(pairs, heads, dims, device, block_size=16, dtype=torch.float32, seed=0, **kw):
    """A batch over a latent cache: `make_paged_batch` with one KV head of kv_lora_rank + rope_dim."""
    lora, rope = dims
    return make_paged_batch(pairs, heads, 1, lora + rope, block_size, dtype, device, seed=seed, **kw)


def indices(b, num_k, seed=0, **kw):
    return sparse_indices(b.pairs, num_k, torch.Generator().manual_seed(seed), **kw).to(b.q.device)


def args(b, topk):
    return b.q, b.k_cache, b.block_table, b.cu_seqlens_q, topk, b.seq_lens


def check(b, topk, lora, device, what, plan=None):
    """Triton (into a poisoned `out`) against the twin; returns the Triton output."""
    out = poisoned(torch.empty(b.q.shape[0], b.q.shape[1], lora, dtype=b.q.dtype, device=b.q.device))
    o = sparse_mla.sparse_mla_attention(*args(b, topk), kv_lora_rank=lora, scale=SCALE, out=out, plan=plan)
    assert o is out
    expected = ref.sparse_mla_attention(*args(b, topk), kv_lora_rank=lora, scale=SCALE)
    assert_close(o, expected, tolerance(b.q.dtype, device), what)
    return o


def forced(b, dims, num_k, num_splits, config=None):
    lora, rope = dims
    return sparse_mla.plan_sparse_mla(
        b.q.shape[0], b.q.shape[1], num_k, b.q.dtype, kv_lora_rank=lora, rope_dim=rope,
        num_splits=num_splits, config=config,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Triton against the twin
# ----------------------------------------------------------------------------------------------

# (requests, dims, heads, block_size): every value of each axis, not their full product
CASES = [
    (3, DIMS[0], 1, 16),
    (3, DIMS[1], 4, 1),
    (3, DIMS[1], 16, 16),
    (1, DIMS[0], 16, 1),
    (1, DIMS[1], 1, 16),
    (1, DIMS[0], 4, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-{c[1][0]}+{c[1][1]}-H{c[2]}-page{c[3]}")
def test_matches_twin(case, device):
    """K below every context (a real selection) and above every context (-1 padding), one token
    with no valid entry (zeros)."""
    batch, dims, heads, block_size = case
    b = make(PAIRS[batch], heads, dims, device, block_size=block_size, seed=heads + block_size)
    for num_k in (8, 48):
        topk = indices(b, num_k, seed=num_k, empty_rows=(1,))
        o = check(b, topk, dims[0], device, f"{case} K={num_k}")
        assert bool((o[1] == 0).all()), "a token whose entries are all -1 must output zeros"


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k(num_splits, device):
    """Forced segments of the index list, merged; with 5 segments of 16 entries over K = 40 the
    last two segments are empty, and token 0 has no valid entry at all."""
    b = make(PAIRS[3], 4, DIMS[1], device, seed=3)
    topk = indices(b, 40, seed=4, empty_rows=(0,))
    o = check(b, topk, DIMS[1][0], device, f"splits={num_splits}", plan=forced(b, DIMS[1], 40, num_splits))
    assert bool((o[0] == 0).all())


@pytest.mark.parametrize("num_splits", [1, 2])
def test_value_halves(num_splits, device):
    """Two programs per chunk, each accumulating half of the (padded) value dims."""
    cfg = sparse_mla.SparseMlaConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, value_splits=2)
    b = make(PAIRS[3], 4, DIMS[1], device, seed=5)
    topk = indices(b, 24, seed=6)
    check(
        b,
        topk,
        DIMS[1][0],
        device,
        f"value halves splits={num_splits}",
        forced(b, DIMS[1], 24, num_splits, cfg),
    )


def test_head_tiles(device):
    """More heads than a tile holds: 20 heads in tiles of 8 (two full, one of 4)."""
    cfg = sparse_mla.SparseMlaConfig(block_h=8, block_n=16, num_warps=4, num_stages=1)
    b = make([(2, 19), (1, 33)], 20, DIMS[0], device, seed=7)
    topk = indices(b, 20, seed=8)
    check(b, topk, DIMS[0][0], device, "head tiles", forced(b, DIMS[0], 20, 1, cfg))


def test_out_of_range_entries_are_skipped(device, monkeypatch):
    """With the value checks off (the GPU without TILELLM_DEBUG=1), entries below -1, future
    positions and positions past seq_lens count as empty, in both twins."""
    monkeypatch.setattr(validation, "deep_checks_enabled", lambda t: False)
    b = make(PAIRS[3], 4, DIMS[0], device, seed=9)
    topk = indices(b, 24, seed=10).cpu()
    dirty, t = topk.clone(), 0
    for q_len, kv_len in b.pairs:
        for j in range(q_len):
            pos = kv_len - q_len + j
            bad = torch.tensor([-7, pos + 1, kv_len, 10_000], dtype=torch.int32)
            empty = (topk[t] == -1).nonzero().flatten()
            assert len(empty) >= 2
            dirty[t, empty] = bad[torch.arange(len(empty)) % 4]
            t += 1
    expected = ref.sparse_mla_attention(*args(b, topk.to(device)), kv_lora_rank=32, scale=SCALE)
    for impl in (ref, sparse_mla):
        got = impl.sparse_mla_attention(*args(b, dirty.to(device)), kv_lora_rank=32, scale=SCALE)
        assert_close(
            got, expected, tolerance(torch.float32, device), f"{impl.__name__}: out-of-range entries"
        )


def test_no_tokens_and_no_indices(device):
    b = make([(0, 5), (2, 9)], 4, DIMS[0], device, seed=11)
    empty = make([(0, 5)], 4, DIMS[0], device, seed=11)
    o = sparse_mla.sparse_mla_attention(*args(empty, indices(empty, 8)), kv_lora_rank=32, scale=SCALE)
    assert o.shape == (0, 4, 32)
    topk = torch.empty(2, 0, dtype=torch.int32, device=device)
    for impl in (ref, sparse_mla):
        o = impl.sparse_mla_attention(*args(b, topk), kv_lora_rank=32, scale=SCALE)
        assert bool((o == 0).all()), f"{impl.__name__}: K = 0 must give zeros"


def test_strided_q_and_out(device):
    """q a view with padded heads, out a view into a wider buffer: only out's elements written."""
    b = make(PAIRS[3], 4, DIMS[0], device, seed=12)
    topk = indices(b, 16, seed=13)
    expected = ref.sparse_mla_attention(*args(b, topk), kv_lora_rank=32, scale=SCALE)
    T, H, W = b.q.shape
    wide_q = torch.randn(T, H + 3, W + 8, device=device)
    wide_q[:, 1 : H + 1, :W] = b.q
    b.q = wide_q[:, 1 : H + 1, :W]
    wide_o = torch.full((T, H + 2, 40), float("nan"), device=device)
    out = wide_o[:, 2:, 4:36]
    sparse_mla.sparse_mla_attention(*args(b, topk), kv_lora_rank=32, scale=SCALE, out=out,
                                    plan=forced(b, DIMS[0], 16, 2))  # fmt: skip
    assert_close(out, expected, tolerance(torch.float32, device), "strided q / out")
    wide_o[:, 2:, 4:36] = 0.0
    assert torch.isnan(wide_o).sum() == wide_o.numel() - out.numel(), "wrote outside out's view"


def test_inputs_unchanged(device):
    b = make(PAIRS[3], 4, DIMS[0], device, seed=14)
    topk = indices(b, 16, seed=15)
    before = [t.clone() for t in args(b, topk)]
    sparse_mla.sparse_mla_attention(
        *args(b, topk), kv_lora_rank=32, scale=SCALE, plan=forced(b, DIMS[0], 16, 2)
    )
    ref.sparse_mla_attention(*args(b, topk), kv_lora_rank=32, scale=SCALE)
    for t, t0 in zip(args(b, topk), before):
        assert torch.equal(t, t0)


def test_block_ids_past_int32_offsets(device):
    """Block ids whose `block * stride(0)` passes 2^31 elements (a 4 GiB torch.empty cache, only
    its top blocks written): int32 offsets would read the wrong rows."""
    lora, rope = DIMS[1]
    first = (1 << 31) // (16 * (lora + rope)) + 8
    b = make(
        [(1, 40), (3, 21)],
        4,
        DIMS[1],
        device,
        dtype=torch.float16,
        seed=16,
        first_block=first,
        spare_blocks=1,
    )
    assert b.block_table.min() * b.k_cache.stride(0) >= 2**31
    check(b, indices(b, 16, seed=17), lora, device, "huge block ids")


# ----------------------------------------------------------------------------------------------
# The twin against dense MLA
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [1, 16])
def test_every_causal_key_is_dense_mla(heads, block_size, device):
    """Every causal key selected (in random order, -1 padding past the token's keys): the twin
    equals dense causal MLA to fp32 rounding; the kernel equals it to its tolerance."""
    dims = DIMS[1]
    b = make(PAIRS[3] + [(0, 3), (2, 2)], heads, dims, device, block_size=block_size, seed=18)
    num_k = 43
    rows, gen = [], torch.Generator().manual_seed(19)
    for q_len, kv_len in b.pairs:
        for j in range(q_len):
            row = torch.full((num_k,), -1, dtype=torch.int32)
            row[: kv_len - q_len + j + 1] = torch.arange(kv_len - q_len + j + 1, dtype=torch.int32)
            rows.append(row[torch.randperm(num_k, generator=gen)])
    topk = torch.stack(rows).to(device)
    dense = ref_mla.mla_paged_attention(
        b.q,
        b.k_cache,
        b.block_table,
        b.cu_seqlens_q,
        b.seq_lens,
        b.max_seqlen_q,
        kv_lora_rank=dims[0],
        scale=SCALE,
    )
    twin = ref.sparse_mla_attention(*args(b, topk), kv_lora_rank=dims[0], scale=SCALE)
    assert_close(twin, dense, 1e-6, "twin vs dense MLA")
    kernel = sparse_mla.sparse_mla_attention(*args(b, topk), kv_lora_rank=dims[0], scale=SCALE)
    assert_close(kernel, dense, tolerance(torch.float32, device), "kernel vs dense MLA")


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------


def test_plan_rules():
    bf16 = torch.bfloat16
    kw = dict(kv_lora_rank=512, rope_dim=64, num_sms_=132, config=sparse_mla.WIDE)
    # decode of 64 requests at 128 heads: 64 x 2 head tiles = 128 programs fill 132 SMs
    p = sparse_mla.plan_sparse_mla(64, 128, 2048, bf16, **kw)
    assert (p.num_splits, p.programs) == (1, 128), p.reason
    # 16 heads in value halves: 64 x 2 = 128 programs, no split
    p = sparse_mla.plan_sparse_mla(64, 16, 2048, bf16, **{**kw, "config": sparse_mla.NARROW})
    assert (p.num_splits, p.programs) == (1, 128), p.reason
    # a 16-head tile in one piece: 64 programs, split in 2 (whole waves: 3 would make 192 of 132)
    one_piece = sparse_mla.SparseMlaConfig(block_h=16, block_n=64, num_warps=4, num_stages=2)
    p = sparse_mla.plan_sparse_mla(64, 16, 2048, bf16, **{**kw, "config": one_piece})
    assert (p.num_splits, p.programs) == (2, 64), p.reason
    # 8 tokens at 16 heads: 16 would fill the SMs, but segments hold >= 256 of the 2048 entries
    p = sparse_mla.plan_sparse_mla(8, 16, 2048, bf16, **{**kw, "config": sparse_mla.NARROW})
    assert p.num_splits == 8, p.reason
    # a 64-row tile's partial costs more: segments of >= 960 entries, so at most 2 of 2048
    p = sparse_mla.plan_sparse_mla(4, 128, 2048, bf16, **kw)
    assert p.num_splits == 2, p.reason
    # short index lists never split; a forced count is used as is
    assert sparse_mla.plan_sparse_mla(1, 16, 300, bf16, **{**kw, "config": sparse_mla.NARROW}).num_splits == 1
    assert sparse_mla.plan_sparse_mla(1, 16, 300, bf16, num_splits=7, **kw).num_splits == 7
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
        sparse_mla.plan_sparse_mla(1, 16, 300, bf16, num_splits=0, **kw)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        sparse_mla.SparseMlaConfig(block_h=16, block_n=24, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _bad_cases():
    b = make([(1, 20), (2, 9)], 4, DIMS[0], "cpu", seed=25)
    topk = indices(b, 8)
    q, kv, bt, cu, tk, seq = args(b, topk)
    future = topk.clone()
    future[2, 3] = 9  # token 2 (request 1, 2 new tokens of 9) sits at position 8
    below = topk.clone()
    below[1, 0] = -2
    return [
        ("q_rank", dict(q=q[0]), "q must be 3-D [T, H, kv_lora_rank + rope_dim]"),
        ("topk_rank", dict(topk_indices=tk[0]), "topk_indices must be 2-D [T, K]"),
        ("topk_int64", dict(topk_indices=tk.long()), "topk_indices must be int32"),
        ("topk_rows", dict(topk_indices=tk[:2].contiguous()), "must have one row per query token (T = 3)"),
        ("topk_strided", dict(topk_indices=tk.repeat(1, 2)[:, ::2]), "topk_indices must be contiguous"),
        ("topk_below", dict(topk_indices=below), "topk_indices[1, 0] = -2 is negative"),
        ("topk_future", dict(topk_indices=future), "topk_indices[2, 3] = 9 is a future position"),
        ("cache_heads", dict(kv_cache=kv.expand(-1, -1, 2, -1).contiguous()), "must have one KV head"),
        ("rope_zero", dict(kv_lora_rank=48), "rope_dim = 0"),
        ("scale_none", dict(scale=None), "scale is required"),
        ("table_int64", dict(block_table=bt.long()), "block_table must be int32"),
        ("cu_len", dict(cu_seqlens_q=cu[:-1]), "cu_seqlens_q must have B+1 = 3 entries"),
        ("seq_len", dict(seq_lens=seq[:1]), "seq_lens must have B = 2 entries"),
        ("seq_short", dict(seq_lens=torch.tensor([20, 1], dtype=torch.int32)), "seq_lens[1] = 1 is smaller"),
        ("table_range", dict(block_table=bt.clone().fill_(999)), "out of range"),
        ("dtype", dict(kv_cache=kv.half()), "kv_cache must have q's dtype torch.float32 or float8_e4m3fn"),
        ("out_shape", dict(out=torch.empty(3, 4, 48)), "out must have shape (3, 4, 32)"),
    ]  # fmt: skip


@pytest.mark.parametrize("impl", [sparse_mla, ref], ids=["triton", "reference"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_errors(case, impl):
    _, change, message = case
    b = make([(1, 20), (2, 9)], 4, DIMS[0], "cpu", seed=25)
    topk = indices(b, 8)
    a = dict(zip(["q", "kv_cache", "block_table", "cu_seqlens_q", "topk_indices", "seq_lens"], args(b, topk)))
    kw = dict(kv_lora_rank=32, scale=SCALE)
    for key, value in change.items():
        (a if key in a else kw)[key] = value
    with pytest.raises(ValueError, match="^sparse_mla_attention: ") as e:
        impl.sparse_mla_attention(*a.values(), **kw)
    assert message in str(e.value)


def test_plan_type_error():
    b = make([(1, 20)], 4, DIMS[0], "cpu", seed=26)
    with pytest.raises(ValueError, match="sparse_mla_attention: plan must be a SparseMlaPlan or None"):
        sparse_mla.sparse_mla_attention(*args(b, indices(b, 8)), kv_lora_rank=32, scale=SCALE, plan=2)


# ----------------------------------------------------------------------------------------------
# GPU only: DeepSeek's shapes in bf16, CUDA graphs
# ----------------------------------------------------------------------------------------------

DEEPSEEK = (512, 64)
# the table's pick, 64-head tiles in value halves, 16-head tiles in value halves, 32-head tiles
GPU_CONFIGS = [
    None,
    sparse_mla.SparseMlaConfig(64, 32, 8, 3, value_splits=2),
    sparse_mla.SparseMlaConfig(16, 32, 4, 3, value_splits=2),
    sparse_mla.SparseMlaConfig(32, 64, 4, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_gpu_deepseek(config, num_splits, heads, device):
    pairs = [(1, 5000), (1, 63), (2, 2100), (130, 700), (0, 9), (1, 1)]
    b = make(pairs, heads, DEEPSEEK, device, block_size=64, dtype=torch.bfloat16)
    topk = indices(b, 2048, seed=27, empty_rows=(3,), pad=0.05)
    plan = None
    if config is not None or num_splits is not None:
        config = config or sparse_mla.sparse_mla_config(512, torch.bfloat16, heads)
        plan = forced(b, DEEPSEEK, 2048, num_splits, config)
    check(b, topk, 512, device, f"gpu H={heads} splits={num_splits} {config}", plan)


@pytest.mark.gpu
def test_gpu_cuda_graph(device):
    """sparse_mla_attention as called (planned from shapes) captures and replays in a graph."""
    b = make([(1, n) for n in (5000, 17, 900, 1)], 16, DEEPSEEK, device, block_size=64, dtype=torch.bfloat16)
    topk = indices(b, 2048, seed=28)
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16, device=device)

    def step():
        sparse_mla.sparse_mla_attention(*args(b, topk), kv_lora_rank=512, scale=SCALE, out=out)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = ref.sparse_mla_attention(*args(b, topk), kv_lora_rank=512, scale=SCALE)
    assert_close(out, expected, tolerance(torch.bfloat16, device), "graph replay")


# ----------------------------------------------------------------------------------------------
# The benchmark's inputs (tilellm.bench.sparse_mla runs on a GPU only)
# ----------------------------------------------------------------------------------------------


def test_bench_indices_and_cpu_error(monkeypatch):
    """S3's rule on a small shape: token j selects every key 0..j while j < K, else K distinct
    keys <= j; and on a machine without CUDA the command stops with a one-line usage error."""
    import argparse

    from tilellm.bench import sparse_mla as bench
    from tilellm.commands.common import UsageError

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    w = bench.Workload("tiny", 4, 2, 40, q_len=30, topk=16)
    topk = bench.make_topk(w, torch.Generator().manual_seed(0))
    assert topk.shape == (60, 16) and topk.dtype == torch.int32
    for t, row in enumerate(topk.tolist()):
        pos = 10 + t % 30
        picked = [x for x in row if x >= 0]
        assert len(set(picked)) == len(picked) == min(pos + 1, 16)
        assert max(picked) <= pos and row[: len(picked)] == picked  # -1 only after the picks
    if not torch.cuda.is_available():
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        with pytest.raises(UsageError, match="needs|CUDA GPU"):
            bench.main(p.parse_args(["--workloads", "S2"]))
