"""MLA over a paged latent cache (`tilellm.kernels.mla`, Triton) against its PyTorch twin.

The cache rows are `[c, k_pe]` (kv_lora_rank + rope_dim values, one KV head); the queries are
absorbed. Shapes are tiny DeepSeek-like ones (kv_lora_rank / rope_dim 32/16 and 48/8: both
parts padded, one of them to a non-power of two) so the interpreter stays fast; the GPU cases at
the end run DeepSeek's 512/64 with 16-128 heads in bf16. As in test_paged.py, outputs are
poisoned with NaN, block tables are random permutations whose unused columns point at blocks of
random data, and rows past a request's end hold random data: reading anything a request does not
own changes the answer. `test_absorption_matches_up_projected_attention` checks the algebra the
engine relies on: absorbed attention, projected by W_UV, is attention over up-projected keys and
values.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.helpers import assert_close, make_paged_batch, poisoned, tolerance
from tilellm.kernels import mla
from tilellm.kernels.reference import mla as ref

DIMS = [(32, 16), (48, 8)]  # (kv_lora_rank, rope_dim)
SCALE = 0.15
# decode, verify, a chunk crossing blocks, an empty request, a fresh one-token prompt
MIXED = [(1, 37), (3, 20), (17, 40), (0, 7), (1, 1)]


def make(pairs, heads, dims, device, block_size=16, dtype=torch.float32, seed=0, **kw):
    """A batch over a latent cache: `make_paged_batch` with one KV head of kv_lora_rank + rope_dim."""
    lora, rope = dims
    return make_paged_batch(pairs, heads, 1, lora + rope, block_size, dtype, device, seed=seed, **kw)


def paged_args(b):
    return b.q, b.k_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q


def decode_args(b):
    return b.q, b.k_cache, b.block_table, b.seq_lens


def out_like(b, lora):
    return poisoned(torch.empty(b.q.shape[0], b.q.shape[1], lora, dtype=b.q.dtype, device=b.q.device))


def check_paged(b, lora, device, what, **kw):
    out = out_like(b, lora)
    o = mla.mla_paged_attention(*paged_args(b), kv_lora_rank=lora, scale=SCALE, out=out, **kw)
    assert o is out
    expected = ref.mla_paged_attention(*paged_args(b), kv_lora_rank=lora, scale=SCALE)
    assert_close(o, expected, tolerance(b.q.dtype, device), what)
    return o


def check_decode(b, lora, device, what, **kw):
    out = out_like(b, lora)
    o = mla.mla_decode_attention(*decode_args(b), kv_lora_rank=lora, scale=SCALE, out=out, **kw)
    assert o is out
    expected = ref.mla_decode_attention(*decode_args(b), kv_lora_rank=lora, scale=SCALE)
    assert_close(o, expected, tolerance(b.q.dtype, device), what)
    return o


def forced(b, dims, config, num_splits):
    """A host plan with a given tile config (the bench's sweep passes plans the same way)."""
    lora, rope = dims
    return mla.plan_mla(
        b.seq_lens.numel(), b.q.shape[1], max(b.max_seqlen_q, 1), 64, b.q.dtype, b.k_cache.shape[1],
        kv_lora_rank=lora, rope_dim=rope, num_splits=num_splits, config=config,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}+{d[1]}")
@pytest.mark.parametrize("heads", [1, 4, 16])
def test_decode(heads, dims, device):
    """Contexts of 1, one block - 1, one block, one block + 1 and 37 keys; one segment and three."""
    b = make([(1, n) for n in (1, 15, 16, 17, 37)], heads, dims, device, seed=heads)
    for splits in (1, 3):
        check_decode(b, dims[0], device, f"H={heads} dims={dims} splits={splits}", num_splits=splits)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_block_size_one(batch, device):
    b = make([(1, n) for n in (9, 1, 2)[:batch]], 4, DIMS[0], device, block_size=1, seed=batch)
    for splits in (1, 3):
        check_decode(b, 32, device, f"block_size=1 B={batch} splits={splits}", num_splits=splits)


def test_decode_matches_paged_with_one_token_per_request(device):
    b = make([(1, n) for n in (20, 3, 33)], 4, DIMS[1], device, seed=2)
    o = check_decode(b, 48, device, "decode")
    o_paged = mla.mla_paged_attention(*paged_args(b), kv_lora_rank=48, scale=SCALE)
    assert_close(o, o_paged, tolerance(torch.float32, device), "decode vs paged")


def test_decode_graph_padding_rows(device):
    """CUDA-graph padding: rows with seq_len 1 over block 0 (`StepInputs.padded_to`) are harmless."""
    b = make([(1, 30), (1, 5), (1, 1), (1, 1)], 4, DIMS[0], device, seed=3)
    b.block_table[2:] = 0
    for splits in (1, 3):
        o = check_decode(b, 32, device, f"padded splits={splits}", num_splits=splits)
        assert torch.isfinite(o).all()


# ----------------------------------------------------------------------------------------------
# Paged: verification, chunks, empty requests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}+{d[1]}")
@pytest.mark.parametrize("heads", [1, 4])
def test_paged_mixed_batch(heads, dims, device):
    b = make(MIXED, heads, dims, device, seed=10 + heads)
    for splits in (1, 3):
        check_paged(b, dims[0], device, f"H={heads} dims={dims} splits={splits}", num_splits=splits)


def test_paged_many_heads(device):
    """16 heads: a tile of one token x 16 heads, 17-token chunks in 17 query tiles."""
    b = make([(1, 40), (3, 18), (17, 33)], 16, DIMS[1], device, seed=12)
    check_paged(b, 48, device, "H=16")
    check_paged(
        make([(2, 40), (3, 18)], 16, DIMS[0], device, seed=13), 32, device, "H=16 split", num_splits=3
    )


def test_paged_block_size_one(device):
    b = make([(1, 5), (3, 3), (4, 19), (0, 2)], 4, DIMS[1], device, block_size=1, seed=14)
    for splits in (1, 3):
        check_paged(b, 48, device, f"block_size=1 splits={splits}", num_splits=splits)


def test_paged_no_tokens(device):
    b = make([(0, 5), (0, 9)], 4, DIMS[0], device)
    assert mla.mla_paged_attention(*paged_args(b), kv_lora_rank=32, scale=SCALE).shape == (0, 4, 32)
    assert ref.mla_paged_attention(*paged_args(b), kv_lora_rank=32, scale=SCALE).shape == (0, 4, 32)


def test_paged_max_seqlen_q_larger_than_needed(device):
    b = make([(3, 20), (1, 9)], 4, DIMS[0], device, seed=15)
    b.max_seqlen_q = 40
    check_paged(b, 32, device, "max_seqlen_q=40")


# ----------------------------------------------------------------------------------------------
# Tile configs, head tiles, value splits, the plan
# ----------------------------------------------------------------------------------------------

CONFIGS = [
    pytest.param(mla.MlaConfig(16, 16, 16, 4, 1, value_splits=2), id="value-halves"),
    pytest.param(mla.MlaConfig(4, 16, 32, 4, 1), id="4-heads-x-4-tokens"),
    pytest.param(mla.MlaConfig(3, 16, 16, 4, 1, value_splits=2), id="3-heads-halves"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_tile_configs(config, device):
    """Head tiles narrower than H (the last one partial), several tokens per tile, value halves."""
    b = make([(1, 37), (6, 17), (0, 3)], 5, DIMS[0], device, seed=16)
    for splits in (1, 3):
        check_paged(b, 32, device, f"{config} splits={splits}", num_splits=forced(b, DIMS[0], config, splits))


def test_value_halves_with_padded_rank(device):
    """kv_lora_rank 48 in two halves of 32: the second half partly masked; split and merged."""
    config = mla.MlaConfig(16, 16, 16, 4, 1, value_splits=2)
    b = make([(1, 37), (1, 5), (1, 20)], 4, DIMS[1], device, seed=17)
    for splits in (1, 3):
        check_decode(b, 48, device, f"halves splits={splits}", num_splits=forced(b, DIMS[1], config, splits))


def test_planned_split_on_long_context(device):
    """num_splits=None plans from the block table's width (no device read) and splits one long request."""
    b = make([(1, 700), (1, 3)], 4, DIMS[0], device, seed=18)
    bound = b.block_table.shape[1] * b.k_cache.shape[1]
    plan = mla.plan_mla(2, 4, 1, bound, torch.float32, 16, kv_lora_rank=32, rope_dim=16)
    assert plan.num_splits > 1, plan.reason
    check_decode(b, 32, device, "planned split")
    check_decode(b, 32, device, "host plan", num_splits=plan, max_seqlen_k=700)


def test_plan_rules():
    """The planner on DeepSeek's shapes (132 SMs): a wave of programs is not split, small batches are."""
    kw = dict(kv_lora_rank=512, rope_dim=64, num_sms_=132, config=mla.WIDE)
    m1 = mla.plan_mla(64, 128, 1, 4096, torch.bfloat16, 64, **kw)
    assert m1.num_splits == 1 and m1.programs == 64 * 2 * mla.WIDE.value_splits, m1.reason  # 2 head tiles
    m2 = mla.plan_mla(8, 128, 1, 32768, torch.bfloat16, 64, **kw)
    assert m2.num_splits > 1 and m2.num_splits * m2.programs <= 2 * 132, m2.reason
    assert 32768 / m2.num_splits >= m2.min_keys_per_split and m2.min_keys_per_split % 64 == 0
    short = mla.plan_mla(1, 16, 1, 100, torch.bfloat16, 64, **kw)
    assert short.num_splits == 1, short.reason
    assert mla.plan_mla(1, 16, 1, 100, torch.bfloat16, 64, num_splits=5, **kw).num_splits == 5
    with pytest.raises(ValueError, match="num_splits"):
        mla.plan_mla(1, 16, 1, 100, torch.bfloat16, 64, num_splits=0, **kw)
    assert mla.tile_shape(mla.WIDE, 128, 1) == (64, 1, 64)
    assert mla.tile_shape(mla.WIDE, 16, 2) == (16, 2, 32)
    assert mla.tile_shape(mla.WIDE, 5, 9) == (5, 8, 64)


# ----------------------------------------------------------------------------------------------
# Numerics, buffers, inputs
# ----------------------------------------------------------------------------------------------


def test_large_scores(device):
    """Scores in the hundreds: the online softmax must rescale, not overflow exp2."""
    b = make([(1, 37), (3, 20)], 4, DIMS[0], device, seed=19)
    b.q = b.q * 30
    check_paged(b, 32, device, "large scores")
    check_paged(b, 32, device, "large scores, split", num_splits=3)


def test_fp16(device):
    b = make([(1, 37), (3, 20), (0, 4)], 4, DIMS[1], device, dtype=torch.float16, seed=20)
    check_paged(b, 48, device, "fp16")
    check_paged(b, 48, device, "fp16 split", num_splits=3)


@pytest.mark.parametrize("splits", [1, 3])
def test_strided_q_and_out(splits, device):
    """q a view of a wider projection, out a view of a wider buffer (the merge's copy path too)."""
    b = make([(1, 37), (3, 20)], 4, DIMS[0], device, seed=21)
    T, H, D = b.q.shape
    wide_q = torch.randn(T, H + 2, D + 8, device=device)
    wide_q[:, 1 : H + 1, :D] = b.q
    wide_o = torch.full((T, H + 3, 40), float("nan"), device=device)
    out = wide_o[:, 2 : H + 2, 4:36]
    strided = (wide_q[:, 1 : H + 1, :D], *paged_args(b)[1:])
    o = mla.mla_paged_attention(*strided, kv_lora_rank=32, scale=SCALE, num_splits=splits, out=out)
    expected = ref.mla_paged_attention(*paged_args(b), kv_lora_rank=32, scale=SCALE)
    assert_close(o, expected, tolerance(torch.float32, device), "strided")
    wide_o[:, 2 : H + 2, 4:36] = 0.0
    assert torch.isnan(wide_o).sum() == wide_o.numel() - out.numel(), "wrote outside out's view"


def test_inputs_unchanged(device):
    b = make([(1, 30), (4, 20)], 4, DIMS[0], device, seed=22)
    before = [t.clone() for t in paged_args(b)[:5]]
    mla.mla_paged_attention(*paged_args(b), kv_lora_rank=32, scale=SCALE, num_splits=2)
    ref.mla_paged_attention(*paged_args(b), kv_lora_rank=32, scale=SCALE)
    for t, t0 in zip(paged_args(b)[:5], before):
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
        seed=23,
        first_block=first,
        spare_blocks=1,
    )
    assert b.block_table.min() * b.k_cache.stride(0) >= 2**31
    check_paged(b, lora, device, "huge block ids")


# ----------------------------------------------------------------------------------------------
# The absorption algebra
# ----------------------------------------------------------------------------------------------


def test_absorption_matches_up_projected_attention(device):
    """Absorbed MLA projected by W_UV equals attention over up-projected keys and values.

    Non-absorbed: head h's key for row r is [W_UK_h c_r, k_pe_r] (qk_nope + rope values), its
    value W_UV_h^T c_r, its query [q_nope_h, q_pe_h]. Absorbed: q_h = [q_nope_h W_UK_h, q_pe_h]
    over the rows themselves, output projected by W_UV_h afterwards.
    """
    gen = torch.Generator().manual_seed(24)
    lora, rope, qk_nope, v_dim, H = 32, 16, 24, 20, 4
    pairs = [(1, 29), (3, 17), (5, 5)]
    b = make(pairs, H, (lora, rope), device, seed=24)
    w_uk = torch.randn(H, qk_nope, lora, generator=gen) / math.sqrt(lora)
    w_uv = torch.randn(H, lora, v_dim, generator=gen) / math.sqrt(lora)
    T = b.q.shape[0]
    q_nope = torch.randn(T, H, qk_nope, generator=gen)
    q_pe = torch.randn(T, H, rope, generator=gen)
    scale = (qk_nope + rope) ** -0.5
    # -- non-absorbed, per request: up-project every row, plain causal attention --
    expected = torch.empty(T, H, v_dim)
    start = 0
    for i, (q_len, kv_len) in enumerate(pairs):
        pos = torch.arange(kv_len)
        rows = b.k_cache.cpu()[b.block_table[i].cpu().long()[pos // 16], pos % 16, 0]  # [N, lora + rope]
        c, k_pe = rows[:, :lora], rows[:, lora:]
        keys = torch.cat([torch.einsum("hdc,nc->nhd", w_uk, c), k_pe[:, None].expand(-1, H, -1)], -1)
        values = torch.einsum("hcv,nc->nhv", w_uv, c)
        queries = torch.cat([q_nope, q_pe], -1)[start : start + q_len]
        scores = torch.einsum("mhd,nhd->hmn", queries, keys) * scale
        visible = pos[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        expected[start : start + q_len] = torch.einsum("hmn,nhv->mhv", probs, values)
        start += q_len
    # -- absorbed --
    b.q = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_uk), q_pe], -1).to(device)
    for impl in (ref, mla):
        latent = impl.mla_paged_attention(*paged_args(b), kv_lora_rank=lora, scale=scale)
        got = torch.einsum("thc,hcv->thv", latent.cpu(), w_uv)
        assert_close(
            got, expected, tolerance(torch.float32, device), f"absorbed ({impl.__name__}) vs up-projected"
        )


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _bad_cases():
    b = make([(1, 20), (2, 9)], 4, DIMS[0], "cpu", seed=25)
    q, kv, bt, cu, seq, mq = paged_args(b)
    other = torch.empty(0, device="meta")
    return [
        ("q_rank", dict(q=q[0]), "q must be 3-D [T, H, kv_lora_rank + rope_dim]"),
        ("cache_rank", dict(kv_cache=kv[:, :, 0]), "kv_cache must be 4-D"),
        (
            "cache_heads",
            dict(kv_cache=kv.expand(-1, -1, 2, -1).contiguous()),
            "kv_cache must have one KV head",
        ),
        ("cache_dim", dict(kv_cache=kv[..., :40].contiguous()), "kv_cache's last dim (40)"),
        ("rope_zero", dict(kv_lora_rank=48), "rope_dim = 0"),
        ("rank_type", dict(kv_lora_rank=32.0), "kv_lora_rank must be a Python int"),
        ("scale_none", dict(scale=None), "scale is required"),
        ("scale_nan", dict(scale=float("nan")), "scale must be finite"),
        ("table_int64", dict(block_table=bt.long()), "block_table must be int32"),
        ("seq_lens_int64", dict(seq_lens=seq.long()), "seq_lens must be int32"),
        ("cu_len", dict(cu_seqlens_q=cu[:-1]), "cu_seqlens_q must have B+1 = 3 entries"),
        ("device", dict(seq_lens=other.to(torch.int32).new_empty(2)), "seq_lens is on meta"),
        ("dtype", dict(kv_cache=kv.half()), "kv_cache must have q's dtype torch.float32 or float8_e4m3fn"),
        ("out_shape", dict(out=torch.empty(3, 4, 48)), "out must have shape (3, 4, 32)"),
        ("seq_short", dict(seq_lens=torch.tensor([20, 1], dtype=torch.int32)), "seq_lens[1] = 1 is smaller"),
        ("table_range", dict(block_table=bt.clone().fill_(999)), "out of range"),
        ("max_q", dict(max_seqlen_q=1), "max_seqlen_q = 1 is smaller than the longest request"),
        ("splits", dict(num_splits=0), "num_splits must be >= 1"),
        ("max_k", dict(max_seqlen_k=5), "max_seqlen_k = 5 is smaller"),
    ]


@pytest.mark.parametrize("impl", [mla, ref], ids=["triton", "reference"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_errors(case, impl):
    _, change, message = case
    b = make([(1, 20), (2, 9)], 4, DIMS[0], "cpu", seed=25)
    q, kv, bt, cu, seq, mq = paged_args(b)
    args = dict(q=q, kv_cache=kv, block_table=bt, cu_seqlens_q=cu, seq_lens=seq, max_seqlen_q=mq)
    kw = dict(kv_lora_rank=32, scale=SCALE)
    for key, value in change.items():
        (args if key in args else kw)[key] = value
    with pytest.raises(ValueError, match="^mla_paged_attention: ") as e:
        impl.mla_paged_attention(*args.values(), **kw)
    assert message in str(e.value)


@pytest.mark.parametrize("impl", [mla, ref], ids=["triton", "reference"])
def test_decode_errors(impl):
    b = make([(1, 20), (1, 9)], 4, DIMS[0], "cpu", seed=26)
    q, kv, bt, seq = decode_args(b)
    with pytest.raises(ValueError, match="mla_decode_attention: block_table must have B = 1 rows"):
        impl.mla_decode_attention(q[:1], kv, bt, seq[:1], kv_lora_rank=32, scale=SCALE)
    with pytest.raises(ValueError, match=r"mla_decode_attention: out must have shape \(2, 4, 32\)"):
        impl.mla_decode_attention(q, kv, bt, seq, kv_lora_rank=32, scale=SCALE, out=torch.empty(2, 4, 48))
    with pytest.raises(ValueError, match=r"mla_decode_attention: seq_lens\[0\] = 0 is smaller"):
        impl.mla_decode_attention(q, kv, bt, torch.zeros_like(seq), kv_lora_rank=32, scale=SCALE)


# ----------------------------------------------------------------------------------------------
# GPU only: DeepSeek's shapes in bf16, CUDA graphs
# ----------------------------------------------------------------------------------------------

DEEPSEEK = (512, 64)
# the table's pick, 64 rows in one piece, 16-row tiles in value halves (the bench sweeps the rest)
GPU_CONFIGS = [None, mla.MID, mla.MlaConfig(16, 16, 32, 4, 3, value_splits=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_gpu_decode_deepseek(num_splits, heads, dtype, device):
    lens = [1, 63, 64, 65, 4097, 300, 2048]
    b = make([(1, n) for n in lens], heads, DEEPSEEK, device, block_size=64, dtype=dtype)
    check_decode(b, 512, device, f"gpu decode H={heads} splits={num_splits}", num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=str)
def test_gpu_paged_deepseek(config, heads, device):
    b = make([(1, 1000), (2, 513), (4, 64), (130, 700), (0, 9)], heads, DEEPSEEK, device, block_size=64,
             dtype=torch.bfloat16)  # fmt: skip
    plans = [None] if config is None else [forced(b, DEEPSEEK, config, n) for n in (1, 3)]
    for plan in plans:
        check_paged(b, 512, device, f"gpu paged H={heads} {plan}", num_splits=plan)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph(device):
    """mla_decode_attention as called (no plan, no max_seqlen_k) captures and replays in a graph."""
    b = make([(1, n) for n in (5000, 17, 900, 1)], 16, DEEPSEEK, device, block_size=64, dtype=torch.bfloat16)
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16, device=device)

    def step():
        mla.mla_decode_attention(*decode_args(b), kv_lora_rank=512, scale=SCALE, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    b.q.normal_()  # new queries, same buffers
    graph.replay()
    torch.cuda.synchronize()
    expected = ref.mla_decode_attention(*decode_args(b), kv_lora_rank=512, scale=SCALE)
    assert_close(out, expected, tolerance(torch.bfloat16, device), "graph replay")
