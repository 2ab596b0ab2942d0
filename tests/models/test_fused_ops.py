"""Fused Triton ops (`tilellm.kernels.fused`) against their PyTorch twins, and the twins against
plain formulas / transformers. On CPU the kernels run under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

import tilellm.kernels as tk
import tilellm.kernels.fused as fused
import tilellm.kernels.reference as tk_ref
import tilellm.kernels.reference.fused as ref

# fp32: both compute in fp32, so only summation order differs; fp16: at most one rounding apart
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16]


def _randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = max(expected.float().abs().max().item(), 1.0)
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max abs error {err:.3g} (output scale {scale:.3g})"


# ---------------------------------------------------------------------------------------------
# rms_norm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, h", [(1, 64), (7, 96), (33, 1000), (3, 4097), (130, 16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, n, h, with_residual):
    x = _randn(n, h, dtype=dtype, seed=1, device=device) * 3
    w = _randn(h, seed=2, device=device)
    residual = _randn(n, h, dtype=dtype, seed=3, device=device) if with_residual else None
    x_copy = x.clone()
    out = fused.rms_norm(x, w, 1e-6, residual=residual)
    expected = ref.rms_norm(x, w, 1e-6, residual=residual)
    torch.testing.assert_close(x, x_copy, rtol=0, atol=0)  # inputs untouched
    if with_residual:
        _assert_close(out[0], expected[0], dtype)
        _assert_close(out[1], expected[1], dtype)
    else:
        _assert_close(out, expected, dtype)


def test_rms_norm_strided_rows(device):
    """A row-strided view (e.g. a slice of a wider buffer) is read through its stride."""
    base = _randn(9, 200, seed=4, device=device)
    x = base[:, 37:137]
    w = _randn(100, seed=5, device=device)
    _assert_close(fused.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), torch.float32)


def test_rms_norm_reference_formula():
    x, w, r = _randn(5, 24, seed=1), _randn(24, seed=2), _randn(5, 24, seed=3)
    s = x + r
    expected = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    y, new_res = ref.rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(new_res, s)


def test_rms_norm_empty(device):
    x = torch.empty(0, 32, device=device)
    assert fused.rms_norm(x, torch.ones(32, device=device), 1e-6).shape == (0, 32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.randn(2, 3, 4), weight=torch.ones(4)), r"x must be \[N, H\]"),
        (dict(x=torch.randn(2, 4), weight=torch.ones(5)), r"weight must be \[H=4\]"),
        (dict(x=torch.randn(2, 4).int(), weight=torch.ones(4)), "x must be float32"),
        (dict(x=torch.randn(2, 4), weight=torch.ones(4), residual=torch.randn(3, 4)), "residual shape"),
        (dict(x=torch.randn(2, 4), weight=torch.ones(4), residual=torch.randn(2, 4).half()), "must match x"),
        (dict(x=torch.randn(2, 4), weight=torch.ones(4), eps=0.0), "eps must be > 0"),
    ],
)
@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
def test_rms_norm_rejects_bad_input(impl, kwargs, match):
    kwargs = {"eps": 1e-6, **kwargs}
    with pytest.raises(ValueError, match=match):
        impl.rms_norm(kwargs.pop("x"), kwargs.pop("weight"), kwargs.pop("eps"), **kwargs)


# ---------------------------------------------------------------------------------------------
# silu_and_mul
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, i", [(1, 64), (7, 300), (70, 24), (3, 2500)])
def test_silu_and_mul_matches_reference(device, dtype, n, i):
    x = _randn(n, 2 * i, dtype=dtype, seed=6, device=device) * 4
    _assert_close(fused.silu_and_mul(x), ref.silu_and_mul(x), dtype)


def test_silu_and_mul_reference_formula():
    x = _randn(4, 10, seed=7)
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(ref.silu_and_mul(x), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(3, 5), "even last dim"),
        (torch.randn(2, 3, 4), r"\[N, 2\*I\]"),
        (torch.ones(2, 4).long(), "float"),
    ],
)
def test_silu_and_mul_rejects_bad_input(impl, x, match):
    with pytest.raises(ValueError, match=match):
        impl.silu_and_mul(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, i, group", [(1, 128, 128), (37, 384, 128), (70, 64, 32), (5, 96, 48)])
@pytest.mark.parametrize("column_major_scales", [False, True])
def test_silu_and_mul_quant_equals_silu_and_mul_then_quant(device, dtype, n, i, group, column_major_scales):
    """One launch = `silu_and_mul` then `per_token_group_quant_fp8`: the same e4m3 bits and scales,
    the scales in the layout asked for (bf16 too: no tl.dot, and both sides share the rounding)."""
    import tilellm.kernels.fp8_gemm as fp8_gemm

    x = _randn(n, 2 * i, dtype=dtype, seed=n, device=device) * 4
    x_q, x_s = fused.silu_and_mul_per_token_group_quant_fp8(x, group, column_major_scales=column_major_scales)
    want_q, want_s = fp8_gemm.per_token_group_quant_fp8(
        fused.silu_and_mul(x), group, column_major_scales=column_major_scales
    )
    assert x_q.shape == (n, i) and x_s.shape == (n, i // group)
    assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(x_s, want_s) and x_s.stride() == want_s.stride()
    assert x_s.stride(0) == (1 if column_major_scales else i // group)


def test_silu_and_mul_quant_strided_rows(device):
    """Rows of a wider buffer (row stride > 2I) and a non-unit last-dim stride read as their values."""
    wide = _randn(9, 3 * 256, seed=6, device=device) * 4
    for x in (wide[:, :512], wide[:, 1::2][:, :256]):  # a row-strided view; every other column
        got = fused.silu_and_mul_per_token_group_quant_fp8(x, 64)
        want = fused.silu_and_mul_per_token_group_quant_fp8(x.contiguous(), 64)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(
            got[1], want[1]
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_quant_twin(device, dtype):
    """The twin (PyTorch silu_and_mul, then its quantization) within one e4m3 step of the kernel."""
    x = _randn(19, 512, dtype=dtype, seed=5, device=device) * 4
    got = [t.float() for t in fused.silu_and_mul_per_token_group_quant_fp8(x, 128)]
    want = [t.float() for t in ref.silu_and_mul_per_token_group_quant_fp8(x, 128)]
    torch.testing.assert_close(got[1], want[1], rtol=2e-3, atol=0)
    deq = [q * s.repeat_interleave(128, dim=1) for q, s in (got, want)]
    assert bool(((deq[0] - deq[1]).abs() <= 0.125 * deq[1].abs() + 1e-6).all())


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
@pytest.mark.parametrize(
    "x, group, match",
    [
        (torch.randn(3, 256), 0, "group_size must be a positive int"),
        (torch.randn(3, 200), 64, "must be a multiple of group_size"),
        (torch.randn(3, 255), 64, "even last dim"),
    ],
)
def test_silu_and_mul_quant_rejects_bad_input(impl, x, group, match):
    with pytest.raises(ValueError, match=match):
        impl.silu_and_mul_per_token_group_quant_fp8(x, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, h, group", [(1, 128, 128), (37, 384, 128), (70, 96, 32), (5, 1024, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("column_major_scales", [False, True])
def test_rms_norm_quant_equals_rms_norm_then_quant(
    device, dtype, n, h, group, with_residual, column_major_scales
):
    """One launch = `rms_norm` then `per_token_group_quant_fp8`: the same e4m3 bits and scales,
    the same new residual, the scales in the layout asked for. H = 384 and 96 leave the padded
    row's last group of lanes empty (the tile is a power of two wide)."""
    import tilellm.kernels.fp8_gemm as fp8_gemm

    x = _randn(n, h, dtype=dtype, seed=n, device=device) * 3
    weight = _randn(h, seed=h, device=device).to(dtype) + 1
    residual = _randn(n, h, dtype=dtype, seed=n + 1, device=device) if with_residual else None
    got = fused.rms_norm_per_token_group_quant_fp8(
        x, weight, 1e-6, group, residual=residual, column_major_scales=column_major_scales
    )
    normed = fused.rms_norm(x, weight, 1e-6, residual=residual)
    y, want_res = normed if with_residual else (normed, None)
    want_q, want_s = fp8_gemm.per_token_group_quant_fp8(y, group, column_major_scales=column_major_scales)
    assert len(got) == (3 if with_residual else 2)
    x_q, x_s = got[0], got[1]
    assert x_q.shape == (n, h) and x_s.shape == (n, h // group)
    if dtype == torch.float32 and x.is_cuda:
        # fp32 rows keep every bit of y, and two compiled kernels may sum a row's squares in
        # another order: scales within a rounding, codes at most one e4m3 step apart
        torch.testing.assert_close(x_s, want_s, rtol=1e-6, atol=0)
        steps = (x_q.view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
        assert int(steps.max()) <= 1, f"{int((steps > 1).sum())} codes more than one e4m3 step apart"
    else:
        assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(x_s, want_s)
    assert x_s.stride() == want_s.stride()
    assert x_s.stride(0) == (1 if column_major_scales else h // group)
    if with_residual:
        assert torch.equal(got[2], want_res)


def test_rms_norm_quant_strided_rows(device):
    """Rows of a wider buffer, and a residual that is one, read as their values."""
    wide = _randn(9, 3 * 256, seed=6, device=device) * 4
    res_wide = _randn(9, 512, seed=7, device=device)
    weight = _randn(256, seed=8, device=device)
    for x in (wide[:, :256], wide[:, 1::2][:, :256]):  # a row-strided view; every other column
        got = fused.rms_norm_per_token_group_quant_fp8(x, weight, 1e-5, 64, residual=res_wide[:, ::2])
        want = fused.rms_norm_per_token_group_quant_fp8(
            x.contiguous(), weight, 1e-5, 64, residual=res_wide[:, ::2].contiguous()
        )
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_rms_norm_quant_empty(device):
    x = torch.empty(0, 256, device=device)
    x_q, x_s = fused.rms_norm_per_token_group_quant_fp8(x, torch.ones(256, device=device), 1e-6, 128)
    assert x_q.shape == (0, 256) and x_s.shape == (0, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_quant_twin(device, dtype):
    """The twin (PyTorch rms_norm, then its quantization) within one e4m3 step of the kernel."""
    x = _randn(19, 512, dtype=dtype, seed=5, device=device) * 4
    weight = _randn(512, seed=9, device=device).to(dtype)
    residual = _randn(19, 512, dtype=dtype, seed=10, device=device)
    args = (x, weight, 1e-6, 128)
    got = [t.float() for t in fused.rms_norm_per_token_group_quant_fp8(*args, residual=residual)]
    want = [t.float() for t in ref.rms_norm_per_token_group_quant_fp8(*args, residual=residual)]
    torch.testing.assert_close(got[1], want[1], rtol=2e-3, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    deq = [q * s.repeat_interleave(128, dim=1) for q, s, _ in (got, want)]
    assert bool(((deq[0] - deq[1]).abs() <= 0.125 * deq[1].abs() + 1e-6).all())


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
@pytest.mark.parametrize(
    "h, group, kwargs, match",
    [
        (256, 0, {}, "group_size must be a positive int"),
        (200, 64, {}, "must be a multiple of group_size"),
        (96, 48, {}, "group_size must be a power of two"),
        (256, 128, {"quant_eps": 0.0}, "quant_eps must be a positive number"),
        (256, 128, {"residual": torch.randn(3, 128)}, "residual shape"),
    ],
)
def test_rms_norm_quant_rejects_bad_input(impl, h, group, kwargs, match):
    with pytest.raises(ValueError, match=match):
        impl.rms_norm_per_token_group_quant_fp8(torch.randn(3, h), torch.ones(h), 1e-6, group, **kwargs)


# ---------------------------------------------------------------------------------------------
# apply_rotary
# ---------------------------------------------------------------------------------------------


def _cos_sin_cache(max_pos: int, d: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t, hq, hkv, d", [(1, 1, 1, 16), (7, 6, 2, 24), (9, 16, 8, 128), (40, 4, 1, 64), (5, 3, 3, 2)]
)
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_apply_rotary_matches_reference(device, dtype, t, hq, hkv, d, pos_dtype):
    max_pos = 300
    q = _randn(t, hq, d, dtype=dtype, seed=8, device=device)
    k = _randn(t, hkv, d, dtype=dtype, seed=9, device=device)
    positions = torch.randint(0, max_pos, (t,), generator=torch.Generator().manual_seed(t)).to(pos_dtype)
    cache = _cos_sin_cache(max_pos, d).to(device)
    q_copy = q.clone()
    q_out, k_out = fused.apply_rotary(q, k, positions.to(device), cache)
    q_ref, k_ref = ref.apply_rotary(q, k, positions.to(device), cache)
    torch.testing.assert_close(q, q_copy, rtol=0, atol=0)  # not in place
    _assert_close(q_out, q_ref, dtype)
    _assert_close(k_out, k_ref, dtype)


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t, hq, hkv, d", [(1, 1, 1, 2), (7, 6, 1, 16), (20, 4, 1, 64)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_apply_rotary_interleaved_equals_the_permuted_call(device, impl, dtype, t, hq, hkv, d, with_norm):
    """interleaved=True (DeepSeek's pairs) = the same op on q and k permuted to [evens | odds]: the
    same bits, on strided views of a packed projection (as DeepSeek's q_pe and k_pe are)."""
    packed = _randn(t, hq * (d + 8) + hkv * d + 5, dtype=dtype, seed=t, device=device) * 3
    q = packed[:, : hq * (d + 8)].view(t, hq, d + 8)[..., 8:]  # q_pe after each head's "nope" dims
    k = packed[:, hq * (d + 8) : hq * (d + 8) + hkv * d].view(t, hkv, d)
    positions = torch.randint(0, 300, (t,), generator=torch.Generator().manual_seed(2)).to(device)
    cache = _cos_sin_cache(300, d).to(device)
    perm = ref.interleaved_to_halves(d, device)
    norms, norms_perm = {}, {}
    if with_norm:
        wq, wk = _randn(d, seed=3, device=device), _randn(d, seed=4, device=device)
        norms = {"q_norm_weight": wq, "k_norm_weight": wk}
        norms_perm = {"q_norm_weight": wq[perm], "k_norm_weight": wk[perm]}
    got = impl.apply_rotary(q, k, positions, cache, interleaved=True, **norms)
    want = impl.apply_rotary(
        q[..., perm].contiguous(), k[..., perm].contiguous(), positions, cache, **norms_perm
    )
    if with_norm and dtype == torch.float32 and q.is_cuda:
        # the two compiled variants may sum a head's squares in another order, and fp32 outputs
        # keep the last bit of that difference (16-bit outputs round it away)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
def test_apply_rotary_interleaved_stores_the_rotated_rows(device, impl):
    """With the cache arguments, interleaved=True stores what the permuted call stores."""
    t, hkv, d = 6, 2, 16
    q, k, v = (_randn(t, h, d, seed=s, device=device) for h, s in ((4, 1), (hkv, 2), (hkv, 3)))
    positions = torch.arange(t, device=device) * 7
    cache = _cos_sin_cache(64, d).to(device)
    slots = torch.tensor([3, 0, -1, 9, 4, 15], device=device)
    perm = ref.interleaved_to_halves(d, device)
    caches = []
    for interleaved in (True, False):
        kc, vc = torch.zeros(2, 8, hkv, d, device=device), torch.zeros(2, 8, hkv, d, device=device)
        qi, ki = (q, k) if interleaved else (q[..., perm].contiguous(), k[..., perm].contiguous())
        store = {"v": v, "k_cache": kc, "v_cache": vc, "slot_mapping": slots}
        impl.apply_rotary(qi, ki, positions, cache, interleaved=interleaved, **store)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert caches[0][0].abs().sum() > 0


def test_interleaved_to_halves():
    assert ref.interleaved_to_halves(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, hq, hkv, d", [(1, 2, 1, 16), (11, 6, 2, 24), (33, 16, 8, 128)])
def test_apply_rotary_with_qk_norm_matches_reference(device, dtype, t, hq, hkv, d):
    """Qwen3's per-head q/k RMSNorm fused into the rotary pass, on strided views of a qkv buffer."""
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=13, device=device) * 5
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    qw, kw = _randn(d, seed=14, device=device), _randn(d, seed=15, device=device)
    positions = torch.randint(0, 100, (t,), generator=torch.Generator().manual_seed(1)).to(device)
    cache = _cos_sin_cache(100, d).to(device)
    kwargs = dict(q_norm_weight=qw, k_norm_weight=kw, eps=1e-6)
    q_out, k_out = fused.apply_rotary(q, k, positions, cache, **kwargs)
    q_ref, k_ref = ref.apply_rotary(q, k, positions, cache, **kwargs)
    _assert_close(q_out, q_ref, dtype)
    _assert_close(k_out, k_ref, dtype)
    # the reference is norm-then-rotate
    q_normed = ref.rms_norm(q.reshape(-1, d).float(), qw, 1e-6).view(t, hq, d)
    q_two_step, _ = ref.apply_rotary(q_normed, k.float(), positions, cache)
    _assert_close(q_ref.float(), q_two_step, torch.float32 if dtype == torch.float32 else dtype)


def test_apply_rotary_strided_views_of_qkv(device):
    """q, k as views into a packed qkv projection (token stride > H * D), as the model passes them."""
    t, hq, hkv, d = 6, 4, 2, 32
    qkv = _randn(t, (hq + 2 * hkv) * d, seed=10, device=device)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    positions = torch.arange(3, 3 + t, device=device)
    cache = _cos_sin_cache(64, d).to(device)
    q_out, k_out = fused.apply_rotary(q, k, positions, cache)
    q_ref, k_ref = ref.apply_rotary(q.contiguous(), k.contiguous(), positions, cache)
    _assert_close(q_out, q_ref, torch.float32)
    _assert_close(k_out, k_ref, torch.float32)


def _qkv_views(t, hq, hkv, d, dtype, device, seed):
    """q, k, v as the model passes them: strided views of one packed qkv projection."""
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=seed, device=device) * 3
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return q, k, v


def _poisoned_caches(num_blocks, block_size, hkv, d, cache_dtype, device):
    """Two caches whose every slot holds NaN (FP8: its NaN byte), so any write shows."""
    nan = torch.full((num_blocks, block_size, hkv, d), float("nan"), device=device)
    return nan.to(cache_dtype), nan.to(cache_dtype).clone()  # (two tensors also when fp32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that NaN slots compare equal."""
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float16, torch.float8_e4m3fn),
    ],
)
@pytest.mark.parametrize(
    "t, hq, hkv, d, qk_norm", [(1, 2, 1, 16, True), (13, 6, 2, 32, False), (9, 16, 8, 128, True)]
)
def test_apply_rotary_store_equals_rotary_then_store(
    device, impl, dtype, cache_dtype, t, hq, hkv, d, qk_norm
):
    """With the cache arguments, one call = `apply_rotary` then `store_kvcache` of its rotated k:
    the same q and k come back, the same bits land in every written slot (FP8 too, with scales),
    and slots of -1 tokens and every other slot are left alone."""
    store_ops = tk if impl is fused else tk_ref
    q, k, v = _qkv_views(t, hq, hkv, d, dtype, device, seed=21)
    positions = torch.randint(0, 200, (t,), generator=torch.Generator().manual_seed(t)).to(device)
    cache = _cos_sin_cache(200, d).to(device)
    kwargs = {}
    if qk_norm:
        kwargs = dict(
            q_norm_weight=_randn(d, seed=22, device=device), k_norm_weight=_randn(d, seed=23, device=device)
        )
    num_blocks, block_size = 4, 8
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(5))[:t]
    slots[torch.arange(t) % 3 == 1] = -1  # padding rows of a graph batch
    slots = slots.to(device=device, dtype=torch.int32)
    scales = {}
    if cache_dtype == torch.float8_e4m3fn:
        scales = dict(
            k_scale=torch.tensor([0.02], device=device), v_scale=torch.tensor([0.05], device=device)
        )
    k_cache, v_cache = _poisoned_caches(num_blocks, block_size, hkv, d, cache_dtype, device)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()

    q_out, k_out = impl.apply_rotary(
        q, k, positions, cache, **kwargs, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, **scales
    )
    q_two, k_two = impl.apply_rotary(q, k, positions, cache, **kwargs)
    store_ops.store_kvcache(k_two, v, want_k_cache, want_v_cache, slots, **scales)
    assert torch.equal(q_out, q_two) and torch.equal(k_out, k_two)
    assert torch.equal(_bits(k_cache), _bits(want_k_cache)), "k_cache differs from rotary-then-store"
    assert torch.equal(_bits(v_cache), _bits(want_v_cache)), "v_cache differs from rotary-then-store"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots.cpu()[slots.cpu() >= 0].long()] = True
    stored = ~torch.isnan(k_cache.float()).view(num_blocks * block_size, -1).cpu().any(-1)
    assert torch.equal(stored, written), "a slot was written that no token maps to, or one was missed"


