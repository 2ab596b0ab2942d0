"""DeepSeek-V3.2's lightning indexer selection (`tilellm.kernels.indexer`, Triton) against its twin.

`index_topk` returns, per new token, the positions of its `topk` largest index scores
sum_h w_h * relu(scale * q_h . k_s) over its causal keys. The order within a row is free, the set
is not, except among keys tied at the topk-th score: relu makes exact ties common (a key every
head scores below zero scores exactly 0, and with random-sign weights 0 sits inside the range),
so rows are compared as sets against the scores themselves (`check_selection`): every chosen key
scores at least the topk-th largest, every other causal key at most, and the kernel's set may
differ from the twin's only among keys tied with it. Batches mix decode, verification-sized and
chunk-sized requests over random block tables whose unused columns point at blocks of random
keys (`make_paged_batch`), and outputs start as garbage. `test_twin_matches_transformers_formula`
proves the twin's semantics on a dense batch with the exact ops of transformers'
`DeepseekV32Indexer`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import make_paged_batch
from tilellm.kernels import indexer
from tilellm.kernels.reference import indexer as ref

MIXED = [(1, 37), (5, 20), (17, 80), (0, 7)]  # decode, a short verify, a chunk, an empty request


def make(pairs, heads, dim, device, block_size=16, dtype=torch.float32, seed=0, **kw):
    """A batch over an indexer cache (one key of `dim` values per token) and random-sign fp32
    weights [T, heads]."""
    b = make_paged_batch(pairs, heads, 1, dim, block_size, dtype, device, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 1000)
    b.weights = torch.randn(b.q.shape[0], heads, generator=gen).to(device)
    return b


def args(b):
    return b.q, b.weights, b.k_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q


def garbage(b, topk):
    return torch.full((b.q.shape[0], topk), -7, dtype=torch.int32, device=b.q.device)


def token_scores(b, scale) -> list[torch.Tensor]:
    """Each token's fp32 scores over its causal keys 0..pos (the twin's `index_scores`)."""
    rows, start = [], 0
    block_size = b.k_cache.shape[1]
    for i, (q_len, kv_len) in enumerate(b.pairs):
        pos = torch.arange(kv_len)
        keys = b.k_cache.cpu()[b.block_table[i].cpu().long()[pos // block_size], pos % block_size, 0]
        q = getattr(b, "score_q", b.q)  # FP8 keys: the queries as the FP8 scores see them
        rows_q, rows_w = q[start : start + q_len].cpu(), b.weights[start : start + q_len].cpu()
        scores = ref.index_scores(rows_q, rows_w, keys, scale)
        rows += [scores[j, : kv_len - q_len + j + 1] for j in range(q_len)]
        start += q_len
    return rows


def check_selection(got, b, topk, scale, what, expected=None, tol=1e-5):
    """Each row of `got` holds min(topk, n) distinct causal positions, then -1s, and is a top-k
    of the token's scores (ties at the topk-th score within `tol` x the row's largest |score|);
    it differs from `expected` (the twin's) only among such ties."""
    got = got.cpu()
    assert got.dtype == torch.int32 and got.shape == (b.q.shape[0], topk), (
        f"{what}: {got.dtype} {tuple(got.shape)}"
    )
    for t, scores in enumerate(token_scores(b, scale)):
        n = scores.numel()
        k = min(topk, n)
        row = got[t]
        assert bool((row[k:] == -1).all()), (
            f"{what}: token {t} ({n} keys) has {row[k:].tolist()} after its {k} picks"
        )
        picked = row[:k].long()
        assert bool((picked >= 0).all()) and bool((picked < n).all()), (
            f"{what}: token {t} picks {picked.tolist()}, n = {n}"
        )
        assert picked.unique().numel() == k, f"{what}: token {t} picks a key twice: {sorted(picked.tolist())}"
        kth = float(scores.topk(k).values[-1])
        eps = tol * max(1.0, float(scores.abs().max()))
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[picked] = True
        low = scores[chosen].min()
        assert low >= kth - eps, f"{what}: token {t} picks a key scoring {float(low):.6g} < topk-th {kth:.6g}"
        if not bool(chosen.all()):
            high = scores[~chosen].max()
            assert high <= kth + eps, (
                f"{what}: token {t} leaves a key scoring {float(high):.6g} > topk-th {kth:.6g}"
            )
        if expected is not None:
            other = expected.cpu()[t]
            assert bool((other[k:] == -1).all()), (
                f"{what}: twin row {t} has {other[k:].tolist()} after {k} picks"
            )
            diff = set(picked.tolist()) ^ set(other[:k].tolist())
            far = [s for s in diff if abs(float(scores[s]) - kth) > eps]
            assert not far, (
                f"{what}: token {t}: kernel and twin differ on keys {far} that are not tied at {kth:.6g}"
            )


def check(b, topk, what, scale=None, tol=1e-5, **kw):
    scale = b.q.shape[2] ** -0.5 if scale is None else scale
    out = garbage(b, topk)
    got = indexer.index_topk(*args(b), topk=topk, scale=scale, out=out, **kw)
    assert got is out
    expected = ref.index_topk(*args(b), topk=topk, scale=scale, **kw)
    check_selection(expected, b, topk, scale, f"{what} (twin)", tol=tol)
    check_selection(got, b, topk, scale, what, expected, tol=tol)
    return got


# ----------------------------------------------------------------------------------------------
# Triton against the twin
# ----------------------------------------------------------------------------------------------

# (block_size, Hi, D): every block size, head count and head dim at least twice
SHAPES = [(1, 4, 16), (16, 1, 32), (16, 4, 16), (64, 4, 32), (64, 1, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"page{s[0]}-Hi{s[1]}-D{s[2]}")
@pytest.mark.parametrize("topk", [8, 100])
def test_mixed_batch(shape, topk, device):
    """B = 3 (+ an empty request): decode, 5 and 17 new tokens, contexts crossing blocks; topk
    below every context, and above every one (all causal keys, then -1s)."""
    block_size, heads, dim = shape
    b = make(MIXED, heads, dim, device, block_size=block_size, seed=1)
    check(b, topk, f"mixed {shape} topk={topk}")


@pytest.mark.parametrize("q_len", [1, 5, 17])
def test_one_request(q_len, device):
    """B = 1: topk cuts through the chunk's contexts (the first tokens get all their keys)."""
    b = make([(q_len, 45)], 4, 32, device, block_size=16, seed=2)
    check(b, 35, f"one request q_len={q_len}")


def test_decode_batch(device):
    """One token per request, contexts on and across block edges, split into key segments."""
    b = make([(1, n) for n in (1, 16, 17, 63, 130)], 4, 16, device, block_size=16, seed=3)
    for splits_floor in (1024, 16):  # no split; segments of >= 16 keys
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(indexer, "MIN_KEYS_PER_SPLIT", splits_floor)
            check(b, 20, f"decode, segments >= {splits_floor} keys")


def test_chunked_scratch(device, monkeypatch):
    """A scratch of a few tokens' rows: the tokens run in chunks whose edges cut query tiles."""
    monkeypatch.setattr(indexer, "SCRATCH_ELEMENTS", 3 * 96)
    b = make([(3, 40), (9, 30), (1, 9)], 4, 16, device, seed=4)
    check(b, 10, "chunked", max_seqlen_k=96)


def test_exact_ties(device):
    """Zero weights: every score is 0, any topk distinct causal keys are a valid answer."""
    b = make([(1, 50), (6, 33)], 4, 16, device, seed=5)
    b.weights.zero_()
    check(b, 12, "all tied")


def test_negative_and_large_scores(device):
    """Negative weights (negative scores order by magnitude the other way) and large dots."""
    b = make([(2, 60), (4, 23)], 4, 32, device, seed=6)
    b.weights = -b.weights.abs()
    check(b, 9, "negative scores")
    b.q *= 30.0
    check(b, 9, "large scores", scale=1.0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_scores_ulps_apart(sign, device):
    """Scores that differ only in their lowest bits (and some exactly equal), picked exactly: one
    head, q = e_0, weight +-1, scale 1, so score(s) = +-relu(k_s[0]) and the keys set the scores
    bit for bit. Clusters of 40 consecutive floats around four magnitudes, in random order."""
    b = make([(1, 200), (2, 170)], 1, 16, device, seed=16)
    gen = torch.Generator().manual_seed(16)
    base = torch.tensor([0.5, 1.5, 3.0, 1e-3]).view(torch.int32)
    values = (base[:, None] + torch.arange(40)[None, :].int()).flatten().view(torch.float32)
    values = torch.cat([values, values[:40]])  # 40 exact duplicates
    q = torch.zeros_like(b.q)
    q[:, 0, 0] = 1.0
    b.q, b.weights = q, torch.full_like(b.weights, sign)
    table = b.block_table.cpu().long()
    for i, (_, kv_len) in enumerate(b.pairs):
        pos = torch.arange(kv_len)
        picked = values[torch.randint(0, values.numel(), (kv_len,), generator=gen)]
        b.k_cache[table[i][pos // 16], pos % 16, 0, 0] = picked.to(device)
    check(b, 64, f"ulps apart, sign {sign:+}", scale=1.0, tol=0.0)


def test_max_seqlen_k_and_out_view(device):
    """A tight `max_seqlen_k`, `max_seqlen_q` above the longest request, and `out` a view into a
    wider buffer (only its columns are written)."""
    b = make(MIXED, 4, 16, device, seed=7)
    wide = torch.full((b.q.shape[0], 30), -7, dtype=torch.int32, device=device)
    out = wide[:, 5:25]
    q, w, cache, table, cu, seq, _ = args(b)
    got = indexer.index_topk(q, w, cache, table, cu, seq, 32, topk=20, scale=0.25, max_seqlen_k=80, out=out)
    assert got is out
    check_selection(got, b, 20, 0.25, "out view", ref.index_topk(*args(b), topk=20, scale=0.25))
    assert bool((wide[:, :5] == -7).all()) and bool((wide[:, 25:] == -7).all()), "wrote outside out's view"


def test_short_max_seqlen_k_without_checks_stays_in_scratch(device, monkeypatch):
    """A `max_seqlen_k` below seq_lens is caught by the value checks; without them (the GPU
    outside TILELLM_DEBUG) the picks are wrong but stay within the scratch's rows (32 keys)."""
    monkeypatch.setattr(indexer.v, "deep_checks_enabled", lambda t: False)
    b = make([(1, 90), (4, 70)], 4, 16, device, seed=17)
    got = indexer.index_topk(*args(b), topk=8, scale=0.25, max_seqlen_k=20).cpu()
    assert bool((got >= 0).all()) and bool((got < 32).all()), got
    assert all(row.unique().numel() == 8 for row in got)


def test_fp16(device):
    b = make(MIXED, 4, 32, device, dtype=torch.float16, seed=8)
    check(b, 16, "fp16", tol=1e-4)


def test_block_ids_past_int32_offsets(device):
    """Block ids whose `block * stride(0)` passes 2^31 elements (a 4 GiB torch.empty cache, only
    its top blocks written): int32 offsets would read the wrong keys."""
    first = (1 << 31) // (16 * 16) + 8
    b = make(
        [(1, 40), (3, 21)], 4, 16, device, dtype=torch.float16, seed=15, first_block=first, spare_blocks=1
    )
    assert b.block_table.min() * b.k_cache.stride(0) >= 2**31
    check(b, 10, "huge block ids", tol=1e-4)


def test_no_tokens(device):
    b = make([(0, 5), (0, 9)], 4, 16, device, seed=9)
    for impl in (indexer, ref):
        got = impl.index_topk(*args(b), topk=4, scale=0.25)
        assert got.shape == (0, 4) and got.dtype == torch.int32


def test_inputs_unchanged(device):
    b = make(MIXED, 4, 16, device, seed=10)
    before = [t.clone() for t in args(b)[:6]]
    indexer.index_topk(*args(b), topk=8, scale=0.25)
    ref.index_topk(*args(b), topk=8, scale=0.25)
    for t, t0 in zip(args(b)[:6], before):
        assert torch.equal(t, t0)


# ----------------------------------------------------------------------------------------------
# The twin's semantics: transformers' DeepseekV32Indexer formula
# ----------------------------------------------------------------------------------------------


def test_twin_matches_transformers_formula():
    """On a dense batch [B, S] (no cache prefix), transformers' ops: scores = relu(q @ k^T * scale)
    per head, weights @ scores over the heads, the causal mask, topk. Its rows of a token with
    fewer than topk keys end in masked (-inf) picks, which the twin writes as -1."""
    gen = torch.Generator().manual_seed(11)
    B, S, H, D, topk = 2, 24, 4, 16, 7
    scale = D**-0.5
    q = torch.randn(B, S, H, D, generator=gen)
    k = torch.randn(B, S, D, generator=gen)
    weights = torch.randn(B, S, H, generator=gen) * H**-0.5
    # -- transformers (modeling_deepseek_v32.DeepseekV32Indexer.forward, after the projections) --
    scores = torch.matmul(q.transpose(1, 2).float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale
    scores = F.relu(scores)  # [B, H, S, T]
    index_scores = torch.matmul(weights.unsqueeze(-2), scores.transpose(1, 2)).squeeze(-2)  # [B, S, T]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    index_scores = index_scores.masked_fill(~causal, float("-inf"))
    hf = index_scores.topk(min(topk, S), dim=-1)
    # -- the twin over the same keys in a paged cache of 5-key blocks, blocks in reverse order --
    page, blocks = 5, -(-S // 5)
    cache = torch.randn(B * blocks, page, 1, D, generator=gen)
    table = torch.arange(B * blocks, dtype=torch.int32).flip(0).view(B, blocks).contiguous()
    pos = torch.arange(S)
    for i in range(B):
        cache[table[i].long()[pos // page], pos % page, 0] = k[i]
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    seq = torch.full((B,), S, dtype=torch.int32)
    got = ref.index_topk(
        q.reshape(B * S, H, D), weights.reshape(B * S, H), cache, table, cu, seq, S, topk=topk, scale=scale
    ).view(B, S, topk)
    for i in range(B):
        for t in range(S):
            valid = hf.values[i, t] > float("-inf")
            assert sorted(got[i, t][got[i, t] >= 0].tolist()) == sorted(hf.indices[i, t][valid].tolist()), (
                i,
                t,
            )
            assert int((got[i, t] >= 0).sum()) == min(topk, t + 1)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def _bad_cases():
    b = make([(1, 20), (2, 9)], 4, 16, "cpu", seed=12)
    q, w, cache, table, cu, seq, _ = args(b)
    return [
        ("q_rank", dict(q=q[0]), "q must be 3-D [T, Hi, D]"),
        ("weights_dtype", dict(weights=w.half()), "weights [T, Hi] must be float32"),
        ("weights_shape", dict(weights=w[:, :2].contiguous()), "weights must have shape [T, Hi] = (3, 4)"),
        ("cache_rank", dict(index_cache=cache[:, :, 0]), "index_cache must be 4-D"),
        ("cache_heads", dict(index_cache=cache.expand(-1, -1, 2, -1).contiguous()), "index_cache must be"),
        ("cache_dim", dict(index_cache=cache[..., :8].contiguous()), "D = 16 (q's head dim)"),
        ("cache_dtype", dict(index_cache=cache.half()), "index_cache dtype torch.float16 differs from q"),
        ("head_dim", dict(q=q[..., :12], index_cache=cache[..., :12].contiguous()), "power of two"),
        ("table_int64", dict(block_table=table.long()), "block_table must be int32"),
        ("cu_len", dict(cu_seqlens_q=cu[:-1]), "cu_seqlens_q must have B+1 = 3 entries"),
        ("seq_len", dict(seq_lens=seq[:1]), "seq_lens must have B = 2 entries"),
        ("device", dict(seq_lens=torch.empty(2, dtype=torch.int32, device="meta")), "seq_lens is on meta"),
        ("topk", dict(topk=0), "topk must be an int >= 1"),
        ("scale", dict(scale=None), "scale is required"),
        ("scale_nan", dict(scale=float("nan")), "scale must be finite"),
        ("out_shape", dict(out=torch.empty(3, 5, dtype=torch.int32)), r"out must have shape (3, 4)"),
        ("out_dtype", dict(out=torch.empty(3, 4, dtype=torch.int64)), "out must have dtype torch.int32"),
        ("seq_short", dict(seq_lens=torch.tensor([20, 1], dtype=torch.int32)), "seq_lens[1] = 1 is smaller"),
        ("table_range", dict(block_table=table.clone().fill_(999)), "out of range"),
        ("max_q", dict(max_seqlen_q=1), "max_seqlen_q = 1 is smaller than the longest request"),
        ("max_k", dict(max_seqlen_k=5), "max_seqlen_k = 5 is smaller"),
        ("max_k_type", dict(max_seqlen_k=5.0), "max_seqlen_k must be a Python int"),
    ]


@pytest.mark.parametrize("impl", [indexer, ref], ids=["triton", "reference"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_errors(case, impl):
    _, change, message = case
    b = make([(1, 20), (2, 9)], 4, 16, "cpu", seed=12)
    names = ["q", "weights", "index_cache", "block_table", "cu_seqlens_q", "seq_lens", "max_seqlen_q"]
    positional = dict(zip(names, args(b)))
    kw = dict(topk=4, scale=0.25)
    for key, value in change.items():
        (positional if key in positional else kw)[key] = value
    with pytest.raises(ValueError, match="^index_topk: ") as e:
        impl.index_topk(*positional.values(), **kw)
    assert message in str(e.value)


# ----------------------------------------------------------------------------------------------
# FP8 keys: each key row in e4m3 with a scale of its own
# ----------------------------------------------------------------------------------------------


def fp8_keys(b) -> torch.Tensor:
    """b's index cache quantized in place by `store_index_keys`'s twin, row by row (rows of very
    different ranges: each gets its own scale); returns the scales [num_blocks, block_size].
    b.k_cache then holds the dequantized keys (what the scores stand for), b.k8 the e4m3 cache."""
    nb, bs, _, d = b.k_cache.shape
    rows = b.k_cache.reshape(nb * bs, d).float()
    rows = rows * torch.logspace(-3, 2, nb * bs, device=rows.device)[torch.randperm(nb * bs)][:, None]
    b.k8 = torch.empty(nb, bs, 1, d, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(nb, bs, dtype=torch.float32, device=rows.device)
    slots = torch.arange(nb * bs, dtype=torch.int32, device=rows.device)
    ref.store_index_keys(rows, b.k8, slots, index_scales=scales)
    b.k_cache = b.k8.float() * scales[..., None, None]  # fp32: the keys the scores stand for
    b.score_q = ref.fp8_index_queries(b.q)
    return scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_store_index_keys_writes_the_twins_bytes(dtype, device):
    gen = torch.Generator().manual_seed(21)
    T, D = 29, 32
    k = (torch.randn(T, D, generator=gen) * torch.logspace(-4, 3, T)[:, None]).to(device=device, dtype=dtype)
    k[3] = 0.0  # an all-zero key: the smallest scale, zeros stored
    slots = torch.randperm(6 * 16, generator=gen)[:T].to(torch.int32)
    slots[::7] = -1  # padding rows are skipped
    slots = slots.to(device)
    out = []
    for impl in (indexer, ref):
        cache = torch.full((6, 16, 1, D), 1.5, device=device).to(torch.float8_e4m3fn)
        scales = torch.full((6, 16), -1.0, device=device)
        impl.store_index_keys(k, cache, slots, index_scales=scales)
        out.append((cache, scales))
    (cache, scales), (cache_ref, scales_ref) = out
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    assert torch.equal(scales, scales_ref)
    kept = slots[slots >= 0].long().cpu()
    untouched = torch.ones(6 * 16, dtype=torch.bool)
    untouched[kept] = False
    assert bool((scales.cpu().view(-1)[untouched] == -1.0).all()), "wrote a padding row's slot"
    deq = cache.float().view(-1, D)[kept] * scales.view(-1)[kept][:, None]
    want = k[slots >= 0].float()
    # within half an ulp of e4m3 (3 mantissa bits; subnormals spaced 2^-9 x the row's scale)
    bound = want.abs() * 2**-4 + scales.view(-1)[kept][:, None] * 2**-10
    assert bool(((deq - want).abs() <= bound).all()), "an e4m3 round trip beyond half an ulp"
    # a 16/32-bit cache stores the keys as they are
    plain = torch.zeros(6, 16, 1, D, device=device, dtype=dtype)
    indexer.store_index_keys(k, plain, slots)
    assert torch.equal(plain.view(-1, D)[kept], k[slots >= 0])


@pytest.mark.parametrize("impl", [indexer, ref], ids=["triton", "reference"])
def test_store_index_keys_refuses_bad_slots(impl):
    k = torch.randn(3, 32)
    cache = torch.zeros(2, 16, 1, 32).to(torch.float8_e4m3fn)
    scales = torch.zeros(2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 32 is out of range \[-1, 32\)"):
        impl.store_index_keys(k, cache, torch.tensor([0, 32, -1], dtype=torch.int32), index_scales=scales)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64, got torch.float32"):
        impl.store_index_keys(k, cache, torch.tensor([0.0, 1.0, 2.0]), index_scales=scales)
    assert bool((scales == 0).all()), "a refused call wrote"


@pytest.mark.parametrize(
    "shape", [(16, 4, 32), (1, 4, 32), (64, 1, 64)], ids=lambda s: f"page{s[0]}-Hi{s[1]}-D{s[2]}"
)
def test_fp8_keys_mixed_batch(shape, device):
    """The kernel over e4m3 keys and their scales picks what the twin picks over the same keys."""
    block_size, heads, dim = shape
    b = make(MIXED, heads, dim, device, block_size=block_size, seed=22)
    scales = fp8_keys(b)
    scale = dim**-0.5
    q_args = (b.q, b.weights, b.k8, b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q)
    for topk in (8, 100):
        got = indexer.index_topk(*q_args, topk=topk, scale=scale, index_scales=scales, out=garbage(b, topk))
        expected = ref.index_topk(*q_args, topk=topk, scale=scale, index_scales=scales)
        check_selection(expected, b, topk, scale, f"fp8 twin {shape} topk={topk}")
        check_selection(got, b, topk, scale, f"fp8 {shape} topk={topk}", expected)


@pytest.mark.parametrize("impl", [indexer, ref], ids=["triton", "reference"])
def test_fp8_keys_need_their_scales(impl):
    b = make([(1, 20)], 4, 32, "cpu", seed=23)
    scales = fp8_keys(b)
    q_args = (b.q, b.weights, b.k8, b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q)
    with pytest.raises(ValueError, match="an FP8 .e4m3. index_cache needs index_scales"):
        impl.index_topk(*q_args, topk=4, scale=0.25)
    with pytest.raises(ValueError, match="index_scales must be float32 of shape"):
        impl.index_topk(*q_args, topk=4, scale=0.25, index_scales=scales[:, :3])
    with pytest.raises(ValueError, match="index_scales is for an FP8"):
        impl.index_topk(*args(b), topk=4, scale=0.25, index_scales=scales)
    small = make([(1, 20)], 4, 16, "cpu", seed=23)
    small_k8 = small.k_cache.to(torch.float8_e4m3fn)
    small_scales = torch.ones(small_k8.shape[:2])
    small_args = (small.q, small.weights, small_k8, *args(small)[3:])
    with pytest.raises(ValueError, match="FP8 .e4m3. index keys need a head dim >= 32, got 16"):
        impl.index_topk(*small_args, topk=4, scale=0.25, index_scales=small_scales)


# ----------------------------------------------------------------------------------------------
# GPU only: DeepSeek's shapes in bf16, CUDA graphs
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_deepseek(dtype, device):
    """Hi = 64, D = 128, topk 2048, page 64: decode rows past and below topk, a prefill chunk."""
    lens = [(1, 1), (1, 2047), (1, 2049), (1, 5000), (1, 9000)]
    b = make(lens + [(300, 4000), (0, 9)], 64, 128, device, block_size=64, dtype=dtype, seed=13)
    b.weights *= 64**-0.5
    check(b, 2048, f"gpu {dtype}", tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_deepseek_fp8_keys(dtype, device):
    """DeepSeek's shapes over e4m3 keys with a scale each (an FP8 KV cache): e4m3 queries and
    keys on the tensor cores, each key's dots times its scale, decode and prefill tiles."""
    lens = [(1, 1), (1, 2049), (1, 5000), (64, 3000), (0, 9)]
    b = make(lens, 64, 128, device, block_size=64, dtype=dtype, seed=15)
    b.weights *= 64**-0.5
    scales = fp8_keys(b)
    q_args = (b.q, b.weights, b.k8, b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q)
    got = indexer.index_topk(*q_args, topk=2048, scale=128**-0.5, index_scales=scales)
    expected = ref.index_topk(*q_args, topk=2048, scale=128**-0.5, index_scales=scales)
    check_selection(got, b, 2048, 128**-0.5, f"gpu fp8 keys {dtype}", expected, tol=1e-4)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph(device):
    """index_topk as called (no max_seqlen_k) captures and replays in a CUDA graph."""
    b = make(
        [(1, n) for n in (5000, 17, 3000, 1)], 64, 128, device, block_size=64, dtype=torch.bfloat16, seed=14
    )
    out = torch.empty(4, 2048, dtype=torch.int32, device=device)

    def step():
        indexer.index_topk(*args(b), topk=2048, scale=128**-0.5, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    check_selection(out, b, 2048, 128**-0.5, "graph replay", tol=1e-4)
