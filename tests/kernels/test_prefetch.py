"""`tilellm.kernels.prefetch`: the L2 prefetch table of a layer's later weights, and the rotary
launch that asks for it (a hint: its outputs do not change)."""

from __future__ import annotations

import pytest
import torch

from tilellm.kernels import fused, prefetch
from tilellm.kernels.prefetch import check_l2_prefetch_table, l2_prefetch_enabled, l2_prefetch_table

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_table_covers_each_tensor_in_chunks():
    a = torch.zeros(1001, dtype=torch.bfloat16)  # 2002 bytes: 2000 in whole 16-byte lines
    b = torch.zeros(64, 32, dtype=torch.float32)  # 8192 bytes
    table = l2_prefetch_table([a, b], chunk_bytes=1024)
    assert table.dtype == torch.int64 and table.shape == (2, 2 + 8)
    addrs, sizes = table.tolist()
    assert addrs[:2] == [a.data_ptr(), a.data_ptr() + 1024] and sizes[:2] == [1024, 976]
    assert addrs[2:] == [b.data_ptr() + 1024 * i for i in range(8)] and sizes[2:] == [1024] * 8
    assert all(s % 16 == 0 for s in sizes)


def test_table_rejects_what_it_cannot_prefetch():
    with pytest.raises(ValueError, match="multiple of 16"):
        l2_prefetch_table([torch.zeros(64)], chunk_bytes=1000)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch_table([torch.zeros(64, 64).t()])
    with pytest.raises(ValueError, match=r"int64 \[2, chunks\]"):
        check_l2_prefetch_table(torch.zeros(3, 4, dtype=torch.int64), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"int64 \[2, chunks\]"):
        check_l2_prefetch_table(torch.zeros(2, 4), torch.device("cpu"))
    check_l2_prefetch_table(None, torch.device("cpu"))


def test_off_unless_asked_and_capable(monkeypatch):
    monkeypatch.delenv("TILELLM_L2_PREFETCH", raising=False)
    assert not l2_prefetch_enabled(torch.device("cpu"))
    monkeypatch.setenv("TILELLM_L2_PREFETCH", "1")
    assert not l2_prefetch_enabled(torch.device("cpu"))  # no bulk prefetch off a CUDA device
    if torch.cuda.is_available():
        assert l2_prefetch_enabled(torch.device("cuda")) == HOPPER
        monkeypatch.setenv("TILELLM_L2_PREFETCH", "0")
        assert not l2_prefetch_enabled(torch.device("cuda"))


@pytest.mark.parametrize("tokens", [1, prefetch.L2_PREFETCH_MAX_ROWS, prefetch.L2_PREFETCH_MAX_ROWS + 1])
def test_rotary_store_gives_the_same_bits_with_a_prefetch_table(device, tokens):
    """The rotation and the cache store with the table (prefetched on Hopper, for steps of up to
    L2_PREFETCH_MAX_ROWS tokens) give the bits of the same call without it."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(tokens)
    hq, hk, d, blocks, page = 4, 2, 64, 8, 16

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = randn(tokens, hq, d), randn(tokens, hk, d), randn(tokens, hk, d)
    positions = torch.randperm(100, generator=gen)[:tokens].to(device)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(128).float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    qw, kw = randn(d), randn(d)
    slots = torch.randperm(blocks * page, generator=gen)[:tokens].to(device)
    weights = [randn(256, 64), randn(64, 128)]
    table = l2_prefetch_table(weights, chunk_bytes=4096)
    outs = []
    for l2 in (None, table):
        k_cache = torch.zeros(blocks, page, hk, d, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q_out, k_out = fused.apply_rotary(
            q, k, positions, cos_sin, q_norm_weight=qw, k_norm_weight=kw, v=v, k_cache=k_cache,
            v_cache=v_cache, slot_mapping=slots, l2_prefetch=l2,
        )  # fmt: skip
        outs.append((q_out, k_out, k_cache, v_cache))
    for plain, prefetched in zip(*outs):
        assert torch.equal(plain, prefetched)
    planned = [launch.prefetch for launch in fused._ROTARY_REMEMBERED.values() if launch.grid[0] > 0]
    assert planned, "the calls were not planned"
    if device == "cuda" and HOPPER and tokens <= prefetch.L2_PREFETCH_MAX_ROWS:
        assert any(planned), "no launch asked for the table"
    elif device == "cpu":
        assert not any(planned), "a launch off a CUDA device planned the bulk prefetch"
