"""`fused_moe` on block-quantized FP8 experts: Triton against its twin, the twin against an
independent dequantized computation, and the checks of the scales and block shape.

The experts' blocks and the tokens' channel groups are given magnitudes spread over 2^-2..2^2
(one random factor per [bn, bk] weight block and per token-group of the activations), so a scale
read for the wrong block, k step, token or expert changes the output by far more than the
tolerance. Both sides quantize the intermediate between the two GEMMs, and an intermediate value
that sits on an e4m3 rounding boundary can round either way when the fp32 sums before it are
added in another order: one e4m3 step of one element moves an output by up to ~1e-2 of its scale,
so that is the tolerance in fp32 (its differences here are ~1e-6 when no value flips).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import assert_close, poisoned, randn
from tilellm.kernels import moe as tk
from tilellm.kernels.fp8 import FP8_DTYPE
from tilellm.kernels.reference import moe as ref
from tilellm.kernels.reference.fp8_gemm import quantize_fp8_block

FP8_TOL = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def spread(shape, block, gen) -> torch.Tensor:
    """[rows, cols] factors 2^U(-2, 2), one per [block[0], block[1]] block."""
    rows, cols = shape
    nb, kb = -(-rows // block[0]), -(-cols // block[1])
    f = torch.exp2(torch.rand((nb, kb), generator=gen) * 4 - 2)
    return f.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def quantize_experts(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (fp8 [E, N, K], block scales [E, cdiv(N, bn), cdiv(K, bk)])."""
    pairs = [quantize_fp8_block(w[e], list(block)) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def make_fp8(T, E, K, H, I, block, dtype, device, *, seed=0):
    """(x [T, H], w13 fp8, w2 fp8, weights, ids, w13_scale, w2_scale), plus the fp32 weights."""
    gen = torch.Generator().manual_seed(seed)
    bn, bk = block
    x = (randn((T, H), torch.float32, "cpu", gen) * spread((T, H), (1, bk), gen)).to(
        device=device, dtype=dtype
    )
    w13 = randn((E, 2 * I, H), torch.float32, "cpu", gen) / H**0.5
    w2 = randn((E, H, I), torch.float32, "cpu", gen) / I**0.5
    w13 = w13 * torch.stack([spread((2 * I, H), block, gen) for _ in range(E)])
    w2 = w2 * torch.stack([spread((H, I), block, gen) for _ in range(E)])
    w13_q, w13_s = quantize_experts(w13, block)
    w2_q, w2_s = quantize_experts(w2, block)
    weights = torch.rand((T, K), generator=gen)
    ids = torch.rand((T, E), generator=gen).argsort(dim=1)[:, :K]
    tensors = (x, w13_q, w2_q, weights, ids, w13_s, w2_s)
    return tuple(t.to(device) for t in tensors), (w13, w2)


def call(fn, inputs, block, **kwargs):
    x, w13, w2, weights, ids, w13_s, w2_s = inputs
    return fn(x, w13, w2, weights, ids, w13_scale=w13_s, w2_scale=w2_s, block_shape=block, **kwargs)


# ----------------------------------------------------------------------------------------------
# Triton vs reference
# ----------------------------------------------------------------------------------------------

CASES = [
    # (T, E, K, H, I, block, dtypes)
    (9, 4, 2, 64, 64, (32, 32), (torch.float32,)),
    (17, 8, 2, 128, 64, (64, 64), (torch.float32, torch.float16)),
    # I = 96: a partial column tile (BLOCK_N 64) and up rows that start inside a 64-row block
    (13, 6, 2, 64, 96, (64, 32), (torch.float32, torch.float16)),
    (1, 8, 2, 64, 32, (32, 32), (torch.float32,)),  # decode: one token
    (7, 4, 1, 96, 64, (32, 32), (torch.float32, torch.float16)),  # K = 1: `out` written by the second GEMM
]


def _case_id(T, E, K, H, I, block, dtype) -> str:
    return f"T{T}-E{E}-K{K}-H{H}-I{I}-block{block[0]}x{block[1]}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize(
    ("T", "E", "K", "H", "I", "block", "dtype"),
    [pytest.param(*case[:-1], dtype, id=_case_id(*case[:-1], dtype)) for case in CASES for dtype in case[-1]],
)
def test_matches_reference(T, E, K, H, I, block, dtype, device):
    inputs, _ = make_fp8(T, E, K, H, I, block, dtype, device, seed=T + E + H + I)
    before = [t.clone() for t in inputs]
    expected = call(ref.fused_moe, inputs, list(block))
    out = poisoned(expected)
    got = call(tk.fused_moe, inputs, list(block), out=out)
    assert got is out, "fused_moe must return the out buffer it was given"
    assert_close(got, expected, FP8_TOL[dtype], f"fp8 fused_moe {dtype}")
    for name, a, b in zip(("x", "w13", "w2", "weights", "ids", "w13_scale", "w2_scale"), before, inputs):
        assert torch.equal(_bits(a), _bits(b)), f"fused_moe modified {name}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def test_many_tokens(device):
    """72 rows per expert: 64-row blocks, two per expert; block_shape as a tuple."""
    inputs, _ = make_fp8(72, 2, 2, 64, 64, (64, 32), torch.float32, device, seed=72)
    expected = call(ref.fused_moe, inputs, (64, 32))
    assert_close(call(tk.fused_moe, inputs, (64, 32)), expected, FP8_TOL[torch.float32], "many tokens")