@pytest.mark.parametrize(
    "cache_dtype, scales",
    [(torch.float16, ""), (torch.float8_e4m3fn, ""), (torch.float8_e4m3fn, "k"), (torch.float8_e4m3fn, "kv")],
    ids=["fp16", "fp8-no-scales", "fp8-k-scale-only", "fp8-scales"],
)
def test_apply_rotary_remembered_launch_takes_each_calls_tensors(device, monkeypatch, cache_dtype, scales):
    """A call of a layout seen before reuses its launch (value checks off, as on a GPU without
    TILELLM_DEBUG): new tensors of that layout give the twin's results and stores (an FP8 cache's
    missing scale read as 1.0); a call without the store and another layout each get their own
    launch."""
    from tilellm.kernels import validation

    monkeypatch.setattr(validation, "deep_checks_enabled", lambda t: False)
    monkeypatch.setattr(fused, "_ROTARY_REMEMBERED", {})
    t, hq, hkv, d = 5, 4, 2, 32
    cache = _cos_sin_cache(64, d).to(device)
    weights = dict(
        q_norm_weight=_randn(d, seed=52, device=device), k_norm_weight=_randn(d, seed=53, device=device)
    )
    for seed in (1, 2, 3):
        q, k, v = _qkv_views(t, hq, hkv, d, torch.float16, device, seed=60 + seed)
        positions = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(seed)).to(device)
        slots = torch.randperm(16, generator=torch.Generator().manual_seed(seed))[:t].to(device)
        caches = [_poisoned_caches(2, 8, hkv, d, cache_dtype, device) for _ in range(2)]
        store = dict(v=v, slot_mapping=slots)
        if "k" in scales:
            store["k_scale"] = torch.tensor([0.01 * seed], device=device)
        if "v" in scales:
            store["v_scale"] = torch.tensor([0.03 * seed], device=device)
        q_out, k_out = fused.apply_rotary(
            q, k, positions, cache, **weights, k_cache=caches[0][0], v_cache=caches[0][1], **store
        )
        q_ref, k_ref = ref.apply_rotary(
            q.contiguous(), k.contiguous(), positions, cache, **weights, k_cache=caches[1][0],
            v_cache=caches[1][1], **store,
        )  # fmt: skip
        _assert_close(q_out, q_ref, torch.float16)
        _assert_close(k_out, k_ref, torch.float16)
        for got, want in zip(caches[0], caches[1]):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, equal_nan=True)
        # the same q and k without the store: its own launch, nothing written
        q_plain, k_plain = fused.apply_rotary(q, k, positions, cache, **weights)
        assert torch.equal(q_plain, q_out) and torch.equal(k_plain, k_out)
    assert len(fused._ROTARY_REMEMBERED) == 2
    # another layout (contiguous q and k, more tokens): another launch, right results
    q, k = _randn(t + 2, hq, d, seed=70, device=device), _randn(t + 2, hkv, d, seed=71, device=device)
    positions = torch.arange(t + 2, device=device)
    q_out, k_out = fused.apply_rotary(q, k, positions, cache)
    q_ref, k_ref = ref.apply_rotary(q, k, positions, cache)
    _assert_close(q_out, q_ref, torch.float32)
    _assert_close(k_out, k_ref, torch.float32)
    assert len(fused._ROTARY_REMEMBERED) == 3


