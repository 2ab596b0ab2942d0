"""Cascade decode (shared prefix read once, then each request's suffix, merged) == plain decode."""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
import tilellm.kernels.reference as ref
from tests.kernels.helpers import assert_close, tolerance


def make_batch(suffix_lens, prefix_len, hq, hkv, d, page, dtype, device, seed=0):
    """Requests sharing the physical blocks of a `prefix_len`-key prefix, each with its own suffix.

    Blocks are a random permutation of a pool with spare blocks full of random data, so reading
    a wrong block gives a wrong answer.
    """
    gen = torch.Generator().manual_seed(seed)
    n_prefix = -(-prefix_len // page)
    seq_lens = [prefix_len + s for s in suffix_lens]
    own = [-(-s // page) - n_prefix for s in seq_lens]
    total = n_prefix + sum(own) + 5
    perm = torch.randperm(total, generator=gen)
    k_cache = torch.randn(total, page, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(total, page, hkv, d, generator=gen).to(dtype)
    table = torch.full((len(seq_lens), n_prefix + max(own) + 2), -1, dtype=torch.int32)
    table[:, :n_prefix] = perm[:n_prefix].int()
    used = n_prefix
    for i, n in enumerate(own):
        table[i, n_prefix : n_prefix + n] = perm[used : used + n].int()
        used += n
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return (
        to(q),
        to(k_cache),
        to(v_cache),
        to(table),
        to(torch.tensor(seq_lens, dtype=torch.int32)),
        to(torch.tensor([prefix_len], dtype=torch.int32)),
    )


CASES = [
    # suffix lengths, prefix, (Hq, Hkv), D, page
    ([1, 5, 17, 40, 3], 32, (8, 2), 32, 16),
    ([1, 1, 1], 48, (4, 4), 16, 16),
    ([7, 20, 33, 2], 0, (8, 2), 32, 16),  # no shared prefix: plain decode through the cascade path
    ([1, 4, 9, 1, 2, 30], 37, (10, 2), 16, 1),  # prefix not a multiple of anything, GQA 5
    ([3, 4, 5, 6, 1, 1, 2, 9, 16], 64, (8, 1), 64, 16),  # MQA
    ([1] * 20, 80, (4, 2), 32, 16),  # more queries than one prefix tile
    ([0, 3, 0], 48, (4, 2), 16, 16),  # a request whose last key ends the prefix (empty suffix)
]


# Every case in both dtypes at 1 and 3 prefix segments; the default count (None: 7 segments
# under the interpreter, the most programs and shortest segments) in fp32 only: the count is
# chosen from the tile shape, not the dtype, and fp16's loads and casts are those of 1 and 3.
SPLITS_DTYPES = [
    pytest.param(splits, dtype, id=f"{splits}-{name}")
    for splits in (None, 1, 3)
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16"))
    if not (splits is None and dtype == torch.float16)
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("prefix_splits, dtype", SPLITS_DTYPES)
def test_cascade_matches_decode(case, dtype, prefix_splits, device):
    suffix, prefix, (hq, hkv), d, page = case
    q, kc, vc, table, seq_lens, prefix_len = make_batch(suffix, prefix, hq, hkv, d, page, dtype, device)
    out = torch.full_like(q, float("nan"))
    tk.cascade_decode_attention(q, kc, vc, table, seq_lens, prefix_len, prefix_splits=prefix_splits, out=out)
    expected = ref.decode_attention(q, kc, vc, table, seq_lens)
    assert_close(out, expected, tolerance(dtype, device), f"cascade {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cascade_large(dtype, device):
    q, kc, vc, table, seq_lens, prefix_len = make_batch(
        [int(x) for x in torch.randint(1, 300, (256,), generator=torch.Generator().manual_seed(1))],
        2048, 32, 8, 128, 16, dtype, device,
    )  # fmt: skip
    got = tk.cascade_decode_attention(q, kc, vc, table, seq_lens, prefix_len)
    assert_close(got, ref.decode_attention(q, kc, vc, table, seq_lens), tolerance(dtype, device), "E2-like")


@pytest.mark.parametrize("module", [tk, ref], ids=["triton", "reference"])
def test_invalid_prefix_raises(module):
    q, kc, vc, table, seq_lens, prefix_len = make_batch([1, 5, 9], 32, 4, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"prefix_len 50 must be in \[0, min\(seq_lens\) = 33\]"):
        module.cascade_decode_attention(q, kc, vc, table, seq_lens, torch.tensor([50], dtype=torch.int32))
    bad = table.clone()
    bad[1, 1] = bad[0, 1] + 1 if bad[0, 1] + 1 < kc.shape[0] else 0
    with pytest.raises(ValueError, match="first 2 blocks of every block_table row"):
        module.cascade_decode_attention(q, kc, vc, bad, seq_lens, prefix_len)
    with pytest.raises(ValueError, match="prefix_len must be a 1-element int tensor"):
        module.cascade_decode_attention(q, kc, vc, table, seq_lens, 32)


def test_zero_dim_prefix_len_raises():
    q, kc, vc, table, seq_lens, _ = make_batch([1, 5, 9], 32, 4, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"shape \[1\]"):
        tk.cascade_decode_attention(q, kc, vc, table, seq_lens, torch.tensor(32, dtype=torch.int32))


def test_graph_padding_rows(device):
    """A CUDA-graph bucket pads the batch with rows of seq_len 1 and stale block-table rows: the
    real rows must be exact and the padding rows finite (their outputs are discarded)."""
    q, kc, vc, table, seq_lens, prefix_len = make_batch(
        [3, 9, 1, 20], 48, 8, 2, 32, 16, torch.float32, device
    )
    pad = 5
    gen = torch.Generator().manual_seed(9)
    stale = torch.randint(0, kc.shape[0], (pad, table.shape[1]), generator=gen, dtype=torch.int32).to(device)
    q_all = torch.cat([q, torch.randn(pad, *q.shape[1:], generator=gen).to(device)])
    table_all = torch.cat([table, stale])
    seq_all = torch.cat([seq_lens, torch.ones(pad, dtype=torch.int32, device=device)])
    # validation would (rightly) reject seq_len 1 < prefix_len on CPU: call the kernel path directly
    import tilellm.kernels.paged as paged

    out = torch.full_like(q_all, float("nan"))
    real_check = paged.validation.check_cascade_prefix
    try:
        paged.validation.check_cascade_prefix = lambda *a, **k: None
        tk.cascade_decode_attention(q_all, kc, vc, table_all, seq_all, prefix_len, out=out)
    finally:
        paged.validation.check_cascade_prefix = real_check
    assert_close(
        out[: q.shape[0]], ref.decode_attention(q, kc, vc, table, seq_lens), tolerance(q.dtype, device)
    )
    assert bool(torch.isfinite(out[q.shape[0] :]).all())


@pytest.mark.parametrize("rows,block_n", [(128, 64), (64, 128), (128, 32)])
def test_gpu_tile_shapes(rows, block_n, device):
    """The tile shapes the GPU uses (forced here, so the interpreter runs them too)."""
    from tilellm.kernels import config

    q, kc, vc, table, seq_lens, prefix_len = make_batch(
        [1, 7, 30, 2] * 10, 200, 8, 2, 16, 16, torch.float32, device
    )  # fmt: skip
    with config.override(paged=config.TileConfig(rows, block_n, 4, 1)):
        got = tk.cascade_decode_attention(q, kc, vc, table, seq_lens, prefix_len, prefix_splits=3)
    assert_close(got, ref.decode_attention(q, kc, vc, table, seq_lens), tolerance(q.dtype, device), "tiles")