def test_transposed_scales(device):
    """Scales of any strides (a checkpoint's tensors may arrive as views)."""
    inputs, _ = make_fp8(9, 4, 2, 64, 64, (32, 32), torch.float32, device, seed=4)
    x, w13, w2, weights, ids, w13_s, w2_s = inputs
    w13_t = w13_s.transpose(1, 2).contiguous().transpose(1, 2)
    w2_t = w2_s.transpose(1, 2).contiguous().transpose(1, 2)
    got = call(tk.fused_moe, (x, w13, w2, weights, ids, w13_t, w2_t), [32, 32])
    assert_close(got, call(ref.fused_moe, inputs, [32, 32]), FP8_TOL[torch.float32], "strided scales")


# ----------------------------------------------------------------------------------------------
# Reference vs an independent dequantized computation, and vs the unquantized experts
# ----------------------------------------------------------------------------------------------


def _quant_dequant_rows(x: torch.Tensor, bk: int) -> torch.Tensor:
    """Each row's groups of bk channels: s = max(amax, 1e-10) / 448, e4m3(x / s) * s, in fp32."""
    g = x.float().reshape(x.shape[0], -1, bk)
    s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    return ((g / s).clamp(-448, 448).to(FP8_DTYPE).float() * s).reshape(x.shape)


def _dequant(w_q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """[N, K] fp8 with [cdiv(N, bn), cdiv(K, bk)] scales -> fp32 by explicit block loops."""
    out = w_q.float()
    bn, bk = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale[i, j]
    return out


def _dense(x, w13_q, w2_q, weights, ids, w13_s, w2_s, block):
    """Token by token and choice by choice, from the dequantized tensors."""
    I = w2_q.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    xd = _quant_dequant_rows(x, block[1])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = _dequant(w13_q[e], w13_s[e], block) @ xd[t]
            h = (F.silu(gu[:I]) * gu[I:]).to(x.dtype)
            hd = _quant_dequant_rows(h[None], block[1])[0]
            out[t] += weights[t, k] * (_dequant(w2_q[e], w2_s[e], block) @ hd)
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("T", "E", "K", "H", "I", "block"), [(5, 4, 2, 64, 96, (64, 32)), (6, 3, 3, 64, 64, (32, 64))]
)
def test_reference_matches_dequantized(T, E, K, H, I, block, dtype):
    inputs, (w13, w2) = make_fp8(T, E, K, H, I, block, dtype, "cpu", seed=T)
    got = call(ref.fused_moe, inputs, list(block))
    assert_close(got, _dense(*inputs, block), FP8_TOL[dtype], "reference vs dequantized")
    # and the quantization is the right way round: close to the unquantized experts
    x, _, _, weights, ids, _, _ = inputs
    exact = ref.fused_moe(x.float(), w13, w2, weights, ids)
    rel = float((got.float() - exact).norm() / exact.norm())
    assert rel < 0.08, f"fp8 experts differ from the fp32 ones by {rel:.3f} (relative norm)"


