"""`prefill_attention` (Triton) against its PyTorch twin: packed varlen requests over their own K/V.

Lengths mix 1, tile sizes +- 1, primes and empty requests in one launch, causal and full, GQA,
every head dim, and v's head dim apart from q's and k's (MLA's 192 / 128, tiny models' 24 / 16,
checked against a naive formula too); outputs are poisoned so a query tile the kernel skips
shows up.
"""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import (
    DTYPES,
    assert_close,
    count_planned_launches,
    cu_seqlens,
    poisoned,
    randn,
    tolerance,
)
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


_MASK = {True: "causal", False: "full"}


def _gqa_cases():
    """Every GQA layout causal and full in fp32 (the tight tolerance; the mask meets the packed
    heads there); in fp16 every layout once, causal and full in turn: its loads and casts do
    not depend on the layout or the mask, so the full cross product repeated covered paths."""
    cases = []
    for i, heads in enumerate(GQA):
        name = f"{heads[0]}q{heads[1]}kv"
        for causal in (True, False):
            cases.append(pytest.param(heads, torch.float32, causal, id=f"{name}-fp32-{_MASK[causal]}"))
        causal = i % 2 == 0
        cases.append(pytest.param(heads, torch.float16, causal, id=f"{name}-fp16-{_MASK[causal]}"))
    return cases


@pytest.mark.parametrize("heads, dtype, causal", _gqa_cases())
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


# -- unequal and non-power-of-two head dims (DeepSeek MLA's prefill: Dqk 192 = 128 + 64, Dv 128) --

# (Dqk, Dv): MLA's own, then tiny models' (24 = 16 + a 16-wide tail holding 8 columns), and equal
HEAD_DIMS = [(192, 128), (96, 64), (24, 16), (48, 32), (64, 64)]
MLA_LENGTHS = [1, 17, 0, 40]


def make_dims(lengths, heads, dims, dtype, device, seed=0):
    """q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    T, (Hq, Hkv), (dqk, dv) = sum(lengths), heads, dims
    q = randn((T, Hq, dqk), dtype, device, gen)
    k = randn((T, Hkv, dqk), dtype, device, gen)
    v = randn((T, Hkv, dv), dtype, device, gen)
    return q, k, v, cu_seqlens(lengths, device), max(lengths, default=0)


def naive_prefill(q, k, v, cu, causal=True, scale=None):
    """softmax(q k^T * scale + causal mask) v per request in float64, KV heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qi = q[start:end].double().cpu().transpose(0, 1)  # [Hq, n, Dqk]
        ki = k[start:end].double().cpu().repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v[start:end].double().cpu().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) * scale  # [Hq, n, n]
        if causal:
            n = end - start
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        out[start:end] = (torch.softmax(scores, dim=-1) @ vi).transpose(0, 1)
    return out.to(q.dtype)


def check_dims(args, device, what, **kw):
    """The kernel into a poisoned `out` [T, Hq, Dv] against its twin and the naive formula."""
    q, v = args[0], args[2]
    out = torch.full((*q.shape[:2], v.shape[2]), float("nan"), dtype=q.dtype, device=device)
    o = tk.prefill_attention(*args, out=out, **kw)
    assert o is out
    tol = tolerance(q.dtype, device)
    assert_close(o, ref.prefill_attention(*args, **kw), tol, f"{what} vs reference")
    assert_close(o.cpu(), naive_prefill(*args[:4], **kw), tol, f"{what} vs naive")


def _dims_cases():
    """Every (dims, heads) pair once, causal and full in turn: each dims is run causal and full,
    and so is each head layout. The mask does not depend on the head dims (the mask against
    packed heads is test_mixed_lengths_gqa's, causal and full for every layout)."""
    cases = []
    for i, dims in enumerate(HEAD_DIMS):
        for j, heads in enumerate([(4, 4), (4, 1), (8, 2)]):
            causal = (i + j) % 2 == 0
            name = f"qk{dims[0]}v{dims[1]}-{heads[0]}q{heads[1]}kv-{_MASK[causal]}"
            cases.append(pytest.param(dims, heads, causal, id=name))
    return cases


