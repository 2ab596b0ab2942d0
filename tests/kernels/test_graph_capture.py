"""Every public kernel, called with its required arguments only, makes no device-to-host sync
and replays from a CUDA graph with new input values.

Why: the engine calls these kernels every step and captures its decode steps in CUDA graphs; a
sync (`.item()`, a plan read from a device tensor) stalls each step and breaks the capture. The
default path is tested because it is the one most callers take (no max_seqlen_k, num_splits, out=).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import PagedBatch, cu_seqlens, make_paged_batch, randn, sparse_indices
from tilellm.kernels.reference import fp8_gemm as ref_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and sync detection need a GPU"),
]

DEVICE = "cuda"
DTYPE = torch.bfloat16
PAGE = 16
MLA_RANK, MLA_ROPE = 512, 64  # DeepSeek's latent rows: 512 latent values + 64 rope values
SCALE = 0.15  # MLA's softmax scale (the absorbed width does not give it)
FP8_BLOCK = [128, 128]
# decode, verification, a chunk crossing blocks, an empty request, a fresh one-token prompt
MIXED = [(1, 37), (3, 20), (17, 40), (0, 7), (1, 1)]
# a context long enough that the split-KV planners cut it into segments
LONG = [(1, 5000), (1, 17)]


@dataclass
class Case:
    """A kernel call as most users make it, and new values for its inputs."""

    call: Callable[[], object]  # returns what the kernel wrote: a tensor, or a tuple of them
    refresh: Callable[[], None]  # new random values into the same input tensors, in place


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fill(gen: torch.Generator, *tensors: torch.Tensor) -> None:
    for t in tensors:
        t.copy_(randn(t.shape, t.dtype, t.device, gen))


def _step_lengths(b: PagedBatch, gen: torch.Generator) -> None:
    """New context lengths, in place, within 40 keys of the old ones. Every block-table column
    holds a valid block id (`make_paged_batch`), so any length up to the table's width x
    block_size is a valid batch; a request keeps at least its new tokens."""
    cap = b.block_table.shape[1] * b.k_cache.shape[1]
    lengths = []
    for q_len, kv_len in b.pairs:
        lo, hi = max(q_len, kv_len - 40), min(cap, kv_len + 40)
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    b.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# One builder per call: (device, dtype) -> Case
# ----------------------------------------------------------------------------------------------


def _slot_refiller(slots: torch.Tensor, num_slots: int, gen: torch.Generator) -> Callable[[], None]:
    """A function that refills `slots` [T] in place: distinct random slots of the cache's
    `num_slots`, about a quarter of them -1 (padding rows: skipped)."""

    def refill() -> None:
        s = torch.randperm(num_slots, generator=gen)[: slots.shape[0]].to(slots.dtype)
        s[torch.rand(slots.shape[0], generator=gen) < 0.25] = -1
        slots.copy_(s)

    return refill


def store_kvcache_case(device, dtype) -> Case:
    gen = _gen(1)
    T, Hkv, D, num_blocks = 37, 2, 128, 6
    k, v = randn((T, Hkv, D), dtype, device, gen), randn((T, Hkv, D), dtype, device, gen)
    k_cache = randn((num_blocks, PAGE, Hkv, D), dtype, device, gen)
    v_cache = randn((num_blocks, PAGE, Hkv, D), dtype, device, gen)
    slots = torch.empty(T, dtype=torch.int32, device=device)
    new_slots = _slot_refiller(slots, num_blocks * PAGE, gen)

    def call():
        tk.store_kvcache(k, v, k_cache, v_cache, slots)
        return k_cache, v_cache

    def refresh():
        _fill(gen, k, v)
        new_slots()

    new_slots()
    return Case(call, refresh)


def concat_and_cache_mla_case(device, dtype) -> Case:
    gen = _gen(2)
    T, L, Dr, num_blocks = 37, 512, 64, 6
    kv_c, k_pe = randn((T, L), dtype, device, gen), randn((T, Dr), dtype, device, gen)
    cache = randn((num_blocks, PAGE, 1, L + Dr), dtype, device, gen)
    slots = torch.empty(T, dtype=torch.int64, device=device)
    new_slots = _slot_refiller(slots, num_blocks * PAGE, gen)

    def call():
        tk.concat_and_cache_mla(kv_c, k_pe, cache, slots)
        return cache

    def refresh():
        _fill(gen, kv_c, k_pe)
        new_slots()

    new_slots()
    return Case(call, refresh)


def _prefill_case(lengths, device, dtype, seed) -> Case:
    gen = _gen(seed)
    T, hq, hkv, d = sum(lengths), 8, 2, 128
    q, k, v = (randn((T, h, d), dtype, device, gen) for h in (hq, hkv, hkv))
    cu, max_seqlen = cu_seqlens(lengths, device), max(lengths)
    return Case(lambda: tk.prefill_attention(q, k, v, cu, max_seqlen), lambda: _fill(gen, q, k, v))


def prefill_case(device, dtype) -> Case:
    return _prefill_case([37, 1, 100, 16], device, dtype, seed=2)


def prefill_long_case(device, dtype) -> Case:
    """Over 1024 tokens at D = 128: on an H100/H200 the Gluon kernel of hopper.py."""
    return _prefill_case([1100, 300], device, dtype, seed=3)


def _paged_case(pairs, hq, hkv, device, dtype, seed) -> Case:
    b = make_paged_batch(pairs, hq, hkv, 128, PAGE, dtype, device, seed=seed)
    gen = _gen(seed + 100)

    def refresh():
        _fill(gen, b.q, b.k_cache, b.v_cache)
        _step_lengths(b, gen)

    return Case(lambda: tk.paged_attention(*b.args()), refresh)


def paged_case(device, dtype) -> Case:
    return _paged_case(MIXED, 8, 2, device, dtype, seed=4)


def paged_long_case(device, dtype) -> Case:
    """Few programs and 5000 keys: the split-KV planner cuts the context into segments."""
    return _paged_case([(1, 5000), (4, 300)], 8, 2, device, dtype, seed=5)


def paged_chunks_case(device, dtype) -> Case:
    """Prompt chunks of >= 128 tokens, 64 heads of 128: on an H100/H200 hopper.py's paged kernel."""
    return _paged_case([(256, 1280), (200, 700)], 64, 8, device, dtype, seed=6)


