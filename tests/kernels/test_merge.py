"""`merge_attention_states` (Triton) against its PyTorch twin, and against attention over all keys."""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import DTYPES, assert_close, randn, tolerance
from tilellm.kernels import reference as ref


def make(S, T, H, D, dtype, device, seed=0, lse_scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    o_parts = randn((S, T, H, D), dtype, device, gen)
    lse_parts = randn((S, T, H), torch.float32, device, gen) * lse_scale
    return o_parts, lse_parts


def check(o_parts, lse_parts, device, what):
    o, lse = tk.merge_attention_states(o_parts, lse_parts)
    o_ref, lse_ref = ref.merge_attention_states(o_parts, lse_parts)
    assert o.dtype == o_parts.dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, tolerance(o_parts.dtype, device), f"{what}: o")
    assert_close(lse, lse_ref, tolerance(torch.float32, device), f"{what}: lse")
    return o, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_parts", [1, 2, 3, 7, 9, 16, 40])
def test_parts(num_parts, dtype, device):
    """Every lane count of the kernel: 8 lanes (up to 8 parts), 16 (9-16), 64 (17-64)."""
    check(*make(num_parts, 9, 5, 32, dtype, device, seed=num_parts), device, f"S={num_parts}")


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_head_dims(head_dim, device):
    check(*make(3, 4, 3, head_dim, torch.float32, device, seed=head_dim), device, f"D={head_dim}")


def test_large_lse_values(device):
    """Log-sum-exps far from 0 (long contexts, large scores) must not overflow exp."""
    o_parts, lse_parts = make(4, 6, 2, 32, torch.float32, device, seed=3, lse_scale=1.0)
    lse_parts += torch.tensor([300.0, -300.0, 88.0, 1e4], device=device)[:, None, None]
    check(o_parts, lse_parts, device, "large lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts(dtype, device):
    """Segments with lse = -inf weigh nothing; all empty gives o = 0 and lse = -inf."""
    o_parts, lse_parts = make(3, 5, 4, 16, dtype, device, seed=4)
    lse_parts[0, 1, 0] = float("-inf")
    lse_parts[:2, 2, 1] = float("-inf")
    lse_parts[:, 3, 2] = float("-inf")
    o_parts[:, 3, 2] = 0.0  # what the split-KV kernel writes for an empty segment
    o, lse = check(o_parts, lse_parts, device, "empty parts")
    assert torch.equal(o[3, 2].float().cpu(), torch.zeros(16))
    assert lse[3, 2] == float("-inf")


def test_empty_parts_ignore_their_output(device):
    """An empty segment's output is undefined (may be garbage): it must not leak into the result."""
    o_parts, lse_parts = make(3, 5, 4, 16, torch.float32, device, seed=5)
    lse_parts[1, :, 0] = float("-inf")
    o_parts[1, :, 0] = float("nan")
    lse_parts[:, 4, 3] = float("-inf")
    o_parts[:, 4, 3] = float("nan")
    o, _ = check(o_parts, lse_parts, device, "NaN in empty parts")
    assert torch.equal(o[4, 3].cpu(), torch.zeros(16))


def test_strided_parts(device):
    """o_parts / lse_parts as views (e.g. slices of a larger scratch buffer)."""
    o_big, lse_big = make(4, 7, 6, 32, torch.float32, device, seed=6)
    check(o_big[:, 1:6, 2:5], lse_big[:, 1:6, 2:5], device, "strided")


def test_merge_of_segments_is_full_attention(device):
    gen = torch.Generator().manual_seed(7)
    T, H, D, N = 6, 3, 32, 50
    q, k, v = (randn(s, torch.float32, device, gen) for s in [(T, H, D), (N, H, D), (N, H, D)])
    scores = torch.einsum("thd,nhd->thn", q, k) * D**-0.5
    full = torch.einsum("thn,nhd->thd", torch.softmax(scores, -1), v)
    cuts = [0, 16, 17, 40, N]
    o_parts = torch.stack(
        [
            torch.einsum("thn,nhd->thd", torch.softmax(scores[..., a:b], -1), v[a:b])
            for a, b in zip(cuts, cuts[1:])
        ]
    )
    lse_parts = torch.stack([torch.logsumexp(scores[..., a:b], -1) for a, b in zip(cuts, cuts[1:])])
    o, lse = tk.merge_attention_states(o_parts, lse_parts)
    assert_close(o, full, tolerance(torch.float32, device), "merged o")
    assert_close(lse, torch.logsumexp(scores, -1), tolerance(torch.float32, device), "merged lse")


def test_inputs_unchanged(device):
    o_parts, lse_parts = make(3, 4, 2, 16, torch.float32, device)
    before = o_parts.clone(), lse_parts.clone()
    tk.merge_attention_states(o_parts, lse_parts)
    assert torch.equal(o_parts, before[0]) and torch.equal(lse_parts, before[1])


def test_no_tokens(device):
    o, lse = tk.merge_attention_states(*make(2, 0, 4, 16, torch.float32, device))
    assert o.shape == (0, 4, 16) and lse.shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_real_shapes(dtype, device):
    check(*make(11, 4096, 32, 128, dtype, device, seed=8), device, "gpu")