@pytest.mark.parametrize("dims, heads, causal", _dims_cases())
def test_unequal_head_dims(dims, heads, causal, device):
    args = make_dims(MLA_LENGTHS, heads, dims, torch.float32, device, seed=dims[0] + heads[1])
    check_dims(args, device, f"dims={dims} heads={heads} causal={causal}", causal=causal)


@pytest.mark.parametrize("dims", [(192, 128), (24, 16)], ids=lambda d: f"qk{d[0]}v{d[1]}")
def test_unequal_head_dims_fp16(dims, device):
    args = make_dims(MLA_LENGTHS, (8, 2), dims, torch.float16, device, seed=dims[1])
    check_dims(args, device, f"fp16 dims={dims}")


def test_unequal_head_dims_default_scale_is_dqk(device):
    q, k, v, cu, max_len = make_dims([5, 20], (4, 2), (192, 128), torch.float32, device, seed=1)
    o = tk.prefill_attention(q, k, v, cu, max_len)
    assert o.shape == (25, 4, 128)
    expected = tk.prefill_attention(q, k, v, cu, max_len, scale=192**-0.5)
    assert torch.equal(o, expected)
    check_dims((q, k, v, cu, max_len), device, "custom scale", scale=0.03)


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # head 1's NaNs, in numpy
@pytest.mark.parametrize("dims", [(24, 16), (40, 24)], ids=lambda d: f"qk{d[0]}v{d[1]}")
def test_padded_blocks_ignore_the_next_heads_columns(dims, device):
    """A padded tail block (24: columns 16..31, 40: 32..47) and a padded V block read the next
    head's first columns: scaled by 100 on odd heads, they would swamp the even heads' scores."""
    q, k, v, cu, max_len = make_dims([3, 33], (4, 4), dims, torch.float32, device, seed=2)
    loud = torch.tensor([1.0, 100.0, 1.0, 100.0], device=device)[None, :, None]
    q, k, v = q * loud, k * loud, v * loud
    check_dims((q, k, v, cu, max_len), device, f"loud neighbours {dims}")
    # infinite keys in head 1's first columns reach no other head
    k[:, 1, :8] = float("inf")
    o = tk.prefill_attention(q, k, v, cu, max_len)
    others = [0, 2, 3]
    expected = naive_prefill(q[:, others], k[:, others], v[:, others], cu)
    assert_close(o[:, others].cpu(), expected, tolerance(q.dtype, device), f"infinite neighbour {dims}")


def test_padded_v_block_writes_only_dv_columns(device):
    """Dv = 24 runs in a 32-wide block: a strided `out` whose rows are wider keeps its other columns."""
    q, k, v, cu, max_len = make_dims([1, 17, 40], (8, 2), (48, 24), torch.float32, device, seed=3)
    wide = torch.full((q.shape[0], 8, 40), float("nan"), device=device)
    o = tk.prefill_attention(q, k, v, cu, max_len, out=wide[:, :, 8:32])
    assert_close(o, ref.prefill_attention(q, k, v, cu, max_len), tolerance(torch.float32, device), "Dv=24")
    assert torch.isnan(wide[..., :8]).all() and torch.isnan(wide[..., 32:]).all(), "wrote outside out's view"


def test_mla_shaped_inputs_from_expanded_latents(device):
    """As MLA's prefill builds them: k = [k_nope | k_pe broadcast over heads], v a slice of one
    up-projection (made contiguous), q = [q_nope | q_pe]."""
    lengths, H, dn, dr, dv = [1, 17, 40], 4, 128, 64, 128
    T = sum(lengths)
    gen = torch.Generator().manual_seed(4)
    kv = randn((T, H, dn + dv), torch.float32, device, gen)
    k_pe = randn((T, 1, dr), torch.float32, device, gen)
    q = randn((T, H, dn + dr), torch.float32, device, gen)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat((k_nope, k_pe.expand(-1, H, -1)), dim=-1)
    check_dims((q, k, v.contiguous(), cu_seqlens(lengths, device), max(lengths)), device, "MLA shapes")