# ----------------------------------------------------------------------------------------------
# Input checks (both twins)
# ----------------------------------------------------------------------------------------------


def _bad(**changes):
    return lambda a: {**a, **changes}


BAD_FP8 = {
    "no_w13_scale": (
        _bad(w13_scale=None),
        r"w13_scale \[E, cdiv\(2 \* I, bn\), cdiv\(H, bk\)\] float32 is required",
    ),
    "no_w2_scale": (_bad(w2_scale=None), r"w2_scale \[E, cdiv\(H, bn\), cdiv\(I, bk\)\] float32 is required"),
    "no_block_shape": (_bad(block_shape=None), r"block_shape \[bn, bk\] is required"),
    "block_not_pair": (_bad(block_shape=[32]), r"block_shape must be two ints \[bn, bk\]"),
    "block_float": (_bad(block_shape=[32.0, 32]), r"block_shape must be two ints"),
    "bn_not_16": (_bad(block_shape=[24, 32]), r"block_shape\[0\] \(bn\) must be a positive multiple of 16"),
    "bk_not_pow2": (_bad(block_shape=[32, 48]), r"block_shape\[1\] \(bk\) must be a power of two >= 16"),
    "i_not_multiple": (_bad(block_shape=[32, 64]), r"I = 32 must be a multiple of block_shape\[1\] = 64"),
    "w13_scale_shape": (
        lambda a: {**a, "w13_scale": a["w13_scale"][:, :1]},
        r"w13_scale must be \[E, cdiv\(2 \* I, bn\), cdiv\(H, bk\)\] = \(4, 2, 2\) for block_shape \[32, 3",
    ),
    "w2_scale_dtype": (lambda a: {**a, "w2_scale": a["w2_scale"].half()}, "w2_scale must be float32"),
    "w2_scale_2d": (lambda a: {**a, "w2_scale": a["w2_scale"][0]}, r"w2_scale must be 3-D"),
    "w13_scale_device": (lambda a: {**a, "w13_scale": a["w13_scale"].to("meta")}, "w13_scale is on meta"),
    "mixed_dtypes": (lambda a: {**a, "w2": a["w2"].float()}, "w2 dtype torch.float32 differs from w13 dtype"),
    "scales_for_float": (
        lambda a: {**a, "w13": a["w13"].float(), "w2": a["w2"].float()},
        r"w13_scale is only for float8_e4m3fn experts",
    ),
}


@pytest.mark.parametrize("fn", [tk.fused_moe, ref.fused_moe], ids=["triton", "reference"])
@pytest.mark.parametrize("case", list(BAD_FP8))
def test_bad_fp8_inputs(case, fn):
    (x, w13, w2, weights, ids, w13_s, w2_s), _ = make_fp8(3, 4, 2, 64, 32, (32, 32), torch.float32, "cpu")
    args = {
        "hidden_states": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids,
        "w13_scale": w13_s, "w2_scale": w2_s, "block_shape": [32, 32],
    }  # fmt: skip
    bad, message = BAD_FP8[case]
    with pytest.raises(ValueError, match=r"^fused_moe: " + message):
        fn(**bad(args))


