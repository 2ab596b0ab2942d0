"""MLA, paged and sparse, over an FP8 (e4m3) latent cache with its dequantization scale.

The cache of `make_paged_batch` (random rows, every block written) is quantized with a scale
that is not 1 (amax / 448 x 1.7, so neither the scale nor saturation hides a missing factor),
then two comparisons: each Triton kernel against its twin, both given the FP8 cache and
`kv_scale`; and the twin on the FP8 cache against the twin on the same cache dequantized into
q's dtype (`dequantize_fp8`): the FP8 path must be dequantize-then-attend, nothing else. Shapes
are test_mla.py's tiny ones (32/16 and 48/8), fp32 and fp16 queries (the interpreter's bf16
`tl.dot` is wrong); the GPU cases at the end run DeepSeek's 512/64 in bf16, and a CUDA graph
replayed after the scale changed in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.kernels import helpers
from tests.kernels.helpers import assert_close, poisoned, sparse_indices, tolerance
from tilellm.kernels import mla, sparse_mla
from tilellm.kernels.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8
from tilellm.kernels.reference import mla as ref
from tilellm.kernels.reference import sparse_mla as ref_sparse

SCALE = 0.15
DIMS = [(32, 16), (48, 8)]  # (kv_lora_rank, rope_dim)
# decode, verify, a chunk crossing blocks, an empty request, a fresh one-token prompt
MIXED = [(1, 37), (3, 20), (17, 40), (0, 7), (1, 1)]


@dataclass
class Fp8Batch(helpers.PagedBatch):
    kv_scale: torch.Tensor | None = None  # [1] fp32: k_cache ~ stored * kv_scale


def make(pairs, heads, dims, device, dtype=torch.float32, seed=0, block_size=16) -> Fp8Batch:
    """`make_paged_batch` over a latent cache (one KV head of kv_lora_rank + rope_dim), quantized."""
    lora, rope = dims
    b = helpers.make_paged_batch(pairs, heads, 1, lora + rope, block_size, dtype, device, seed=seed)
    kv_scale = (b.k_cache.float().abs().max() / FP8_MAX * 1.7).reshape(1)
    fields = {**vars(b), "k_cache": quantize_fp8(b.k_cache, kv_scale)}
    return Fp8Batch(**fields, kv_scale=kv_scale)


def dequantized(b) -> torch.Tensor:
    return dequantize_fp8(b.k_cache, b.kv_scale, b.q.dtype)


def exact(dtype) -> float:
    """Twin on FP8 vs twin on the cache dequantized into q's dtype: the same fp32 rows for fp32
    queries; fp16 rounds each dequantized value once (2^-11) and the output once more; bf16 the
    same at 2^-8 (an H200 run measured 6.6e-3 of the output scale)."""
    if dtype == torch.float32:
        return 1e-6
    return 2e-3 if dtype == torch.float16 else 1e-2


# The three kernels: Triton's module, the twin's, and the arguments before the keywords.
IMPLS = {
    "mla_decode_attention": (mla, ref),
    "mla_paged_attention": (mla, ref),
    "sparse_mla_attention": (sparse_mla, ref_sparse),
}
ARGS = {
    "mla_decode_attention": lambda b, kv, topk: (b.q, kv, b.block_table, b.seq_lens),
    "mla_paged_attention": lambda b, kv, topk: (
        b.q, kv, b.block_table, b.cu_seqlens_q, b.seq_lens, b.max_seqlen_q),
    "sparse_mla_attention": lambda b, kv, topk: (b.q, kv, b.block_table, b.cu_seqlens_q, topk, b.seq_lens),
}  # fmt: skip


def check(name, b, lora, device, what, topk=None, **kw):
    """Triton (into a poisoned `out`) vs the twin, both on the FP8 cache, then the twin vs itself
    on the cache dequantized into q's dtype. `kw` goes to the Triton kernel only."""
    kernel, twin = (getattr(module, name) for module in IMPLS[name])
    args, deq_args = ARGS[name](b, b.k_cache, topk), ARGS[name](b, dequantized(b), topk)
    common = dict(kv_lora_rank=lora, scale=SCALE)
    out = poisoned(torch.empty(b.q.shape[0], b.q.shape[1], lora, dtype=b.q.dtype, device=b.q.device))
    o = kernel(*args, **common, **kw, out=out, kv_scale=b.kv_scale)
    assert o is out
    expected = twin(*args, **common, kv_scale=b.kv_scale)
    assert_close(o, expected, tolerance(b.q.dtype, device), f"{what}: triton vs twin")
    assert_close(expected, twin(*deq_args, **common), exact(b.q.dtype), f"{what}: twin fp8 vs dequantized")