def test_unequal_head_dims_never_route_to_gluon(monkeypatch):
    """On an H100/H200 with Gluon, only Dqk = Dv = 128 takes hopper.py; 192/128 (MLA), unequal
    dims and non-power-of-two dims take the Triton kernel."""
    from tilellm.kernels import config

    monkeypatch.setattr(config, "hopper", lambda device_index=None: True)
    monkeypatch.setattr(config, "interpreting", lambda: False)  # the tile tables of a real GPU
    monkeypatch.setattr(config, "_gluon_disabled", None)
    if config.gluon_unavailable() is not None:
        pytest.skip(f"this Triton cannot build hopper.py: {config.gluon_unavailable()}")
    bf16 = torch.bfloat16
    assert config.prefill_config(128, bf16, 32768).kernel == "gluon"
    assert config.prefill_config(128, bf16, 32768, v_head_dim=128).kernel == "gluon"
    for dqk, dv in [(192, 128), (128, 64), (64, 128), (96, 96), (96, 64), (24, 16)]:
        cfg = config.prefill_config(dqk, bf16, 32768, v_head_dim=dv)
        assert cfg.kernel == "triton", (dqk, dv, cfg)
    assert config.prefill_config(192, bf16, 32768, v_head_dim=128).block_m == 128


def test_head_dim_blocks():
    from tilellm.kernels.prefill import head_dim_blocks

    cases = {192: (128, 64), 96: (64, 32), 24: (16, 16), 48: (32, 16), 40: (32, 16), 128: (128, 0)}
    for head_dim, blocks in cases.items():
        assert head_dim_blocks(head_dim) == blocks, head_dim
    for head_dim in range(16, 257, 8):
        main, tail = head_dim_blocks(head_dim)
        assert main + tail >= head_dim and main + tail <= 1 << (head_dim - 1).bit_length()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", [(16, 16), (32, 8)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dims", [(192, 128), (96, 64), (24, 16)], ids=lambda d: f"qk{d[0]}v{d[1]}")
def test_gpu_unequal_head_dims(dims, heads, dtype, device):
    lengths = [2048, 1, 127, 128, 129, 1000, 3]
    args = make_dims(lengths, heads, dims, dtype, device, seed=dims[0])
    for causal in (True, False):
        check_dims(args, device, f"gpu dims={dims} causal={causal}", causal=causal)


# -- eager calls remember their launch per layout --


@pytest.fixture
def remembered_launches(monkeypatch):
    """Counts the calls that plan their launch (`prefill._launch`; `helpers.count_planned_launches`)."""
    from tilellm.kernels import prefill

    yield count_planned_launches(monkeypatch, prefill)
    prefill.clear_plans()


@pytest.mark.parametrize("dims", [(32, 32), (48, 32)], ids=["no tail", "tail"])
def test_a_layout_seen_before_runs_its_remembered_launch(dims, remembered_launches, device):
    """A second call with new tensors of the same layout and scalar arguments skips the planning
    and gives the twin's answer (with and without the head dim's tail block); another layout or
    another scalar plans again."""
    for seed in (1, 2):
        args = make_dims([5, 20, 1], (8, 2), dims, torch.float32, device, seed=seed)
        check_dims(args, device, f"seed {seed}")
    assert remembered_launches == [1]
    args = make_dims([5, 20, 1], (8, 2), dims, torch.float32, device, seed=3)
    check_dims(args, device, "another scale", scale=0.2)
    check_dims(args, device, "non-causal", causal=False)
    check_dims(make_dims([7, 9], (8, 2), dims, torch.float32, device, seed=4), device, "another shape")
    assert remembered_launches == [1, 1, 1, 1]


def test_a_remembered_layout_still_rejects_bad_arguments(remembered_launches, device):
    """The remembered launch is found by the arguments' layout and their scalars' types and
    values: a call that differs in any of them is checked again."""
    q, k, v, cu, max_seqlen = make([3, 9], (4, 2), 16, torch.float32, device, seed=6)
    tk.prefill_attention(q, k, v, cu, max_seqlen)
    with pytest.raises(ValueError, match="max_seqlen"):
        tk.prefill_attention(q, k, v, cu, float(max_seqlen))
    with pytest.raises(ValueError, match="cu_seqlens"):
        tk.prefill_attention(q, k, v, cu.to(torch.int64), max_seqlen)
