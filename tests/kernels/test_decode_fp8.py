"""The Gluon FP8 decode kernel (`tilellm.kernels.decode_fp8`), through `decode_attention`.

On any machine: it compiles for sm_90a (Triton's own ptxas, no GPU) into mma.sync products fed by
cp.async copies and `cvt.rn.f16x2.e4m3x2` widening, without spilling, with no shared-memory
round trip of widened tiles, in the shared memory of its two rings; `plan_paged` gives it decode
batches over an FP8 cache where Hopper and Gluon are (the plan made as there), `paged.py` calls
it with the plan's segments and merges them (a PyTorch stand-in for the kernel), and
`launch_gluon` falls back when a module declines a batch or cannot be built. On a Hopper
GPU: `plan_paged` picks it for decode over an FP8 cache; its output against the PyTorch twin on
the dequantized cache for head dims 64 and 128, GQA groups 1-8, pages smaller than, equal to and
larger than its 32-key tiles, bf16 and fp16 queries, unsplit and split (some segments empty),
contexts of one key to many tiles; groups of 16 heads run `paged.py`; and the call is captured
in a CUDA graph and replayed over new values.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import (
    assert_close,
    compile_for_sm90,
    local_memory_in_loops,
    make_paged_batch,
    tolerance,
)
from tilellm.kernels import config, schedule
from tilellm.kernels import reference as ref
from tilellm.kernels.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8
from tilellm.kernels.schedule import choose_num_splits, fp8_query_columns, plan_paged

# (head dim, split, verification's MMA columns or 0 for decode)
COMPILED = [(d, split, 0) for d in (64, 128) for split in (False, True)] + [(128, True, 8), (128, False, 16)]


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compile_for_sm90(
        "decode_fp8",
        {
            repr(v): dict(head_dim=v[0], split=v[1], verify=v[2] > 0, cols=v[2] or 8, group=4)
            for v in COMPILED
        },  # fmt: skip
    )


@pytest.mark.parametrize(
    "variant",
    COMPILED,
    ids=lambda v: f"d{v[0]}-{'split' if v[1] else 'whole'}" + (f"-cols{v[2]}" if v[2] else ""),
)
def test_compiles_for_sm90_without_spills(compiled, variant):
    from tilellm.kernels import decode_fp8

    head_dim = variant[0]
    k = compiled[repr(variant)]
    assert "cp.async.cg.shared.global" in k["ptx"], "K/V bytes must arrive by cp.async"
    assert "mma.sync.aligned.m16n8k16" in k["ptx"] and "cvt.rn.f16x2.e4m3x2" in k["ptx"], (
        "e4m3 widened by cvt, products on mma.sync"
    )
    # widened tiles never go through shared memory: each thread's bytes are its operands
    # (Q^T and P^T, a few hundred bytes a tile, are the only layout conversions)
    ring = 2 * decode_fp8.STAGES * decode_fp8.BLOCK_N * head_dim
    assert ring <= k["shared"] <= ring + 4096, k["shared"]
    # no spill: at most a register or two saved around the main loop (Triton 3.6's ptxas keeps
    # two of the split verification variant's in an 8-byte frame, stored once before the loop
    # and loaded once after it), none read or written inside a loop
    assert "LOCAL:0 " in k["usage"], k["usage"]
    stack = int(re.search(r"STACK:(\d+)", k["usage"]).group(1))
    in_loops = local_memory_in_loops(k["sass"])
    assert stack <= 16 and not in_loops, (k["usage"], in_loops)


def _fp8_batch(pairs, hq, hkv, head_dim, page, dtype, device, seed):
    b = make_paged_batch(pairs, hq, hkv, head_dim, page, dtype, device, seed=seed)
    k_scale = (b.k_cache.float().abs().amax() / FP8_MAX * 1.7).reshape(1)
    v_scale = (b.v_cache.float().abs().amax() / FP8_MAX * 0.6).reshape(1)  # some values saturate
    b.k_cache, b.v_cache = quantize_fp8(b.k_cache, k_scale), quantize_fp8(b.v_cache, v_scale)
    return b, k_scale, v_scale


def _expected(b, k_scale, v_scale):
    kd, vd = (
        dequantize_fp8(b.k_cache, k_scale, torch.float32),
        dequantize_fp8(b.v_cache, v_scale, torch.float32),
    )
    return ref.decode_attention(b.q.float(), kd, vd, b.block_table, b.seq_lens).to(b.q.dtype)


@pytest.fixture
def launches(monkeypatch):
    """Counts the Gluon kernel's launches."""
    from tilellm.kernels import decode_fp8

    count = [0]
    launch = decode_fp8.launch_decode_fp8

    def counted(*args, **kwargs):
        count[0] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(decode_fp8, "launch_decode_fp8", counted)
    return count