# ----------------------------------------------------------------------------------------------
# Dense MLA: decode, paged, split-KV, value halves
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 3])
def test_decode(splits, device):
    """Contexts of 1, one block + 1 and 37 keys; one segment and three (each partial scaled)."""
    b = make([(1, n) for n in (1, 17, 37)], 4, DIMS[0], device, seed=1)
    check("mla_decode_attention", b, 32, device, f"decode splits={splits}", num_splits=splits)


def test_paged_mixed_fp16(device):
    """Mixed query lengths, fp16 queries: the FP8 rows convert to fp16 in registers."""
    b = make(MIXED, 4, DIMS[1], device, dtype=torch.float16, seed=2)
    check("mla_paged_attention", b, 48, device, "paged fp16")


def test_paged_split_value_halves(device):
    """Decode, verification and an empty request over three segments, two programs per tile
    each holding half the values (both read the whole row for the scores)."""
    b = make([(1, 37), (3, 20), (0, 7)], 4, DIMS[0], device, seed=3)
    config = mla.MlaConfig(16, 16, 16, 4, 1, value_splits=2)
    plan = mla.plan_mla(3, 4, b.max_seqlen_q, 64, b.q.dtype, 16, kv_lora_rank=32, rope_dim=16, num_splits=3,
                        config=config)  # fmt: skip
    check("mla_paged_attention", b, 32, device, "paged split halves", num_splits=plan)


def test_scale_defaults_and_wide_caches(device):
    """kv_scale None reads an FP8 cache at scale 1.0; a 32-bit cache ignores kv_scale."""
    b = make([(1, 20), (1, 9)], 4, DIMS[0], device, seed=4)
    args = ARGS["mla_decode_attention"]
    kw = dict(kv_lora_rank=32, scale=SCALE)
    o = mla.mla_decode_attention(*args(b, b.k_cache, None), **kw)
    unit = dequantize_fp8(b.k_cache, 1.0, b.q.dtype)
    expected = ref.mla_decode_attention(*args(b, unit, None), **kw)
    assert_close(o, expected, tolerance(b.q.dtype, device), "fp8, no kv_scale")
    wide = args(b, dequantized(b), None)
    two = torch.full((1,), 2.0, device=device)
    expected = ref.mla_decode_attention(*wide, **kw)
    o = mla.mla_decode_attention(*wide, **kw, kv_scale=two)
    assert_close(o, expected, tolerance(b.q.dtype, device), "fp32 cache, kv_scale ignored")
    assert torch.equal(ref.mla_decode_attention(*wide, **kw, kv_scale=two), expected)


def test_plans_count_fp8_row_bytes():
    """Half the bytes per cached row: a segment needs twice the keys to outweigh its partial."""
    kw = dict(kv_lora_rank=512, rope_dim=64, num_sms_=132, config=mla.WIDE)
    bf16 = mla.plan_mla(2, 128, 1, 65536, torch.bfloat16, 64, **kw)
    fp8 = mla.plan_mla(2, 128, 1, 65536, torch.bfloat16, 64, cache_dtype=torch.float8_e4m3fn, **kw)
    assert fp8.config == bf16.config and fp8.num_splits == bf16.num_splits == 33, fp8.reason
    # 2 x 64 rows x 512 fp32 of partials over 25% of 1152- / 576-byte rows, in whole 64-key pages
    assert (bf16.min_keys_per_split, fp8.min_keys_per_split) == (960, 1856)
    kw = dict(kv_lora_rank=512, rope_dim=64, num_sms_=132)
    s_bf16 = sparse_mla.plan_sparse_mla(4, 16, 4096, torch.bfloat16, **kw)
    s_fp8 = sparse_mla.plan_sparse_mla(4, 16, 4096, torch.bfloat16, cache_dtype=torch.float8_e4m3fn, **kw)
    # 8 programs (4 tokens x value halves): 16 segments of >= 256 indices, or 8 of >= 480
    assert s_fp8.config == s_bf16.config and (s_bf16.num_splits, s_fp8.num_splits) == (16, 8), s_fp8.reason