def test_apply_rotary_call_that_copied_an_input_is_not_remembered(device, monkeypatch):
    """positions with a stride (copied to a contiguous tensor for the kernel) or q with a
    non-unit last-dim stride: the call is right and its launch is not remembered, since the
    kernel ran on the copy's layout, not the argument's."""
    from tilellm.kernels import validation

    monkeypatch.setattr(validation, "deep_checks_enabled", lambda t: False)
    monkeypatch.setattr(fused, "_ROTARY_REMEMBERED", {})
    t, hq, hkv, d = 6, 4, 2, 16
    cache = _cos_sin_cache(64, d).to(device)
    q, k = _randn(t, hq, d, seed=80, device=device), _randn(t, hkv, d, seed=81, device=device)
    strided_positions = torch.arange(2 * t, device=device)[::2]
    strided_q = _randn(t, hq, 2 * d, seed=82, device=device)[..., ::2]
    for args in ((q, k, strided_positions), (strided_q, k, strided_positions[:t].contiguous())):
        for _ in range(2):
            got = fused.apply_rotary(*args, cache)
            want = ref.apply_rotary(args[0].contiguous(), args[1], args[2].contiguous(), cache)
            _assert_close(got[0], want[0], torch.float32)
            _assert_close(got[1], want[1], torch.float32)
    assert fused._ROTARY_REMEMBERED == {}


