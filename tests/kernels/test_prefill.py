"""`prefill_attention` (Triton) against its PyTorch twin: packed varlen requests over their own K/V.

Lengths mix 1, tile sizes +- 1, primes and empty requests in one launch, causal and full, GQA,
every head dim; outputs are poisoned so a query tile the kernel skips shows up.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import DTYPES, assert_close, cu_seqlens, poisoned, randn, tolerance
from tilellm.kernels import reference as ref

GQA = [(4, 4), (8, 4), (8, 2), (5, 1), (10, 2)]
LENGTHS = [1, 15, 0, 16, 17, 37, 33]  # around the interpreter's 16-key and 32-query tiles


def make(lengths, heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = randn((T, heads[0], head_dim), dtype, device, gen)
    k = randn((T, heads[1], head_dim), dtype, device, gen)
    v = randn((T, heads[1], head_dim), dtype, device, gen)
    return q, k, v, cu_seqlens(lengths, device), max(lengths, default=0)


def run_and_check(args, device, what, **kw):
    q = args[0]
    out = poisoned(q)
    o = tk.prefill_attention(*args, out=out, **kw)
    assert o is out
    assert_close(o, ref.prefill_attention(*args, **kw), tolerance(q.dtype, device), what)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_mixed_lengths_gqa(heads, dtype, causal, device):
    args = make(LENGTHS, heads, 32, dtype, device, seed=heads[0] + heads[1])
    run_and_check(args, device, f"heads={heads} causal={causal}", causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_head_dims(head_dim, dtype, device):
    lengths = [1, 17, 40] if head_dim <= 64 else [1, 33]
    run_and_check(make(lengths, (4, 2), head_dim, dtype, device, seed=head_dim), device, f"D={head_dim}")


def test_long_and_short_requests(device):
    """A 129-token prompt beside one-token ones: many query tiles of one request, few of others."""
    run_and_check(make([129, 1, 2, 65], (4, 2), 16, torch.float16, device, seed=3), device, "129")


def test_large_scores(device):
    """Scores in the hundreds: the online softmax must rescale, not overflow exp."""
    q, k, v, cu, max_len = make(LENGTHS, (8, 2), 32, torch.float32, device, seed=8)
    run_and_check((q * 30, k, v, cu, max_len), device, "large scores")


def test_custom_scale(device):
    run_and_check(make(LENGTHS, (8, 2), 32, torch.float32, device, seed=4), device, "scale", scale=0.05)


def test_strided_qkv_from_fused_projection(device):
    lengths = [5, 20, 1]
    T, Hq, Hkv, D = sum(lengths), 8, 2, 32
    gen = torch.Generator().manual_seed(5)
    qkv = randn((T, (Hq + 2 * Hkv) * D), torch.float32, device, gen)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=1))
    run_and_check((q, k, v, cu_seqlens(lengths, device), 20), device, "fused qkv views")
    wide = torch.full((T, Hq + 4, D), float("nan"), device=device)
    o = tk.prefill_attention(q, k, v, cu_seqlens(lengths, device), 20, out=wide[:, 2 : Hq + 2])
    expected = ref.prefill_attention(q, k, v, cu_seqlens(lengths, device), 20)
    assert_close(o, expected, tolerance(torch.float32, device), "strided out")
    assert torch.isnan(wide[:, :2]).all() and torch.isnan(wide[:, Hq + 2 :]).all(), "wrote outside out's view"


def test_max_seqlen_larger_than_needed(device):
    q, k, v, cu, _ = make([3, 9], (4, 2), 16, torch.float32, device, seed=6)
    run_and_check((q, k, v, cu, 70), device, "max_seqlen=70")


def test_empty_inputs(device):
    q, k, v, cu, _ = make([0, 0], (4, 2), 16, torch.float32, device)
    assert tk.prefill_attention(q, k, v, cu, 0).shape == (0, 4, 16)


def test_inputs_unchanged(device):
    args = make([7, 20], (8, 2), 16, torch.float32, device, seed=7)
    before = [a.clone() for a in args[:4]]
    tk.prefill_attention(*args)
    for a, a0 in zip(args[:4], before):
        assert torch.equal(a, a0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (40, 8)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_real_shapes(heads, head_dim, dtype, device):
    lengths = [2048, 1, 127, 128, 129, 1000, 3]
    run_and_check(make(lengths, heads, head_dim, dtype, device, seed=head_dim), device, "gpu")