def test_block_shape_for_float_experts():
    """block_shape alone with unquantized experts is refused too (it would be silently ignored)."""
    x = torch.randn(2, 32)
    w13, w2 = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    weights, ids = torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int64)
    for fn in (tk.fused_moe, ref.fused_moe):
        with pytest.raises(ValueError, match="block_shape is only for float8_e4m3fn experts"):
            fn(x, w13, w2, weights, ids, block_shape=[32, 32])


def test_no_tokens():
    inputs, _ = make_fp8(0, 4, 2, 64, 32, (32, 32), torch.float32, "cpu")
    for fn in (tk.fused_moe, ref.fused_moe):
        assert call(fn, inputs, [32, 32]).shape == (0, 64)


# ----------------------------------------------------------------------------------------------
# Static activation scales (a1_scale / a2_scale)
# ----------------------------------------------------------------------------------------------


def _routed_inter(inputs, block) -> torch.Tensor:
    """The SiLU-and-mul outputs [T, K, I] of every routed pair, from the unquantized x and the
    dequantized experts (fp32): what a calibration run sees."""
    x, w13_q, w2_q, _, ids, w13_s, _ = (t.cpu() for t in inputs)
    I = w2_q.shape[2]
    gu = torch.stack([x.float() @ _dequant(w13_q[e], w13_s[e], block).T for e in range(w13_q.shape[0])])
    gu = gu[ids.long(), torch.arange(x.shape[0])[:, None]]  # [T, K, 2I]
    return F.silu(gu[..., :I]) * gu[..., I:]


def static_scales(inputs, block, headroom1, headroom2) -> tuple[torch.Tensor, torch.Tensor]:
    """(a1_scale, a2_scale), [1] float32 on x's device: amax / 448 of x and of the routed
    SiLU-and-mul outputs, times headroom (below 1, the values past headroom * amax saturate)."""
    x = inputs[0]
    a1 = float(x.abs().max()) / 448 * headroom1
    a2 = float(_routed_inter(inputs, block).abs().max()) / 448 * headroom2
    return tuple(torch.tensor([a], dtype=torch.float32, device=x.device) for a in (a1, a2))


STATIC_CASES = [
    # (T, E, K, H, I, block, dtypes)
    (9, 4, 2, 64, 64, (32, 32), (torch.float32,)),
    (13, 6, 2, 64, 96, (64, 32), (torch.float32, torch.float16)),  # a partial column tile
    (1, 8, 2, 64, 32, (32, 32), (torch.float32,)),  # decode: one token
    (7, 4, 1, 96, 64, (32, 32), (torch.float32, torch.bfloat16)),  # K = 1: `out` written by the second GEMM
]


@pytest.mark.parametrize(
    ("T", "E", "K", "H", "I", "block", "dtype"),
    [
        pytest.param(*case[:-1], dtype, id=_case_id(*case[:-1], dtype))
        for case in STATIC_CASES
        for dtype in case[-1]
    ],
)
def test_static_scales_match_reference(T, E, K, H, I, block, dtype, device):
    """Scales at half the calibrated ones (the largest activations saturate): the same output as
    the twin's within the fp8 tolerance, into the `out` given, the scales left as they were."""
    inputs, _ = make_fp8(T, E, K, H, I, block, dtype, device, seed=T + E + H + I)
    a1, a2 = static_scales(inputs, block, 0.5, 0.5)
    expected = call(ref.fused_moe, inputs, list(block), a1_scale=a1, a2_scale=a2)
    before = a1.clone(), a2.clone()
    out = poisoned(expected)
    got = call(tk.fused_moe, inputs, list(block), out=out, a1_scale=a1, a2_scale=a2)
    assert got is out
    assert torch.equal(a1, before[0]) and torch.equal(a2, before[1]), "fused_moe modified a scale"
    assert_close(got, expected, FP8_TOL[dtype], f"static fp8 fused_moe {dtype}")


