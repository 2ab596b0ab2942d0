"""`decode_attention` (Triton) against its PyTorch twin: one query per request at `seq_lens[i] - 1`.

Contexts of 1, block_size +- 1 and primes, GQA packing, every block size, and forced or planned
split-KV; outputs are poisoned so an unwritten head shows up.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import DTYPES, assert_close, make_paged_batch, poisoned, tolerance
from tilellm.kernels import reference as ref
from tilellm.kernels import schedule
from tilellm.kernels.schedule import plan_split_kv

GQA = [(4, 4), (8, 4), (8, 2), (5, 1), (10, 2), (32, 1)]  # the last: more heads per group than tile rows


def decode_args(b):
    return b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens


def run_and_check(b, device, what, **kw):
    out = poisoned(b.q)
    o = tk.decode_attention(*decode_args(b), out=out, **kw)
    assert o is out
    expected = ref.decode_attention(*decode_args(b), scale=kw.get("scale"))
    assert_close(o, expected, tolerance(b.q.dtype, device), what)
    return o


def contexts(block_size):
    return [1, max(block_size - 1, 1), block_size, block_size + 1, 37, 2 * block_size + 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_gqa(heads, dtype, device):
    b = make_paged_batch([(1, n) for n in contexts(16)], *heads, 32, 16, dtype, device, seed=heads[0])
    run_and_check(b, device, f"heads={heads}")


# Every head dim at 1-, 16- and 64-key pages; 256-key pages (longer than a key tile, contexts
# up to 515 keys: the priciest under the interpreter) at head dim 64 only. The page walk does
# not depend on the head dim, nor the head's width on the page size.
BLOCK_SIZES_HEAD_DIMS = [(bs, d) for bs in (1, 16, 64) for d in (16, 64, 256)] + [(256, 64)]


@pytest.mark.parametrize(
    "block_size, head_dim", BLOCK_SIZES_HEAD_DIMS, ids=[f"{d}-{bs}" for bs, d in BLOCK_SIZES_HEAD_DIMS]
)
def test_block_sizes_and_head_dims(block_size, head_dim, device):
    b = make_paged_batch(
        [(1, n) for n in contexts(block_size)], 8, 2, head_dim, block_size, torch.float32, device
    )
    run_and_check(b, device, f"bs={block_size} D={head_dim}")


_PLANNED: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the planned count's output


@pytest.mark.parametrize("num_splits", [1, 2, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_splits_agree(num_splits, dtype, device):
    b = make_paged_batch([(1, 300), (1, 1), (1, 95)], 8, 2, 32, 16, dtype, device, seed=3)
    o = run_and_check(b, device, f"num_splits={num_splits}", num_splits=num_splits)
    # The batch is the same for every num_splits: the planned launch runs once per dtype.
    if (dtype, device) not in _PLANNED:
        _PLANNED[dtype, device] = tk.decode_attention(*decode_args(b))
    assert_close(o, _PLANNED[dtype, device], tolerance(dtype, device), f"num_splits={num_splits} vs None")


def test_heuristic_splits_long_context(device):
    """num_splits=None splits a context long enough for a few segments (whatever the tuning)."""
    long = 3 * schedule.MIN_KEYS_PER_SPLIT + 37
    b = make_paged_batch([(1, long), (1, 1), (1, 95)], 4, 1, 32, 16, torch.float32, device, seed=3)
    plan = plan_split_kv(b.cu_seqlens_q, b.seq_lens, 4, 1, head_dim=32, dtype=torch.float32)
    assert plan.num_splits > 1, plan.reason  # three requests, one KV head: far from filling the GPU
    run_and_check(b, device, "num_splits=None")


def test_matches_paged_with_one_token_per_request(device):
    b = make_paged_batch([(1, n) for n in contexts(16)], 8, 2, 32, 16, torch.float32, device, seed=4)
    o_paged = tk.paged_attention(*b.args())
    assert_close(
        run_and_check(b, device, "decode"), o_paged, tolerance(torch.float32, device), "decode vs paged"
    )


def test_strided_q_and_out(device):
    b = make_paged_batch([(1, 20), (1, 7), (1, 40)], 8, 2, 32, 16, torch.float32, device, seed=7)
    wide_q = torch.randn(3, 12, 32, device=device)
    wide_q[:, 4:] = b.q
    wide_o = torch.full((3, 12, 32), float("nan"), device=device)
    o = tk.decode_attention(wide_q[:, 4:], b.k_cache, b.v_cache, b.block_table, b.seq_lens, out=wide_o[:, :8])
    assert_close(o, ref.decode_attention(*decode_args(b)), tolerance(torch.float32, device), "strided")
    assert torch.isnan(wide_o[:, 8:]).all(), "wrote outside out's view"


def test_custom_scale(device):
    b = make_paged_batch([(1, 20), (1, 7)], 8, 2, 32, 16, torch.float32, device, seed=5)
    run_and_check(b, device, "scale", scale=1.7)


def test_empty_batch(device):
    b = make_paged_batch([], 8, 2, 32, 16, torch.float32, device)
    assert tk.decode_attention(*decode_args(b)).shape == (0, 8, 32)


def test_block_ids_past_int32_offsets(device):
    block_size, Hkv, D = 16, 2, 64
    first = (1 << 31) // (block_size * Hkv * D) + 8
    b = make_paged_batch(
        [(1, 33), (1, 5)], 4, Hkv, D, block_size, torch.float16, device, seed=6, first_block=first
    )
    assert b.block_table.min() * b.k_cache.stride(0) >= 2**31
    run_and_check(b, device, "huge block ids")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("batch", [1, 7, 256])
def test_gpu_real_shapes(batch, num_splits, dtype, device):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 1025, (batch,), generator=gen).tolist()
    lens[0] = 32768
    b = make_paged_batch([(1, n) for n in lens], 32, 8, 128, 16, dtype, device, seed=batch)
    run_and_check(b, device, f"gpu batch={batch}", num_splits=num_splits)