def test_apply_rotary_store_past_int32_offsets(device):
    """Slots whose element offset `slot * Hkv * D` exceeds 2^31 (a 4 GiB cache, only its top touched)."""
    t, hq, hkv, d, block_size = 6, 4, 2, 64, 16
    num_blocks = (1 << 31) // (block_size * hkv * d) + 16
    q, k, v = _qkv_views(t, hq, hkv, d, torch.float16, device, seed=41)
    positions = torch.arange(t, device=device)
    cache = _cos_sin_cache(16, d).to(device)
    top = num_blocks * block_size
    slots = torch.tensor([top - 1, top - 7, -1, top - 40, top - 2, top - 150], device=device)
    assert int(slots.max()) * hkv * d >= 2**31
    k_cache = torch.empty((num_blocks, block_size, hkv, d), dtype=torch.float16, device=device)
    v_cache = torch.empty_like(k_cache)
    tail = slice(num_blocks - 10, num_blocks)  # covers every slot used
    k_cache[tail] = float("nan")
    v_cache[tail] = float("nan")
    _, k_out = fused.apply_rotary(
        q, k, positions, cache, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots
    )
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k_out[i]) and torch.equal(flat_v[s], v[i]), f"token {i} (slot {s})"
    assert int(torch.isnan(k_cache[tail]).flatten(0, 1).all(-1).all(-1).sum()) == 10 * block_size - (t - 1)