def _decode_case(lengths, device, dtype, seed) -> Case:
    b = make_paged_batch([(1, n) for n in lengths], 8, 2, 128, PAGE, dtype, device, seed=seed)
    gen = _gen(seed + 100)

    def refresh():
        _fill(gen, b.q, b.k_cache, b.v_cache)
        _step_lengths(b, gen)

    return Case(lambda: tk.decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens), refresh)


def decode_case(device, dtype) -> Case:
    return _decode_case([37, 1, 16, 17], device, dtype, seed=7)


def decode_long_case(device, dtype) -> Case:
    """One request of 5000 keys, page 16: the split-KV planner cuts it into segments."""
    return _decode_case([n for _, n in LONG], device, dtype, seed=8)


def cascade_case(device, dtype) -> Case:
    """Four requests sharing the blocks of a 32-key prefix (row 0's first two blocks)."""
    prefix = 32
    b = make_paged_batch([(1, n) for n in (40, 33, 64, 32)], 8, 2, 128, PAGE, dtype, device, seed=9)
    shared = prefix // PAGE
    b.block_table[:, :shared] = b.block_table[:1, :shared].clone()
    prefix_len = torch.tensor([prefix], dtype=torch.int32, device=device)
    gen = _gen(109)

    def refresh():
        _fill(gen, b.q, b.k_cache, b.v_cache)
        # another prefix within the shared blocks (the argument is a device tensor for that)
        prefix_len.copy_(torch.randint(0, prefix + 1, (1,), generator=gen).to(torch.int32))

    def call():
        return tk.cascade_decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, prefix_len)

    return Case(call, refresh)