@pytest.mark.parametrize("fn", [tk.fused_moe, ref.fused_moe], ids=["triton", "reference"])
def test_static_scales_are_used(fn, device):
    """Each scale a sixteenth of its calibrated value in turn (its activations saturate): the
    output moves far past the fp8 tolerance from the calibrated scales' output, which is itself
    close to the dynamic one; the Triton side follows the twin in each case."""
    inputs, _ = make_fp8(9, 4, 2, 64, 64, (32, 32), torch.float32, device, seed=21)
    a1, a2 = static_scales(inputs, (32, 32), 1.0, 1.0)
    low1, low2 = static_scales(inputs, (32, 32), 1 / 16, 1 / 16)
    calibrated = call(fn, inputs, [32, 32], a1_scale=a1, a2_scale=a2)
    dynamic = call(fn, inputs, [32, 32])
    scale = float(calibrated.abs().max())
    assert float((calibrated - dynamic).abs().max()) < 0.1 * scale
    for what, s1, s2 in (("a1_scale", low1, a2), ("a2_scale", a1, low2)):
        got = call(fn, inputs, [32, 32], a1_scale=s1, a2_scale=s2)
        diff = float((got - calibrated).abs().max())
        assert diff > 10 * FP8_TOL[torch.float32] * scale, (
            f"a saturating {what} moves the output by {diff:.3g}"
        )
        if fn is tk.fused_moe:
            expected = call(ref.fused_moe, inputs, [32, 32], a1_scale=s1, a2_scale=s2)
            assert_close(got, expected, FP8_TOL[torch.float32], f"saturating {what}")