# ----------------------------------------------------------------------------------------------
# Sparse MLA
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 2])
def test_sparse(splits, device):
    """Selections with -1 padding and a token without a valid entry; one segment and two."""
    b = make([(1, 37), (4, 20), (9, 40)], 4, DIMS[1], device, seed=5)
    topk = sparse_indices(b.pairs, 16, torch.Generator().manual_seed(5), empty_rows=(2,)).to(device)
    T = b.q.shape[0]
    plan = sparse_mla.plan_sparse_mla(T, 4, 16, b.q.dtype, kv_lora_rank=48, rope_dim=8, num_splits=splits)
    check("sparse_mla_attention", b, 48, device, f"sparse splits={splits}", topk, plan=plan)


# ----------------------------------------------------------------------------------------------
# Errors: the cache's dtype and the scale
# ----------------------------------------------------------------------------------------------

ONE = "kv_scale must be a float32 tensor of one element, got"
DTYPE = "kv_cache must have q's dtype torch.float32 or float8_e4m3fn"
BAD = [
    ("cache_fp16", dict(kv_cache=torch.float16), f"{DTYPE} (an FP8 cache), got torch.float16"),
    ("scale_fp64", dict(kv_scale=torch.ones(1, dtype=torch.float64)), f"{ONE} torch.float64 of shape (1,)"),
    ("scale_two", dict(kv_scale=torch.ones(2)), f"{ONE} torch.float32 of shape (2,)"),
    ("scale_float", dict(kv_scale=1.0), f"{ONE} float"),
]


@pytest.mark.parametrize("name", list(IMPLS))
@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_errors(case, name):
    """Each kernel and its twin name the argument (a dtype for kv_cache converts the FP8 cache)."""
    _, change, message = case
    b = make([(1, 20), (1, 9)], 4, DIMS[0], "cpu", seed=6)
    kv = b.k_cache.to(change["kv_cache"]) if "kv_cache" in change else b.k_cache
    topk = sparse_indices(b.pairs, 8, torch.Generator().manual_seed(6))
    kw = dict(kv_lora_rank=32, scale=SCALE, kv_scale=change.get("kv_scale", b.kv_scale))
    for module in IMPLS[name]:
        with pytest.raises(ValueError, match=f"^{name}: ") as e:
            getattr(module, name)(*ARGS[name](b, kv, topk), **kw)
        assert message in str(e.value), module.__name__


# ----------------------------------------------------------------------------------------------
# GPU only: DeepSeek's shapes in bf16, CUDA graphs
# ----------------------------------------------------------------------------------------------

DEEPSEEK = (512, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_gpu_decode_deepseek(num_splits, heads, device):
    lens = (1, 63, 64, 65, 4097, 300, 2048)
    b = make([(1, n) for n in lens], heads, DEEPSEEK, device, torch.bfloat16, block_size=64)
    what = f"gpu decode H={heads} splits={num_splits}"
    check("mla_decode_attention", b, 512, device, what, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_paged_and_sparse_deepseek(heads, device):
    pairs = [(1, 1000), (2, 513), (130, 700), (0, 9)]
    b = make(pairs, heads, DEEPSEEK, device, torch.bfloat16, block_size=64)
    check("mla_paged_attention", b, 512, device, f"gpu paged H={heads}")
    topk = sparse_indices(b.pairs, 2048, torch.Generator().manual_seed(7), pad=0.05).to(device)
    check("sparse_mla_attention", b, 512, device, f"gpu sparse H={heads}", topk)


@pytest.mark.gpu
def test_gpu_graph_replays_with_current_scale(device):
    """The kernels read kv_scale on the device: a graph captured at one value replays with the
    value written into the same tensor since."""
    b = make([(1, n) for n in (5000, 17, 900, 1)], 16, DEEPSEEK, device, torch.bfloat16, block_size=64)
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16, device=device)

    args = ARGS["mla_decode_attention"](b, b.k_cache, None)

    def step():
        mla.mla_decode_attention(*args, kv_lora_rank=512, scale=SCALE, out=out, kv_scale=b.kv_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    b.kv_scale.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    expected = ref.mla_decode_attention(*args, kv_lora_rank=512, scale=SCALE, kv_scale=b.kv_scale)
    assert_close(out, expected, tolerance(torch.bfloat16, device), "graph replay, new scale")