def test_apply_rotary_store_twins_agree(device):
    """The Triton call's cache equals its PyTorch twin's (fp32, one rounding of the rotation apart)."""
    t, hq, hkv, d = 7, 4, 2, 32
    q, k, v = _qkv_views(t, hq, hkv, d, torch.float32, device, seed=31)
    positions = torch.arange(10, 10 + t, device=device)
    cache = _cos_sin_cache(64, d).to(device)
    slots = torch.tensor([3, 0, -1, 9, 15, 4, 12], device=device)
    caches = [_poisoned_caches(2, 8, hkv, d, torch.float32, device) for _ in range(2)]
    for impl, (kc, vc) in zip((fused, ref), caches):
        impl.apply_rotary(q, k, positions, cache, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    for got, want in zip(caches[0], caches[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(v=None), "v missing"),
        (dict(k_cache=None, v_cache=None), "k_cache, v_cache missing"),
        (dict(slot_mapping=torch.tensor([0, 1])), "slot_mapping has 2 entries"),
        (dict(slot_mapping=torch.tensor([0, 1, 99])), "out of range"),
        (dict(k_cache=torch.zeros(2, 4, 2, 16)), "k_cache"),
    ],
)
def test_apply_rotary_store_rejects_bad_input(impl, change, match):
    args = dict(
        v=torch.randn(3, 1, 16), k_cache=torch.zeros(2, 4, 1, 16), v_cache=torch.zeros(2, 4, 1, 16),
        slot_mapping=torch.tensor([0, 5, -1]),
    )  # fmt: skip
    args.update(change)
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    with pytest.raises(ValueError, match=match):
        impl.apply_rotary(q, k, torch.arange(3), torch.randn(10, 16), **args)