def sparse_case(device, dtype) -> Case:
    pairs = [(1, 40), (4, 9), (0, 3), (6, 30)]
    b = make_paged_batch(pairs, 8, 2, 128, PAGE, dtype, device, seed=10)
    gen = _gen(110)
    topk = sparse_indices(pairs, 20, gen).to(device)

    def refresh():
        _fill(gen, b.q, b.k_cache, b.v_cache)
        topk.copy_(sparse_indices(pairs, 20, gen))

    return Case(
        lambda: tk.sparse_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, topk), refresh
    )


def merge_case(device, dtype) -> Case:
    gen = _gen(11)
    o_parts = randn((3, 9, 8, 128), dtype, device, gen)
    lse_parts = randn((3, 9, 8), torch.float32, device, gen) * 4

    def refresh():
        _fill(gen, o_parts)
        lse_parts.copy_(randn(lse_parts.shape, torch.float32, device, gen) * 4)

    return Case(lambda: tk.merge_attention_states(o_parts, lse_parts), refresh)


def _mla_batch(pairs, device, dtype, seed) -> PagedBatch:
    """16 query heads over a latent cache of one row of 512 + 64 values per token."""
    return make_paged_batch(pairs, 16, 1, MLA_RANK + MLA_ROPE, PAGE, dtype, device, seed=seed)


def _mla_decode_case(lengths, device, dtype, seed) -> Case:
    b = _mla_batch([(1, n) for n in lengths], device, dtype, seed)
    gen = _gen(seed + 100)

    def refresh():
        _fill(gen, b.q, b.k_cache)
        _step_lengths(b, gen)

    def call():
        return tk.mla_decode_attention(
            b.q, b.k_cache, b.block_table, b.seq_lens, kv_lora_rank=MLA_RANK, scale=SCALE
        )

    return Case(call, refresh)


def mla_decode_case(device, dtype) -> Case:
    return _mla_decode_case([37, 1, 16, 17], device, dtype, seed=12)


def mla_decode_long_case(device, dtype) -> Case:
    """5000 keys over two programs: plan_mla cuts the context into segments."""
    return _mla_decode_case([n for _, n in LONG], device, dtype, seed=13)


def mla_paged_case(device, dtype) -> Case:
    b = _mla_batch(MIXED, device, dtype, seed=14)
    gen = _gen(114)

    def refresh():
        _fill(gen, b.q, b.k_cache)
        _step_lengths(b, gen)

    def call():
        return tk.mla_paged_attention(
            b.q,
            b.k_cache,
            b.block_table,
            b.cu_seqlens_q,
            b.seq_lens,
            b.max_seqlen_q,
            kv_lora_rank=MLA_RANK,
            scale=SCALE,
        )

    return Case(call, refresh)


def fused_moe_case(device, dtype) -> Case:
    gen = _gen(15)
    T, E, K, H, I = 33, 16, 4, 128, 96
    x = randn((T, H), dtype, device, gen)
    w13 = (randn((E, 2 * I, H), torch.float32, "cpu", gen) / H**0.5).to(device=device, dtype=dtype)
    w2 = (randn((E, H, I), torch.float32, "cpu", gen) / I**0.5).to(device=device, dtype=dtype)
    weights = torch.empty((T, K), dtype=torch.float32, device=device)
    ids = torch.empty((T, K), dtype=torch.int64, device=device)

    def route():  # K distinct experts per token, random weights
        weights.copy_(torch.rand((T, K), generator=gen))
        ids.copy_(torch.rand((T, E), generator=gen).argsort(dim=1)[:, :K])

    def refresh():
        _fill(gen, x)
        route()

    route()
    return Case(lambda: tk.fused_moe(x, w13, w2, weights, ids), refresh)


def _index_case(pairs, heads, dim, topk, device, dtype, seed) -> Case:
    b = make_paged_batch(pairs, heads, 1, dim, PAGE, dtype, device, seed=seed)
    gen = _gen(seed + 100)
    weights = randn((b.q.shape[0], heads), torch.float32, device, gen)

    def refresh():
        _fill(gen, b.q, b.k_cache, weights)
        _step_lengths(b, gen)

    def call():
        return tk.index_topk(
            b.q,
            weights,
            b.k_cache,
            b.block_table,
            b.cu_seqlens_q,
            b.seq_lens,
            b.max_seqlen_q,
            topk=topk,
            scale=dim**-0.5,
        )

    return Case(call, refresh)