hopper_only = pytest.mark.skipif(
    not torch.cuda.is_available() or not config.gluon_ok(), reason="needs an H100/H200 and Gluon"
)

CONTEXTS = [1, 15, 31, 32, 33, 64, 100, 257, 700, 1500]


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("page", [8, 32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_matches_the_twin(head_dim, group, page, dtype, launches):
    b, ks, vs = _fp8_batch(
        [(1, n) for n in CONTEXTS], 2 * group, 2, head_dim, page, dtype, "cuda", seed=group
    )
    plan = plan_paged(
        len(CONTEXTS), 2 * group, 2, head_dim, dtype, page, 1, max_seqlen_k=1500, is_decode=True, kv_fp8=True
    )
    assert plan.kernel == "gluon-decode-fp8"
    want = _expected(b, ks, vs)
    tol = tolerance(dtype, "cuda")
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    for splits in (None, 1, 3, 8):  # planned; whole; some segments of short requests empty
        got = tk.decode_attention(*args, num_splits=splits, k_scale=ks, v_scale=vs)
        assert_close(got, want, tol, f"splits {splits}")
    assert launches[0] == 4


def _expected_verify(b, k_scale, v_scale, max_q, scale=None):
    kd, vd = (
        dequantize_fp8(b.k_cache, k_scale, torch.float32),
        dequantize_fp8(b.v_cache, v_scale, torch.float32),
    )
    batch = (b.block_table, b.cu_seqlens_q, b.seq_lens, max_q)
    return ref.paged_attention(b.q.float(), kd, vd, *batch, scale=scale).to(b.q.dtype)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group, max_q", [(1, 5), (2, 4), (4, 6), (8, 8), (3, 7)])
@pytest.mark.parametrize("page", [8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verification_matches_the_twin(head_dim, group, max_q, page, dtype, launches, gluon_verify):
    """New tokens of 1..max_q a request, causal among themselves, over contexts from a few keys
    to many tiles: every query row (token x head) in programs of 8 or 16 columns."""
    lens = [(1, 1), (max_q, max_q), (max_q, 40), (2, 33), (max_q, 700), (max_q - 1, 1500), (max_q, 64)]
    b, ks, vs = _fp8_batch(lens, 2 * group, 2, head_dim, page, dtype, "cuda", seed=group + max_q)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, max_q)
    plan = plan_paged(
        len(lens), 2 * group, 2, head_dim, dtype, page, max_q, num_tokens=b.q.shape[0], max_seqlen_k=1500,
        kv_fp8=True,
    )  # fmt: skip
    assert plan.kernel == "gluon-decode-fp8"
    want = _expected_verify(b, ks, vs, max_q)
    tol = tolerance(dtype, "cuda")
    for splits in (None, 1, 3, 8):  # planned; whole; some segments past a token's last key
        got = tk.paged_attention(*args, num_splits=splits, k_scale=ks, v_scale=vs)
        assert_close(got, want, tol, f"splits {splits}")
    # scores about 11x larger: a column's running max grows past 2^8 of itself after its first
    # tile (the lazy rescale), beside columns that see no key of a segment at all (split)
    for splits in (1, 3):
        got = tk.paged_attention(*args, num_splits=splits, k_scale=ks, v_scale=vs, scale=1.0)
        assert_close(got, _expected_verify(b, ks, vs, max_q, scale=1.0), tol, f"scale 1, splits {splits}")
    assert launches[0] == 6


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("cols", [8, 16])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("group, stages", [(4, 3), (3, 3), (3, 0)])
def test_verification_columns_forced(cols, splits, group, stages):
    """Both column widths give the same rows, whole and split (the caller's merge), with a
    group that divides them and one that does not, and with the register-prefetch loop."""
    from tilellm.kernels import decode_fp8
    from tilellm.kernels.merge import merge_into

    b, ks, vs = _fp8_batch(VERIFY_LENS, 2 * group, 2, 128, 16, torch.bfloat16, "cuda", seed=13)
    T, Hq, D = b.q.shape
    o = torch.empty_like(b.q)
    parts = lse = None
    if splits > 1:
        parts = torch.empty(splits, T, Hq, D, dtype=torch.float32, device="cuda")
        lse = torch.empty(splits, T, Hq, dtype=torch.float32, device="cuda")
    decode_fp8.launch_decode_fp8(
        b.q, b.k_cache, b.v_cache, o, b.block_table, b.seq_lens, D**-0.5 * math.log2(math.e), ks, vs,
        splits, 64, parts, lse, stages=stages, cu_seqlens_q=b.cu_seqlens_q, max_seqlen_q=6, cols=cols,
    )  # fmt: skip
    if splits > 1:
        merge_into(parts, lse, o)
    assert_close(o, _expected_verify(b, ks, vs, 6), tolerance(torch.bfloat16, "cuda"), f"cols {cols}")


def _captured(call) -> torch.cuda.CUDAGraph:
    """`call` run once (it compiles outside the capture), then captured in a CUDA graph."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


@pytest.mark.gpu
@hopper_only
def test_verification_captured_in_a_cuda_graph(launches, gluon_verify):
    b, ks, vs = _fp8_batch(VERIFY_LENS, 16, 4, 128, 16, torch.bfloat16, "cuda", seed=17)
    out = torch.empty_like(b.q)

    def call():
        tk.paged_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, 6,
                           max_seqlen_k=1500, out=out, k_scale=ks, v_scale=vs)  # fmt: skip

    graph = _captured(call)
    b.q.copy_(torch.randn_like(b.q))
    graph.replay()
    assert_close(out, _expected_verify(b, ks, vs, 6), tolerance(torch.bfloat16, "cuda"), "replay")
    assert launches[0] == 2


@pytest.mark.gpu
@hopper_only
def test_groups_of_sixteen_run_paged_py(launches):
    b, ks, vs = _fp8_batch([(1, n) for n in CONTEXTS], 32, 2, 128, 16, torch.bfloat16, "cuda", seed=5)
    plan = plan_paged(
        len(CONTEXTS), 32, 2, 128, torch.bfloat16, 16, 1, max_seqlen_k=1500, is_decode=True, kv_fp8=True
    )
    assert plan.kernel == "triton"
    got = tk.decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, k_scale=ks, v_scale=vs)
    assert_close(got, _expected(b, ks, vs), tolerance(torch.bfloat16, "cuda"), "group 16")
    assert launches[0] == 0


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("splits", [1, 4])
def test_captured_in_a_cuda_graph(splits, launches):
    b, ks, vs = _fp8_batch([(1, n) for n in CONTEXTS], 16, 8, 128, 16, torch.bfloat16, "cuda", seed=7)
    out = torch.empty_like(b.q)

    def call():
        tk.decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, num_splits=splits,
                            max_seqlen_k=1500, out=out, k_scale=ks, v_scale=vs)  # fmt: skip

    graph = _captured(call)
    b.q.copy_(torch.randn_like(b.q))
    b.seq_lens.copy_(torch.tensor(CONTEXTS[::-1], dtype=torch.int32, device="cuda").clamp(max=b.seq_lens))
    graph.replay()
    assert_close(out, _expected(b, ks, vs), tolerance(torch.bfloat16, "cuda"), "replay")
    assert launches[0] == 2


@pytest.mark.gpu
@hopper_only
def test_repeated_calls_launch_through_fast_launch():
    """From the second call with the same specialisation on, the kernel launches without
    Triton's `JITFunction.run` (`FastLaunch`), with the same result."""
    from tilellm.kernels import decode_fp8

    b, ks, vs = _fp8_batch([(1, n) for n in CONTEXTS], 4, 2, 128, 16, torch.bfloat16, "cuda", seed=9)
    want = _expected(b, ks, vs)
    before = None
    for call in range(3):
        got = tk.decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens, num_splits=1,
                                  k_scale=ks, v_scale=vs)  # fmt: skip
        assert_close(got, want, tolerance(torch.bfloat16, "cuda"), f"call {call}")
        if call == 0:
            before = decode_fp8._decode_fp8_launch.fast_launches
    assert decode_fp8._decode_fp8_launch.fast_launches == before + 2


# -- on any machine: which batches the plan gives the kernel, and how paged.py calls it --


@pytest.fixture
def gluon_verify(monkeypatch):
    """Verification over an FP8 cache in decode_fp8.py (`TILELLM_FP8_VERIFY=gluon`, opt-in)."""
    from tilellm.kernels import paged

    monkeypatch.setenv("TILELLM_FP8_VERIFY", "gluon")
    paged.clear_plans()
    yield
    paged.clear_plans()


@pytest.fixture
def hopper_with_gluon(monkeypatch):
    """The plan as an H100/H200 with a Triton that builds Gluon makes it (per-shape plans
    cached before or during the test are dropped)."""
    from tilellm.kernels import paged

    monkeypatch.setattr(config, "gluon_ok", lambda device_index=None: True)
    monkeypatch.setattr(config, "_gluon_module_disabled", {})
    paged.clear_plans()
    yield
    paged.clear_plans()


@pytest.mark.parametrize(
    "dtype, head_dim, group, max_q, fp8, allow, kernel",
    [
        (torch.bfloat16, 128, 2, 1, True, True, "gluon-decode-fp8"),
        (torch.float16, 64, 8, 1, True, True, "gluon-decode-fp8"),
        (torch.bfloat16, 128, 1, 1, True, True, "gluon-decode-fp8"),
        (torch.bfloat16, 128, 16, 1, True, True, "triton"),  # more heads than the MMA's 8 columns
        (torch.float32, 128, 2, 1, True, True, "triton"),  # fp32 queries
        (torch.bfloat16, 256, 2, 1, True, True, "triton"),  # head dim
        (torch.bfloat16, 128, 2, 1, False, True, "triton"),  # a 16-bit cache
        (torch.bfloat16, 128, 2, 1, True, False, "triton"),  # strided caches, cascade windows
    ],
)
def test_plan_gives_decode_over_fp8_to_the_kernel(
    hopper_with_gluon, dtype, head_dim, group, max_q, fp8, allow, kernel
):
    plan = plan_paged(
        64, 8 * group, 8, head_dim, dtype, 16, max_q, max_seqlen_k=4096, is_decode=True, kv_fp8=fp8,
        allow_gluon=allow, num_sms=132,
    )  # fmt: skip
    assert plan.kernel == kernel


@pytest.mark.parametrize(
    "dtype, group, max_q, fp8, kernel",
    [
        (torch.bfloat16, 4, 6, True, "gluon-decode-fp8"),  # V1: 24 query rows a request
        (torch.float16, 2, 4, True, "gluon-decode-fp8"),  # 8 rows: one program of 8 columns
        (torch.bfloat16, 8, 8, True, "gluon-decode-fp8"),  # 64 rows: four programs of 16
        (torch.bfloat16, 4, 17, True, "triton"),  # 68 rows
        (torch.bfloat16, 1, 128, True, "triton"),  # a prompt chunk
        (torch.bfloat16, 4, 6, False, "triton"),  # a 16-bit cache
    ],
)
def test_plan_gives_verification_over_fp8_to_the_kernel(
    hopper_with_gluon, gluon_verify, dtype, group, max_q, fp8, kernel
):
    plan = plan_paged(
        32, 8 * group, 8, 128, dtype, 16, max_q, num_tokens=32 * max_q, max_seqlen_k=8192, kv_fp8=fp8,
        num_sms=132,
    )  # fmt: skip
    assert plan.kernel == kernel
    if kernel == "gluon-decode-fp8":
        cols, col_groups = fp8_query_columns(max_q, group)
        assert cols * col_groups >= max_q * group > cols * (col_groups - 1)
        assert plan.split.base_programs == 32 * 8 * col_groups


@pytest.mark.parametrize("group, max_q", [(2, 4), (4, 2), (2, 5), (4, 6)])
def test_verification_over_fp8_stays_on_paged_py_by_default(hopper_with_gluon, monkeypatch, group, max_q):
    monkeypatch.delenv("TILELLM_FP8_VERIFY", raising=False)
    args = (32, 8 * group, 8, 128, torch.bfloat16, 16, max_q)
    kw = dict(num_tokens=32 * max_q, max_seqlen_k=8192, kv_fp8=True)
    assert plan_paged(*args, **kw).kernel == "triton"
    monkeypatch.setenv("TILELLM_FP8_VERIFY", "gluon")
    assert plan_paged(*args, **kw).kernel == "gluon-decode-fp8"


def test_fp8_verify_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TILELLM_FP8_VERIFY", "gluons")
    with pytest.raises(ValueError, match="TILELLM_FP8_VERIFY='gluons': choose 'paged'"):
        plan_paged(32, 32, 8, 128, torch.bfloat16, 16, 6, num_tokens=192, max_seqlen_k=8192, kv_fp8=True)


@pytest.mark.parametrize("requests, longest", [(32, 8196), (64, 2048), (16, 32768), (4, 8192), (1, 8192)])
def test_verification_split_stays_within_one_wave(hopper_with_gluon, gluon_verify, requests, longest):
    """The FP8 rule's segments for verification tiles (decode's: for small batches a power of
    two, up to 32), but never more programs than one wave of its target: V1-G2's 256 programs
    over 8196 keys take 4 segments (1024 programs), not the decode rule's 5."""
    plan = plan_paged(
        requests, 16, 8, 128, torch.bfloat16, 16, 4, num_tokens=4 * requests, max_seqlen_k=longest,
        kv_fp8=True, num_sms=132,
    )  # fmt: skip
    assert plan.kernel == "gluon-decode-fp8"
    base, target = requests * 8, schedule.FP8_PROGRAMS_PER_SM * 132
    rule = dict(max_seqlen_k=longest, num_sms=132, kv_fp8=True)
    decode = choose_num_splits(requests, 8, 1, None, **rule)
    assert plan.split.num_splits == min(decode.num_splits, max(1, target // base))
    assert base * plan.split.num_splits <= max(target, base)
    if (requests, longest) == (32, 8196):
        assert (decode.num_splits, plan.split.num_splits) == (5, 4)
    if (requests, longest) == (1, 8192):  # one request: 32 segments, as decode takes
        assert (decode.num_splits, plan.split.num_splits) == (32, 32)


def test_forced_tiles_keep_paged_py(hopper_with_gluon):
    with config.override(paged=config.TileConfig(16, 32, 1, 6)):
        plan = plan_paged(8, 16, 8, 128, torch.bfloat16, 16, 1, max_seqlen_k=512, is_decode=True, kv_fp8=True)
    assert plan.kernel == "triton"


class _KernelTwin:
    """Stands in for `decode_fp8` in `launch_gluon`: its launch computes, in PyTorch, what the
    kernel writes (each segment's normalised output and natural-log lse, or the whole output),
    for decode (one token a request) and verification (`cu_seqlens_q`: causal new tokens)."""

    BLOCK_N = 32

    def __init__(self):
        self.calls = []

    def supports(self, q, k_cache, v_cache, max_seqlen_q=1):
        return True

    def launch_decode_fp8(self, q, k_cache, v_cache, o, block_table, seq_lens, qk_scale, k_scale, v_scale,
                          num_splits, min_split_keys, o_parts=None, lse_parts=None, cu_seqlens_q=None,
                          max_seqlen_q=1):  # fmt: skip
        self.calls.append(num_splits if cu_seqlens_q is None else (num_splits, max_seqlen_q))
        Hq, D = q.shape[1:]
        page, hkv = k_cache.shape[1], k_cache.shape[2]
        B = seq_lens.shape[0]
        cu = list(range(B + 1)) if cu_seqlens_q is None else cu_seqlens_q.tolist()
        if num_splits > 1:  # the kernel writes partials contiguously from element 0 of each buffer
            T = q.shape[0]
            o_parts = o_parts[: num_splits * T * Hq * D].view(num_splits, T, Hq, D)
            lse_parts = lse_parts[: num_splits * T * Hq].view(num_splits, T, Hq)
        for b in range(B):
            n = int(seq_lens[b])
            rows = block_table[b, : -(-n // page)].long()
            k = (k_cache[rows].reshape(-1, hkv, D)[:n].float() * k_scale).repeat_interleave(Hq // hkv, 1)
            v = (v_cache[rows].reshape(-1, hkv, D)[:n].float() * v_scale).repeat_interleave(Hq // hkv, 1)
            q_len = cu[b + 1] - cu[b]
            for t, row in enumerate(range(cu[b], cu[b + 1])):
                end = n - q_len + 1 + t  # causal: the keys this token sees
                scores = torch.einsum("hd,nhd->hn", q[row].float(), k) * qk_scale  # base 2
                scores[:, end:] = float("-inf")
                if num_splits == 1:
                    p = torch.softmax(scores * math.log(2), -1)
                    o[row] = torch.einsum("hn,nhd->hd", p, v).to(o.dtype)
                    continue
                bn = self.BLOCK_N
                seg = max(math.ceil(math.ceil(n / num_splits) / bn) * bn, math.ceil(min_split_keys / bn) * bn)
                for s in range(num_splits):
                    lo, hi = s * seg, min(s * seg + seg, end)
                    if lo >= hi:
                        o_parts[s, row] = 0.0
                        lse_parts[s, row] = float("-inf")
                        continue
                    part = scores[:, lo:hi] * math.log(2)
                    o_parts[s, row] = torch.einsum("hn,nhd->hd", torch.softmax(part, -1), v[lo:hi])
                    lse_parts[s, row] = torch.logsumexp(part, -1)
        return True


@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_paged_py_calls_the_kernel_and_merges_its_segments(hopper_with_gluon, monkeypatch, splits, device):
    from tilellm.kernels import paged

    twin = _KernelTwin()
    monkeypatch.setattr(paged, "launch_gluon", lambda launch, module="hopper": launch(twin))
    b, ks, vs = _fp8_batch([(1, n) for n in CONTEXTS], 8, 2, 64, 16, torch.float16, device, seed=3)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    got = tk.decode_attention(*args, num_splits=splits, max_seqlen_k=1500, k_scale=ks, v_scale=vs, scale=0.3)
    want = ref.decode_attention(*args, k_scale=ks, v_scale=vs, scale=0.3)
    assert_close(got, want, tolerance(torch.float16, device), f"splits {splits}")
    assert len(twin.calls) == 1 and (splits is None or twin.calls == [splits])


VERIFY_LENS = [(1, 1), (3, 3), (6, 40), (2, 33), (6, 700), (5, 1500), (6, 64)]  # (new tokens, keys)


@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_paged_py_gives_verification_to_the_kernel(
    hopper_with_gluon, gluon_verify, monkeypatch, splits, device
):
    from tilellm.kernels import paged

    twin = _KernelTwin()
    monkeypatch.setattr(paged, "launch_gluon", lambda launch, module="hopper": launch(twin))
    b, ks, vs = _fp8_batch(VERIFY_LENS, 16, 4, 64, 16, torch.float16, device, seed=11)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, 6)
    got = tk.paged_attention(*args, num_splits=splits, max_seqlen_k=1500, k_scale=ks, v_scale=vs, scale=0.3)
    want = ref.paged_attention(*args, k_scale=ks, v_scale=vs, scale=0.3)
    assert_close(got, want, tolerance(torch.float16, device), f"splits {splits}")
    assert len(twin.calls) == 1 and twin.calls[0][1] == 6
    assert splits is None or twin.calls[0][0] == splits


def test_a_layout_seen_before_runs_its_remembered_launch(hopper_with_gluon, monkeypatch, device):
    """An eager call whose layout was planned before launches the kernel (and merges its segments)
    without planning again, with new tensors (the value checks off, as on a GPU without
    TILELLM_DEBUG=1)."""
    from tilellm.kernels import paged, validation

    twin = _KernelTwin()
    monkeypatch.setattr(paged, "launch_gluon", lambda launch, module="hopper": launch(twin))
    monkeypatch.setattr(validation, "deep_checks_enabled", lambda t: False)
    planned = []
    real = paged._launch
    monkeypatch.setattr(paged, "_launch", lambda *a, **k: planned.append(1) or real(*a, **k))
    for seed in (3, 4):
        b, ks, vs = _fp8_batch([(1, n) for n in CONTEXTS], 8, 2, 64, 16, torch.float16, device, seed=seed)
        args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
        got = tk.decode_attention(*args, num_splits=3, max_seqlen_k=1500, k_scale=ks, v_scale=vs)
        want = ref.decode_attention(*args, k_scale=ks, v_scale=vs)
        assert_close(got, want, tolerance(torch.float16, device), f"seed {seed}")
    assert planned == [1] and twin.calls == [3, 3]


def test_a_declined_batch_runs_the_portable_kernel_and_disables_nothing(monkeypatch):
    monkeypatch.setattr(config, "_gluon_module_disabled", {})
    assert config.gluon_unavailable() is None  # Gluon imports here (its kernels compile on any machine)
    assert config.launch_gluon(lambda kernels: False, module="decode_fp8") is False
    assert config.launch_gluon(lambda kernels: None, module="decode_fp8") is True
    assert "decode_fp8" not in config._gluon_module_disabled


@pytest.mark.parametrize("error", [ImportError, AttributeError, TypeError])
def test_a_module_that_cannot_be_built_is_disabled_alone(monkeypatch, error):
    from triton.compiler.errors import CompilationError

    monkeypatch.setattr(config, "_gluon_module_disabled", {})

    def launch(kernels):
        raise error("moved in this Triton")

    assert config.launch_gluon(launch, module="decode_fp8") is False
    assert "moved in this Triton" in config._gluon_module_disabled["decode_fp8"]
    assert config.launch_gluon(lambda kernels: None, module="decode_fp8") is False  # from then on
    assert config.gluon_unavailable() is None  # hopper.py's kernels are untouched
    assert config.launch_gluon(lambda kernels: None, module="hopper") is True

    def broken(kernels):
        raise CompilationError("", None, "no such op")

    monkeypatch.setattr(config, "_gluon_module_disabled", {})
    assert config.launch_gluon(broken, module="decode_fp8") is False
    assert config.gluon_unavailable() is None


def test_a_missing_module_is_disabled(monkeypatch):
    monkeypatch.setattr(config, "_gluon_module_disabled", {})
    assert config.launch_gluon(lambda kernels: None, module="no_such_kernels") is False
    assert "ModuleNotFoundError" in config._gluon_module_disabled["no_such_kernels"]


def test_bad_tiles_are_refused():
    from tilellm.kernels import decode_fp8

    with pytest.raises(ValueError, match="block_n must be 16 or 32"):
        decode_fp8.launch_decode_fp8(*[None] * 11, block_n=64)
    with pytest.raises(ValueError, match="stages 0 or at least 2"):
        decode_fp8.launch_decode_fp8(*[None] * 11, stages=1)