def _quant_dequant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / s, +-448)) * s in fp32."""
    return (x.float() / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale


def test_reference_static_matches_hand_computation():
    """One expert per token (top_k 1, two experts), token by token from the dequantized weights:
    x quantized by a1, w13, SiLU-and-mul, quantized by a2, w2, times the routing weight. Both
    scales a quarter of the calibrated ones, so that some of x and of the intermediate saturate
    (a scale ignored, or applied per token-group, would be far off)."""
    inputs, _ = make_fp8(6, 2, 1, 64, 32, (32, 32), torch.float32, "cpu", seed=12)
    x, w13_q, w2_q, weights, ids, w13_s, w2_s = inputs
    a1, a2 = static_scales(inputs, (32, 32), 0.25, 0.25)
    got = call(ref.fused_moe, inputs, [32, 32], a1_scale=a1, a2_scale=a2)
    xd = _quant_dequant_static(x, a1)
    expected = torch.zeros(6, 64)
    saturated = 0
    for t in range(6):
        e = int(ids[t, 0])
        gu = _dequant(w13_q[e], w13_s[e], (32, 32)) @ xd[t]
        h = F.silu(gu[:32]) * gu[32:]
        saturated += int((h.abs() / a2 > 464).sum())
        expected[t] = weights[t, 0] * (_dequant(w2_q[e], w2_s[e], (32, 32)) @ _quant_dequant_static(h, a2))
    assert (x.abs() / a1 > 464).any() and saturated > 0, "no saturation to check"
    assert_close(got, expected, 1e-5, "static reference vs hand computation")


def _fp8_args(T=3):
    (x, w13, w2, weights, ids, w13_s, w2_s), _ = make_fp8(T, 4, 2, 64, 32, (32, 32), torch.float32, "cpu")
    return {
        "hidden_states": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids,
        "w13_scale": w13_s, "w2_scale": w2_s, "block_shape": [32, 32],
        "a1_scale": torch.tensor([0.01]), "a2_scale": torch.tensor([0.01]),
    }  # fmt: skip


def _unquantized(dtype):
    """The same call on float experts of `dtype`, without block scales but with a1 / a2."""

    def change(a):
        return {
            **a, "hidden_states": a["hidden_states"].to(dtype), "w13": a["w13"].to(dtype),
            "w2": a["w2"].to(dtype), "w13_scale": None, "w2_scale": None, "block_shape": None,
        }  # fmt: skip

    return change


ONE_FLOAT32 = "must be a float32 tensor of one element, got "
BAD_STATIC = {
    "only_a1": (
        _bad(a2_scale=None),
        r"static activations need both a1_scale \(the experts' input\) and a2_scale",
    ),
    "only_a2": (_bad(a1_scale=None), r"static activations need both a1_scale .* give both or neither"),
    "float32_experts": (
        _unquantized(torch.float32),
        r"a1_scale / a2_scale are only for float8_e4m3fn experts, got torch.float32",
    ),
    "bfloat16_experts": (
        _unquantized(torch.bfloat16),
        r"a1_scale / a2_scale are only for float8_e4m3fn experts, got torch.bfloat16",
    ),
    "a1_float64": (
        lambda a: {**a, "a1_scale": a["a1_scale"].double()},
        r"a1_scale " + ONE_FLOAT32 + r"torch.float64 of shape \(1,\)",
    ),
    "a2_two_elements": (
        lambda a: {**a, "a2_scale": a["a2_scale"].repeat(2)},
        r"a2_scale " + ONE_FLOAT32 + r"torch.float32 of shape \(2,\)",
    ),
    "a1_not_tensor": (_bad(a1_scale=0.01), "a1_scale " + ONE_FLOAT32 + "float"),
    "a2_device": (
        lambda a: {**a, "a2_scale": a["a2_scale"].to("meta")},
        "a2_scale is on meta but hidden_states is on cpu",
    ),
}


@pytest.mark.parametrize("fn", [tk.fused_moe, ref.fused_moe], ids=["triton", "reference"])
@pytest.mark.parametrize("case", list(BAD_STATIC))
def test_bad_static_scales(case, fn):
    bad, message = BAD_STATIC[case]
    with pytest.raises(ValueError, match=r"^fused_moe: " + message):
        fn(**bad(_fp8_args()))


def test_static_scales_no_tokens():
    """No tokens: an empty output, the scales checked all the same."""
    args = _fp8_args(T=0)
    for fn in (tk.fused_moe, ref.fused_moe):
        assert fn(**args).shape == (0, 64)
        with pytest.raises(ValueError, match="static activations need both"):
            fn(**{**args, "a2_scale": None})


# ----------------------------------------------------------------------------------------------
# GPU only: bf16 at DeepSeek's block, no host sync, CUDA graphs
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("T", "E", "K", "H", "I"), [(1, 64, 6, 2048, 1408), (64, 32, 8, 1024, 768), (517, 8, 2, 256, 256)]
)
def test_bf16_deepseek_block(T, E, K, H, I):
    inputs, _ = make_fp8(T, E, K, H, I, (128, 128), torch.bfloat16, "cuda", seed=T)
    expected = call(ref.fused_moe, inputs, [128, 128])
    assert_close(
        call(tk.fused_moe, inputs, [128, 128]), expected, FP8_TOL[torch.bfloat16], "bf16 fp8 experts"
    )


@pytest.mark.gpu
def test_no_host_sync_and_cuda_graph(monkeypatch):
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    inputs, _ = make_fp8(33, 16, 4, 256, 256, (128, 128), torch.bfloat16, "cuda", seed=7)
    x, w13, w2, weights, ids, w13_s, w2_s = inputs
    out = torch.empty_like(x)
    call(tk.fused_moe, inputs, [128, 128], out=out)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(tk.fused_moe, inputs, [128, 128], out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(tk.fused_moe, inputs, [128, 128], out=out)
    (new_x, _, _, new_weights, new_ids, _, _), _ = make_fp8(
        33, 16, 4, 256, 256, (128, 128), torch.bfloat16, "cuda", seed=8
    )
    x.copy_(new_x)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    out.fill_(float("nan"))
    graph.replay()
    assert_close(out, call(ref.fused_moe, inputs, [128, 128]), FP8_TOL[torch.bfloat16], "graph replay")