def index_topk_case(device, dtype) -> Case:
    return _index_case([(1, 37), (5, 20), (17, 80), (0, 7)], 8, 64, 16, device, dtype, seed=16)


def index_topk_long_case(device, dtype) -> Case:
    """Two decode rows, 5000 keys: the score kernel cuts the keys into segments."""
    return _index_case([(1, 5000), (1, 300)], 16, 128, 256, device, dtype, seed=17)


def _sparse_mla_case(pairs, num_k, device, dtype, seed) -> Case:
    b = _mla_batch(pairs, device, dtype, seed)
    gen = _gen(seed + 100)
    topk = sparse_indices(pairs, num_k, gen).to(device)

    def refresh():
        _fill(gen, b.q, b.k_cache)
        topk.copy_(sparse_indices(pairs, num_k, gen))

    def call():
        return tk.sparse_mla_attention(
            b.q,
            b.k_cache,
            b.block_table,
            b.cu_seqlens_q,
            topk,
            b.seq_lens,
            kv_lora_rank=MLA_RANK,
            scale=SCALE,
        )

    return Case(call, refresh)


def sparse_mla_case(device, dtype) -> Case:
    return _sparse_mla_case([(1, 37), (4, 20), (9, 40)], 48, device, dtype, seed=18)


def sparse_mla_long_case(device, dtype) -> Case:
    """2048 indices per token over 5000 keys, two tokens: plan_sparse_mla splits each list."""
    return _sparse_mla_case([(1, 5000), (1, 300)], 2048, device, dtype, seed=19)


def quant_fp8_case(device, dtype) -> Case:
    gen = _gen(20)
    x = randn((37, 512), dtype, device, gen)
    return Case(lambda: tk.per_token_group_quant_fp8(x, FP8_BLOCK[1]), lambda: _fill(gen, x))


def gemm_fp8_case(device, dtype) -> Case:
    """x [37, 512] @ W [320, 512]^T: W's last block row is partial."""
    gen = _gen(21)
    M, N, K = 37, 320, 512

    def quantized():
        a, a_s = ref_fp8.per_token_group_quant_fp8(randn((M, K), dtype, device, gen), FP8_BLOCK[1])
        b, b_s = ref_fp8.quantize_fp8_block(randn((N, K), torch.float32, device, gen) / K**0.5, FP8_BLOCK)
        return a, b, a_s, b_s

    tensors = quantized()

    def refresh():
        for t, new in zip(tensors, quantized()):
            t.copy_(new)

    return Case(lambda: tk.w8a8_block_fp8_matmul(*tensors, FP8_BLOCK), refresh)


def linear_fp8_case(device, dtype) -> Case:
    """A decode-sized step: the activation quantized inside the GEMM (split-K for few rows)."""
    gen = _gen(22)
    M, N, K = 8, 512, 1024
    x = randn((M, K), dtype, device, gen)
    b, b_s = ref_fp8.quantize_fp8_block(randn((N, K), torch.float32, device, gen) / K**0.5, FP8_BLOCK)
    return Case(lambda: tk.w8a8_block_fp8_linear(x, b, b_s, FP8_BLOCK), lambda: _fill(gen, x))


