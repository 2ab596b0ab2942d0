"""`sparse_attention` (Triton) against its PyTorch twin: each token attends to its own top-k positions.

Index rows hold distinct positions up to the token's own, with -1 entries scattered anywhere in
the row, one row with no valid entry at all (zeros out), K not a multiple of the kernel's chunk,
with and without `seq_lens`.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import DTYPES, assert_close, make_paged_batch, poisoned, sparse_indices, tolerance
from tilellm.kernels import reference as ref

GQA = [(4, 4), (8, 4), (8, 2), (5, 1), (10, 2)]
PAIRS = [(1, 40), (4, 9), (0, 3), (6, 30)]


def run_and_check(b, topk, device, what, *, with_seq_lens=True, **kw):
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, topk.to(device))
    seq_lens = b.seq_lens if with_seq_lens else None
    out = poisoned(b.q)
    o = tk.sparse_attention(*args, seq_lens=seq_lens, out=out, **kw)
    assert o is out
    assert_close(o, ref.sparse_attention(*args, seq_lens=seq_lens, **kw), tolerance(b.q.dtype, device), what)
    return o


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_gqa(heads, dtype, device):
    b = make_paged_batch(PAIRS, *heads, 32, 8, dtype, device, seed=heads[0])
    topk = sparse_indices(PAIRS, 20, torch.Generator().manual_seed(1), empty_rows=(2,))
    o = run_and_check(b, topk, device, f"heads={heads}")
    assert torch.equal(o[2].float().cpu(), torch.zeros(o.shape[1:])), (
        "a token without indices must output zeros"
    )


@pytest.mark.parametrize("with_seq_lens", [True, False], ids=["seq_lens", "no_seq_lens"])
@pytest.mark.parametrize("num_k", [1, 16, 17, 64])
def test_num_indices(num_k, with_seq_lens, device):
    b = make_paged_batch(PAIRS, 8, 2, 32, 8, torch.float32, device, seed=num_k)
    topk = sparse_indices(PAIRS, num_k, torch.Generator().manual_seed(num_k))
    run_and_check(b, topk, device, f"K={num_k}", with_seq_lens=with_seq_lens)


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
def test_block_sizes(block_size, device):
    bs = block_size
    pairs = [(1, max(bs - 1, 1)), (2, bs + 1), (3, 2 * bs + 3)]
    b = make_paged_batch(pairs, 8, 2, 32, bs, torch.float32, device, seed=bs)
    run_and_check(b, sparse_indices(pairs, 24, torch.Generator().manual_seed(bs)), device, f"bs={bs}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_head_dims(head_dim, dtype, device):
    pairs = [(1, 40), (3, 20)]
    b = make_paged_batch(pairs, 4, 2, head_dim, 16, dtype, device, seed=head_dim)
    run_and_check(
        b, sparse_indices(pairs, 16, torch.Generator().manual_seed(head_dim)), device, f"D={head_dim}"
    )


def test_every_position_is_dense_attention(device):
    """Selecting 0..pos for every token reproduces (Triton) paged attention."""
    pairs = [(1, 37), (3, 11)]
    b = make_paged_batch(pairs, 8, 2, 32, 4, torch.float32, device, seed=5)
    rows = []
    for q_len, kv_len in pairs:
        for j in range(q_len):
            pos = kv_len - q_len + j
            row = torch.full((40,), -1, dtype=torch.int32)
            row[: pos + 1] = torch.randperm(pos + 1)
            rows.append(row)
    o = run_and_check(b, torch.stack(rows), device, "all positions")
    assert_close(o, tk.paged_attention(*b.args()), tolerance(torch.float32, device), "sparse(all) vs paged")


def test_custom_scale_and_strided_q(device):
    b = make_paged_batch(PAIRS, 8, 2, 32, 8, torch.float32, device, seed=6)
    wide = torch.randn(b.q.shape[0], 12, 32, device=device)
    wide[:, 4:] = b.q
    b.q = wide[:, 4:]
    run_and_check(b, sparse_indices(PAIRS, 9, torch.Generator().manual_seed(6)), device, "scale", scale=0.9)


def test_large_scores(device):
    b = make_paged_batch(PAIRS, 8, 2, 32, 8, torch.float32, device, seed=9)
    b.q = b.q * 30
    run_and_check(b, sparse_indices(PAIRS, 40, torch.Generator().manual_seed(9)), device, "large scores")


def test_no_tokens(device):
    b = make_paged_batch([(0, 4)], 4, 2, 16, 8, torch.float32, device)
    o = tk.sparse_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        b.block_table,
        b.cu_seqlens_q,
        torch.empty(0, 8, dtype=torch.int32, device=device),
    )
    assert o.shape == (0, 4, 16)


def test_block_ids_past_int32_offsets(device):
    block_size, Hkv, D = 16, 2, 64
    first = (1 << 31) // (block_size * Hkv * D) + 8
    pairs = [(1, 40), (3, 21)]
    b = make_paged_batch(pairs, 4, Hkv, D, block_size, torch.float16, device, seed=7, first_block=first)
    assert b.block_table.min() * b.k_cache.stride(0) >= 2**31
    run_and_check(b, sparse_indices(pairs, 16, torch.Generator().manual_seed(7)), device, "huge block ids")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_real_shapes(dtype, device):
    pairs = [(1, 65536), (4, 3000), (1, 100)]
    b = make_paged_batch(pairs, 16, 1, 128, 64, dtype, device, seed=8)
    run_and_check(b, sparse_indices(pairs, 2048, torch.Generator().manual_seed(8)), device, "gpu 2048-of-64k")