def test_apply_rotary_reference_matches_transformers():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    t, hq, hkv, d = 5, 4, 2, 16
    q, k = _randn(t, hq, d, seed=11), _randn(t, hkv, d, seed=12)
    positions = torch.tensor([0, 4, 2, 9, 30])
    cache = _cos_sin_cache(64, d)
    half = d // 2
    cos = torch.cat([cache[positions, :half]] * 2, dim=-1)  # HF's [T, D] layout
    sin = torch.cat([cache[positions, half:]] * 2, dim=-1)
    # HF takes [B, H, T, D] and cos/sin [B, T, D]
    q_hf, k_hf = llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    q_out, k_out = ref.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", [fused, ref], ids=["triton", "reference"])
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.randn(3, 2, 8, 1)), r"\[T, H, D\]"),
        (dict(k=torch.randn(4, 1, 8)), "does not match q"),
        (dict(k=torch.randn(3, 1, 8).half()), "share a dtype"),
        (dict(q=torch.randn(3, 2, 7), k=torch.randn(3, 1, 7), cache=torch.randn(10, 7)), "must be even"),
        (dict(cache=torch.randn(10, 6)), r"cos_sin_cache must be \[max_pos, D=8\]"),
        (dict(positions=torch.tensor([0, 1])), r"positions must be \[T=3\]"),
        (dict(positions=torch.tensor([0.0, 1.0, 2.0])), "int32 or int64"),
        (dict(positions=torch.tensor([0, 1, 10])), r"positions must lie in \[0, 10\)"),
        (dict(positions=torch.tensor([0, -1, 2])), "min -1"),
        (dict(q_norm_weight=torch.ones(8)), "both q_norm_weight and k_norm_weight"),
        (dict(q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(4)), r"k_norm_weight must be \[D=8\]"),
        (dict(q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8), eps=-1.0), "eps must be > 0"),
    ],
)
def test_apply_rotary_rejects_bad_input(impl, change, match):
    args = dict(
        q=torch.randn(3, 2, 8), k=torch.randn(3, 1, 8), positions=torch.arange(3), cache=torch.randn(10, 8)
    )
    args.update(change)
    q, k, positions, cache = (args.pop(n) for n in ("q", "k", "positions", "cache"))
    with pytest.raises(ValueError, match=match):
        impl.apply_rotary(q, k, positions, cache, **args)