def store_index_keys_case(device, dtype) -> Case:
    """DeepSeek-V3.2's indexer keys into an e4m3 cache, each row with a scale of its own."""
    gen = _gen(23)
    T, D, num_blocks = 37, 128, 6
    index_k = randn((T, D), dtype, device, gen)
    cache = torch.zeros(num_blocks, PAGE, 1, D, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.zeros(num_blocks, PAGE, dtype=torch.float32, device=device)
    slots = torch.empty(T, dtype=torch.int64, device=device)
    new_slots = _slot_refiller(slots, num_blocks * PAGE, gen)

    def call():
        tk.store_index_keys(index_k, cache, slots, index_scales=scales)
        return cache, scales

    def refresh():
        _fill(gen, index_k)
        new_slots()

    new_slots()
    return Case(call, refresh)


# (test id, builder): the id's first part is the kernel's name in tilellm.kernels.__all__
CASES: list[tuple[str, Callable[[str, torch.dtype], Case]]] = [
    ("store_kvcache", store_kvcache_case),
    ("concat_and_cache_mla", concat_and_cache_mla_case),
    ("prefill_attention", prefill_case),
    ("prefill_attention-long", prefill_long_case),
    ("paged_attention", paged_case),
    ("paged_attention-long", paged_long_case),
    ("paged_attention-chunks", paged_chunks_case),
    ("decode_attention", decode_case),
    ("decode_attention-long", decode_long_case),
    ("cascade_decode_attention", cascade_case),
    ("sparse_attention", sparse_case),
    ("merge_attention_states", merge_case),
    ("mla_decode_attention", mla_decode_case),
    ("mla_decode_attention-long", mla_decode_long_case),
    ("mla_paged_attention", mla_paged_case),
    ("fused_moe", fused_moe_case),
    ("index_topk", index_topk_case),
    ("index_topk-long", index_topk_long_case),
    ("sparse_mla_attention", sparse_mla_case),
    ("sparse_mla_attention-long", sparse_mla_long_case),
    ("per_token_group_quant_fp8", quant_fp8_case),
    ("w8a8_block_fp8_matmul", gemm_fp8_case),
    ("w8a8_block_fp8_linear", linear_fp8_case),
    ("store_index_keys", store_index_keys_case),
]
FP8_KERNELS = {
    "per_token_group_quant_fp8",
    "w8a8_block_fp8_matmul",
    "w8a8_block_fp8_linear",
    "store_index_keys",
}
NEEDS_FP8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 (e4m3) kernels need sm_89 or newer",
)
PARAMS = [
    pytest.param(build, id=name, marks=[NEEDS_FP8] if name.split("-")[0] in FP8_KERNELS else [])
    for name, build in CASES
]


def outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit for bit (fp8 outputs too): the replay runs the same kernels with the same plan, and no
    kernel uses atomics (fused_moe's expert counts are an integer scatter_add_: order-free)."""
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype), (
        f"{what}: {tuple(got.shape)} {got.dtype} != {tuple(expected.shape)} {expected.dtype}"
    )
    if same_bits(got, expected):
        return
    g, e = got.double(), expected.double()
    wrong = ~((g == e) | (g.isnan() & e.isnan()))
    if not bool(wrong.any()):
        raise AssertionError(f"{what}: equal values but different bits (signed zeros or NaN payloads)")
    first = tuple(wrong.nonzero()[0].tolist())
    raise AssertionError(
        f"{what}: {int(wrong.sum())} of {g.numel()} elements differ; first at {first}: "
        f"replay {float(g[first]):.6g}, eager {float(e[first]):.6g}"
    )


def test_every_public_kernel_has_a_case():
    assert {name.split("-")[0] for name, _ in CASES} == set(tk.__all__)


@pytest.mark.parametrize("build", PARAMS)
def test_no_host_sync(build, monkeypatch):
    """The second call (the first compiles) makes no device-to-host sync."""
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)  # value checks read the device on purpose
    case = build(DEVICE, DTYPE)
    case.call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("build", PARAMS)
def test_cuda_graph_replay(build, monkeypatch):
    """Captured as called, replayed after new values are written into its inputs: the same
    outputs as an eager call on those values, and not the ones of the captured values."""
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    case = build(DEVICE, DTYPE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        before = [t.clone() for t in outputs(case.call())]  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = outputs(case.call())
    case.refresh()
    graph.replay()
    got = [t.clone() for t in out]  # store_kvcache's outputs are its caches: the eager call rewrites them
    expected = outputs(case.call())
    torch.cuda.synchronize()

    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_same(g, e, f"output {i}: graph replay vs eager")
    assert not all(same_bits(e, b) for e, b in zip(expected, before)), (
        "the new inputs give the captured call's outputs: the replay check proves nothing"
    )
