"""The PyTorch references against naive float64 attention written token by token.

The naive versions here share no code with `tilellm.kernels.reference`: they walk each token,
compute each slot from the block table by the slot formula on a flattened cache, and take the
softmax in float64. The references run on CPU only (they are the oracle for the kernels and the
engine's CPU backend), so bf16 is tested here too.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.helpers import assert_close, cu_seqlens, make_paged_batch, poisoned, randn, sparse_indices
from tilellm.kernels import reference as ref

# Output rounding only: fp32 keeps ~1e-7, fp16 ~5e-4, bf16 ~4e-3 of the output scale.
REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(4, 4), (8, 4), (8, 2), (5, 1), (10, 2)]


# ----------------------------------------------------------------------------------------------
# Naive float64 attention
# ----------------------------------------------------------------------------------------------


def naive_softmax_av(q_row, keys, values, scale):
    """One query head: q_row [D], keys/values [N, D] -> [D] in float64 (zeros when N == 0)."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q_row, dtype=torch.float64)
    s = (keys.double() @ q_row.double()) * scale
    p = torch.exp(s - s.max())
    return (p / p.sum()) @ values.double()


def naive_paged(b, scale):
    T, Hq, D = b.q.shape
    Hkv = b.k_cache.shape[2]
    bs = b.k_cache.shape[1]
    flat_k = b.k_cache.reshape(-1, Hkv, D)
    flat_v = b.v_cache.reshape(-1, Hkv, D)
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    t = 0
    for i, (q_len, kv_len) in enumerate(b.pairs):
        slots = [int(b.block_table[i, p // bs]) * bs + p % bs for p in range(kv_len)]
        for j in range(q_len):
            pos = kv_len - q_len + j
            for h in range(Hq):
                kvh = h // (Hq // Hkv)
                keys = flat_k[slots[: pos + 1], kvh]
                values = flat_v[slots[: pos + 1], kvh]
                out[t, h] = naive_softmax_av(b.q[t, h], keys, values, scale)
            t += 1
    return out


def naive_prefill(q, k, v, lengths, causal, scale):
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    start = 0
    for n in lengths:
        for j in range(n):
            end = start + j + 1 if causal else start + n
            for h in range(Hq):
                out[start + j, h] = naive_softmax_av(
                    q[start + j, h], k[start:end, h // group], v[start:end, h // group], scale
                )
        start += n
    return out


def naive_sparse(b, topk, scale):
    T, Hq, D = b.q.shape
    Hkv = b.k_cache.shape[2]
    bs = b.k_cache.shape[1]
    flat_k = b.k_cache.reshape(-1, Hkv, D)
    flat_v = b.v_cache.reshape(-1, Hkv, D)
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    t = 0
    for i, (q_len, _) in enumerate(b.pairs):
        for _ in range(q_len):
            slots = [int(b.block_table[i, p // bs]) * bs + p % bs for p in topk[t].tolist() if p >= 0]
            for h in range(Hq):
                kvh = h // (Hq // Hkv)
                out[t, h] = naive_softmax_av(b.q[t, h], flat_k[slots, kvh], flat_v[slots, kvh], scale)
            t += 1
    return out


def check(actual, expected64, dtype, what):
    assert_close(actual, expected64.to(dtype), REF_TOL[dtype], what)


# ----------------------------------------------------------------------------------------------
# paged / decode
# ----------------------------------------------------------------------------------------------

MIXED = [(1, 45), (5, 18), (13, 37), (0, 9), (16, 16)]  # decode, verify, chunked prefill, empty, fresh


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_paged_gqa_dtypes(heads, dtype):
    b = make_paged_batch(MIXED, heads[0], heads[1], 16, 16, dtype, "cpu", seed=1)
    o = ref.paged_attention(*b.args(), out=poisoned(b.q))
    check(o, naive_paged(b, 16**-0.5), dtype, "paged")


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
def test_paged_block_sizes(block_size):
    bs = block_size
    pairs = [(1, 1), (1, max(bs - 1, 1)), (min(2, bs), bs), (2, bs + 1), (1, 2 * bs + 3), (4, 31)]
    b = make_paged_batch(pairs, 4, 2, 16, bs, torch.float32, "cpu", seed=bs)
    check(ref.paged_attention(*b.args()), naive_paged(b, 0.25), torch.float32, f"bs={bs}")


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_paged_head_dims(head_dim):
    b = make_paged_batch([(1, 23), (3, 7)], 4, 2, head_dim, 16, torch.float32, "cpu", seed=head_dim)
    check(ref.paged_attention(*b.args()), naive_paged(b, head_dim**-0.5), torch.float32, f"D={head_dim}")


def test_paged_custom_scale_and_inputs_untouched():
    b = make_paged_batch(MIXED, 8, 2, 32, 16, torch.float32, "cpu", seed=3)
    before = [t.clone() for t in b.args()[:6]]
    o = ref.paged_attention(*b.args(), scale=0.37, num_splits=3)
    check(o, naive_paged(b, 0.37), torch.float32, "scale")
    for t, t0 in zip(b.args()[:6], before):
        assert torch.equal(t, t0), "reference modified an input"


def test_paged_out_is_returned_and_filled():
    b = make_paged_batch([(2, 9)], 4, 4, 16, 16, torch.float32, "cpu")
    out = poisoned(b.q)
    assert ref.paged_attention(*b.args(), out=out) is out
    check(out, naive_paged(b, 0.25), torch.float32, "out")


def test_paged_chunked_scores_match(monkeypatch):
    """Long requests are processed in chunks of query rows; the chunking must not change results."""
    b = make_paged_batch([(40, 70), (3, 5)], 4, 2, 16, 16, torch.float32, "cpu", seed=5)
    whole = ref.paged_attention(*b.args())
    monkeypatch.setattr(ref, "_MAX_SCORE_ELEMENTS", 200)
    assert_close(ref.paged_attention(*b.args()), whole, 1e-6, "chunked")


def test_paged_empty_batch():
    b = make_paged_batch([(0, 5), (0, 0)], 4, 2, 16, 16, torch.float32, "cpu")
    assert ref.paged_attention(*b.args()).shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_decode_matches_naive_and_paged(dtype):
    pairs = [(1, 1), (1, 17), (1, 64), (1, 65), (1, 3)]
    b = make_paged_batch(pairs, 8, 2, 32, 16, dtype, "cpu", seed=7)
    o = ref.decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, out=poisoned(b.q))
    check(o, naive_paged(b, 32**-0.5), dtype, "decode")
    assert torch.equal(o, ref.paged_attention(*b.args()))


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_prefill(heads, dtype, causal):
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 15, 0, 17, 31]
    T = sum(lengths)
    q = randn((T, heads[0], 32), dtype, "cpu", gen)
    k = randn((T, heads[1], 32), dtype, "cpu", gen)
    v = randn((T, heads[1], 32), dtype, "cpu", gen)
    o = ref.prefill_attention(q, k, v, cu_seqlens(lengths, "cpu"), 31, causal=causal, out=poisoned(q))
    check(o, naive_prefill(q, k, v, lengths, causal, 32**-0.5), dtype, "prefill")


def test_prefill_noncontiguous_qkv_and_scale():
    """q/k/v as views of one fused projection (row stride > Hq * D), as a model produces them."""
    gen = torch.Generator().manual_seed(12)
    lengths = [7, 20]
    T, Hq, Hkv, D = sum(lengths), 8, 2, 16
    qkv = randn((T, (Hq + 2 * Hkv) * D), torch.float32, "cpu", gen)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    o = ref.prefill_attention(q, k, v, cu_seqlens(lengths, "cpu"), 20, scale=0.11)
    check(o, naive_prefill(q, k, v, lengths, True, 0.11), torch.float32, "fused qkv")


def test_prefill_equals_paged_without_prefix():
    """A fresh prompt (q_len == kv_len) gives the same answer through either path."""
    b = make_paged_batch([(9, 9), (20, 20)], 8, 4, 16, 16, torch.float32, "cpu", seed=13)
    flat_k = b.k_cache.reshape(-1, 4, 16)
    flat_v = b.v_cache.reshape(-1, 4, 16)
    slots = torch.cat(
        [
            b.block_table[i, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
            for i, (n, _) in enumerate(b.pairs)
        ]
    )
    o_prefill = ref.prefill_attention(b.q, flat_k[slots], flat_v[slots], b.cu_seqlens_q, 20)
    assert_close(o_prefill, ref.paged_attention(*b.args()), 1e-6, "prefill vs paged")


# ----------------------------------------------------------------------------------------------
# sparse
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_seq_lens", [True, False], ids=["seq_lens", "no_seq_lens"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (5, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_sparse(heads, dtype, with_seq_lens):
    pairs = [(1, 40), (4, 9), (0, 3), (6, 30)]
    b = make_paged_batch(pairs, heads[0], heads[1], 16, 8, dtype, "cpu", seed=17)
    gen = torch.Generator().manual_seed(18)
    topk = sparse_indices(pairs, 12, gen, empty_rows=(2,))
    o = ref.sparse_attention(
        b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, topk,
        seq_lens=b.seq_lens if with_seq_lens else None, out=poisoned(b.q),
    )  # fmt: skip
    check(o, naive_sparse(b, topk, 0.25), dtype, "sparse")
    assert torch.equal(o[2], torch.zeros_like(o[2])), "a token without any valid index must output zeros"


def test_sparse_all_positions_equals_paged():
    """Selecting every position 0..pos is dense causal attention."""
    pairs = [(1, 20), (3, 11)]
    b = make_paged_batch(pairs, 8, 2, 16, 4, torch.float32, "cpu", seed=19)
    rows = []
    for q_len, kv_len in pairs:
        for j in range(q_len):
            pos = kv_len - q_len + j
            row = torch.full((20,), -1, dtype=torch.int32)
            row[: pos + 1] = torch.arange(pos + 1)
            rows.append(row)
    o = ref.sparse_attention(
        b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, torch.stack(rows), seq_lens=b.seq_lens
    )
    assert_close(o, ref.paged_attention(*b.args()), 1e-6, "sparse(all) vs paged")


def test_sparse_no_indices_at_all():
    b = make_paged_batch([(3, 5)], 4, 2, 16, 4, torch.float32, "cpu")
    o = ref.sparse_attention(
        b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, torch.empty(3, 0, dtype=torch.int32)
    )
    assert torch.equal(o, torch.zeros_like(o))


# ----------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------


def naive_merge(o_parts, lse_parts):
    S, T, H, D = o_parts.shape
    o = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            live = [s for s in range(S) if lse_parts[s, t, h] != float("-inf")]
            if not live:
                continue
            m = max(float(lse_parts[s, t, h]) for s in live)
            total = sum(math.exp(float(lse_parts[s, t, h]) - m) for s in live)
            lse[t, h] = m + math.log(total)
            for s in live:
                o[t, h] += math.exp(float(lse_parts[s, t, h]) - lse[t, h]) * o_parts[s, t, h].double()
    return o, lse


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("num_parts", [1, 2, 7])
def test_merge(num_parts, dtype):
    gen = torch.Generator().manual_seed(23)
    o_parts = randn((num_parts, 6, 3, 16), dtype, "cpu", gen)
    lse_parts = randn((num_parts, 6, 3), torch.float32, "cpu", gen) * 4
    lse_parts[0, 1, 0] = float("-inf")  # one empty segment
    lse_parts[:, 2, 1] = float("-inf")  # every segment empty
    o_parts[:, 2, 1] = float("nan")  # ... whatever their outputs hold
    o, lse = ref.merge_attention_states(o_parts, lse_parts)
    o64, lse64 = naive_merge(o_parts, lse_parts)
    assert o.dtype == dtype and lse.dtype == torch.float32
    check(o, o64, dtype, "merge o")
    assert torch.equal(o[2, 1], torch.zeros_like(o[2, 1]))
    assert lse[2, 1] == float("-inf")
    assert_close(lse, lse64.float(), 1e-6, "merge lse")


def test_merge_of_split_attention_is_full_attention():
    """Attention over disjoint key segments, merged by lse, equals attention over all keys."""
    gen = torch.Generator().manual_seed(29)
    T, H, D, N = 5, 2, 16, 40
    q = randn((T, H, D), torch.float64, "cpu", gen)
    k = randn((N, H, D), torch.float64, "cpu", gen)
    v = randn((N, H, D), torch.float64, "cpu", gen)
    scores = torch.einsum("thd,nhd->thn", q, k) * 0.25
    full = torch.einsum("thn,nhd->thd", torch.softmax(scores, -1), v)
    cuts = [0, 7, 7, 30, N]  # includes an empty segment
    o_parts, lse_parts = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        s = scores[..., lo:hi]
        lse = torch.logsumexp(s, -1) if hi > lo else torch.full((T, H), float("-inf"), dtype=torch.float64)
        o_parts.append(
            torch.einsum("thn,nhd->thd", torch.softmax(s, -1), v[lo:hi])
            if hi > lo
            else torch.zeros(T, H, D, dtype=torch.float64)
        )
        lse_parts.append(lse)
    o, lse = ref.merge_attention_states(torch.stack(o_parts).float(), torch.stack(lse_parts).float())
    assert_close(o, full.float(), 1e-5, "merged o")
    assert_close(lse, torch.logsumexp(scores, -1).float(), 1e-5, "merged lse")


# ----------------------------------------------------------------------------------------------
# store
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_store_kvcache(slot_dtype):
    gen = torch.Generator().manual_seed(31)
    num_blocks, bs, Hkv, D, T = 5, 4, 2, 16, 9
    k = randn((T, Hkv, D), torch.float16, "cpu", gen)
    v = randn((T, Hkv, D), torch.float16, "cpu", gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:T].to(slot_dtype)
    slots[[2, 5]] = -1
    k_cache = torch.full((num_blocks, bs, Hkv, D), float("nan"), dtype=torch.float16)
    v_cache = k_cache.clone()
    ref.store_kvcache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t])
    written = set(slots[slots >= 0].tolist())
    for s in range(num_blocks * bs):
        if s not in written:
            assert torch.isnan(flat_k[s]).all() and torch.isnan(flat_v[s]).all()
