"""Block-scaled FP8 W8A8 GEMM: the PyTorch twins against fp64 arithmetic, the Triton kernels
against the twins, and the input checks.

The twins are checked on the values they stand for (x_q * x_s, w_q * scale_inv) with fp64 sums
and an explicit nearest-e4m3 bound; the kernels against the twins: quantization bit for bit,
the GEMM within fp32's accumulation-order error (and 1 bf16 ulp for bf16 outputs). The kernels'
outputs are allocated full of NaN (`poison_outputs`), so a tile they skip shows up. Inputs are
random normal times a per-row/per-column spread of magnitudes, so that every group and block
gets its own scale.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels.helpers import assert_close
from tilellm.kernels import fp8_gemm as tk
from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tilellm.kernels.reference import fp8_gemm as ref

GEMM_TOL_CPU = 1e-5  # fp32 accumulation order (interpreter vs torch), relative to the output scale
# Hopper's fp8 MMA accumulates one k-block with fewer bits than fp32 before the fp32 promotion
GEMM_TOL_CUDA = 2e-3


@pytest.fixture(autouse=True)
def _gemm_kernels_only(monkeypatch):
    """`TILELLM_GEMV=0`: one-row calls on a GPU run this file's GEMM, not `fp8_gemv.py`'s kernel
    (tested in test_fp8_gemv.py), whatever the environment says."""
    monkeypatch.setenv("TILELLM_GEMV", "0")


@pytest.fixture
def poison_outputs(monkeypatch):
    """Every output the kernels allocate starts as NaN (e4m3's NaN for x_q)."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device).to(dtype)

    monkeypatch.setattr(tk, "_empty", nan_empty)


def spread(shape, gen, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Random normal values, each row scaled by 2^U(-6, 6) and each column by 2^U(-3, 3)."""
    rows, cols = shape
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.empty(rows, 1).uniform_(-6, 6, generator=gen))
    x = x * torch.exp2(torch.empty(1, cols).uniform_(-3, 3, generator=gen))
    return x.to(device=device, dtype=dtype)


def make_gemm(M, N, K, block_size, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = spread((M, K), gen, device=device)
    w = spread((N, K), gen, device=device) / K**0.5
    a, a_s = ref.per_token_group_quant_fp8(x, block_size[1])
    b, b_s = ref.quantize_fp8_block(w, block_size)
    return a, b, a_s, b_s


def dequantized_product(a, b, a_s, b_s, block_size) -> torch.Tensor:
    """(a * a_s) @ (b * b_s)^T in fp64, from the expanded per-element scales."""
    bn, bk = block_size
    N = b.shape[0]
    a64 = a.double() * a_s.double().repeat_interleave(bk, dim=1)
    b64 = b.double() * b_s.double().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)
    return a64 @ b64.T


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The e4m3 grid spacing around |v| (fp64): 2^(e - 3) in binade e >= -6, 2^-9 below."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    return torch.exp2(e - 3)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (same-sign neighbours are 1 apart)."""

    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_gemm_close(got, expected, device, what):
    """fp32 outputs within the accumulation-order tolerance; half-precision ones within that or
    1 ulp (bf16) / 1 ulp-equivalent (fp16) of the twin's."""
    tol = GEMM_TOL_CUDA if device == "cuda" else GEMM_TOL_CPU
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    if got.dtype == torch.float32:
        assert_close(got, expected, tol, what)
        return
    g, e = got.float().cpu(), expected.float().cpu()
    assert torch.isfinite(g).all(), f"{what}: non-finite outputs (a tile never written?)"
    near = (g - e).abs() <= tol * max(float(e.abs().max()), 1.0)
    if got.dtype == torch.bfloat16:
        within_ulp = bf16_ulps(got.cpu(), expected.cpu()) <= 1
    else:
        within_ulp = (g - e).abs() <= e.abs() * 2.0**-10 + 2.0**-24
    bad = ~(near | within_ulp)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off by more than 1 ulp, first at {bad.nonzero()[0].tolist()}"
    )


# ----------------------------------------------------------------------------------------------
# Twins against fp64 arithmetic
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("M", "K", "group"), [(1, 128, 128), (5, 384, 128), (33, 96, 32), (4, 144, 48)])
def test_quant_twin_is_nearest_e4m3(M, K, group, dtype):
    x = spread((M, K), torch.Generator().manual_seed(M + K), dtype)
    x_q, x_s = ref.per_token_group_quant_fp8(x, group)
    assert x_q.dtype == FP8_DTYPE and x_q.shape == (M, K)
    assert x_s.dtype == torch.float32 and x_s.shape == (M, K // group)
    groups = x.double().view(M, K // group, group)
    expected_s = groups.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    torch.testing.assert_close(x_s.double(), expected_s, rtol=2**-23, atol=0)
    # x / s rounds to the nearest e4m3 value (half a grid step away at most); the amax to +-448
    v = groups / x_s.double()[..., None]
    q = x_q.double().view(M, K // group, group)
    assert ((v - q).abs() <= 0.5 * e4m3_step(v) * (1 + 1e-6)).all()
    assert torch.equal(q.abs().amax(-1), torch.full_like(expected_s, FP8_MAX))


def test_quant_twin_zero_and_tiny_groups():
    """An all-zero group keeps the eps scale and zeros; a group far below eps saturates to 0."""
    x = torch.zeros(2, 256)
    x[1, 128:] = 1e-14
    x_q, x_s = ref.per_token_group_quant_fp8(x, 128)
    assert torch.equal(x_s, torch.full((2, 2), torch.tensor(1e-10) / FP8_MAX))
    assert x_q.float().abs().max() < 1  # 1e-14 / (1e-10 / 448) = 0.0448: e4m3's 2^-9 steps keep it small


@pytest.mark.parametrize(
    ("M", "N", "K", "block_size"), [(5, 200, 384, [128, 128]), (33, 72, 96, [32, 32]), (7, 100, 96, [48, 32])]
)
def test_gemm_twin_matches_fp64(M, N, K, block_size):
    a, b, a_s, b_s = make_gemm(M, N, K, block_size, "cpu", seed=N)
    got = ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, block_size, torch.float32)
    assert_close(got, dequantized_product(a, b, a_s, b_s, block_size).float(), 1e-6, "twin vs fp64")
    assert ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, block_size).dtype == torch.bfloat16


def test_gemm_twin_approximates_unquantized_product():
    """The whole W8A8 path against the fp32 product it stands for: e4m3's 3 mantissa bits cost
    each operand ~3.6% rms, so about 4% of the product's norm; a misplaced scale costs far more."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn((16, 384), generator=gen), torch.randn((256, 384), generator=gen)
    a, a_s = ref.per_token_group_quant_fp8(x, 128)
    b, b_s = ref.quantize_fp8_block(w, [128, 128])
    got = ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128], torch.float32)
    expected = x @ w.T
    assert float((got - expected).norm() / expected.norm()) < 0.06


@pytest.mark.parametrize(
    ("N", "K", "block_size"), [(200, 300, [128, 128]), (64, 64, [32, 32]), (70, 33, [64, 16])]
)
def test_quantize_fp8_block_edge_blocks(N, K, block_size):
    bn, bk = block_size
    w = spread((N, K), torch.Generator().manual_seed(N + K))
    w[:bn, :bk] = 0  # an all-zero block
    w_q, scale_inv = ref.quantize_fp8_block(w, block_size)
    assert w_q.dtype == FP8_DTYPE and w_q.shape == (N, K)
    assert scale_inv.shape == (-(-N // bn), -(-K // bk)) and scale_inv.dtype == torch.float32
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].double()
            expected = max(float(block.abs().max()), 1e-12) / FP8_MAX
            assert float(scale_inv[i, j]) == pytest.approx(expected, rel=2**-23), (i, j)
    assert torch.equal(w_q[:bn, :bk].float(), torch.zeros(bn, bk))
    back = ref.dequantize_fp8_block(w_q, scale_inv, block_size, torch.float32)
    expanded = scale_inv.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    # within half an e4m3 step of each value (relative 2^-4 above 2^-6, absolute 2^-10 * scale below)
    assert ((back - w).abs() <= (w.abs() * 2.0**-4 + 2.0**-10 * expanded) * (1 + 1e-6)).all()
    assert ref.dequantize_fp8_block(w_q, scale_inv, block_size).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# Triton against the twins
# ----------------------------------------------------------------------------------------------


def assert_quant_equal(x, group, column_major=False):
    got_q, got_s = tk.per_token_group_quant_fp8(x, group, column_major_scales=column_major)
    want_q, want_s = ref.per_token_group_quant_fp8(x, group, column_major_scales=column_major)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), "x_q bytes differ"
    assert torch.equal(got_s, want_s), "x_s differs"
    assert got_s.stride() == want_s.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("M", "K", "group"), [(1, 256, 128), (5, 384, 128), (64, 64, 32), (130, 96, 48)])
def test_quant_bit_exact(M, K, group, dtype, device, poison_outputs):
    x = spread((M, K), torch.Generator().manual_seed(M * K), dtype, device)
    assert_quant_equal(x, group, column_major=M == 5)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    M=st.integers(1, 40),
    groups=st.integers(1, 3),
    group=st.sampled_from([16, 32, 128, 24]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    log_scale=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_quant_bit_exact_any_magnitude(M, groups, group, dtype, log_scale, seed, device, poison_outputs):
    """Magnitudes from 2^-30 (groups below eps: x_s = eps / 448, subnormal e4m3 values) to 2^30,
    an all-zero group, and a group of exact ties between neighbouring e4m3 values."""
    gen = torch.Generator().manual_seed(seed)
    x = spread((M, groups * group), gen) * 2.0**log_scale
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # finite in fp16
    x[0, :group] = 0
    if M > 1:
        # amax 56 makes x_s = 56 / 448 = 1/8 exactly, so x / x_s lands on midpoints of the e4m3 grid:
        # 2^e * (1 + (k + 1/2) / 8) between normals, (k + 1/2) * 2^-9 between subnormals
        e = torch.randint(-6, 8, (group,), generator=gen).double()
        k = torch.randint(0, 8, (group,), generator=gen).double()
        ties = torch.where(e > -6, torch.exp2(e) * (1 + (k + 0.5) / 8), (k + 0.5) * 2.0**-9)
        signs = torch.randint(0, 2, (group,), generator=gen).double() * 2 - 1
        x[1, :group] = (signs * ties / 8).float().clamp(-55, 55)
        x[1, 0] = 56.0
    assert_quant_equal(x.to(device=device, dtype=dtype), group)


def test_quant_strided_rows(device, poison_outputs):
    """x a column slice of a wider tensor (row stride != K)."""
    wide = spread((9, 512), torch.Generator().manual_seed(1), device=device)
    assert_quant_equal(wide[:, 128:384], 128)


# Output dtypes by M (the store's cast is the same code for every shape): decode in bf16 alone
OUT_DTYPES = {
    1: [torch.bfloat16],
    5: [torch.float32, torch.bfloat16],
    64: [torch.float32, torch.float16],
    130: [torch.float32, torch.bfloat16],
}


@pytest.mark.parametrize("M", list(OUT_DTYPES))
@pytest.mark.parametrize(
    ("N", "K", "block_size"),
    [(200, 384, [128, 128]), (72, 96, [32, 32]), (100, 64, [64, 32])],
    ids=["128x128", "32x32", "64x32"],
)
def test_gemm_matches_twin(M, N, K, block_size, device, poison_outputs):
    a, b, a_s, b_s = make_gemm(M, N, K, block_size, device, seed=M + N)
    for dtype in OUT_DTYPES[M]:
        got = tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, block_size, dtype)
        expected = ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, block_size, dtype)
        assert_gemm_close(got, expected, device, f"M={M} N={N} K={K} {block_size} {dtype}")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    M=st.integers(1, 40),
    N=st.integers(1, 80),
    k_blocks=st.integers(1, 3),
    block_size=st.sampled_from([[32, 32], [16, 32], [64, 32], [48, 32]]),
    seed=st.integers(0, 2**16),
)
def test_gemm_matches_twin_any_shape(M, N, k_blocks, block_size, seed, device, poison_outputs):
    K = k_blocks * block_size[1]
    a, b, a_s, b_s = make_gemm(M, N, K, block_size, device, seed=seed)
    got = tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, block_size, torch.float32)
    assert_gemm_close(
        got, ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, block_size, torch.float32), device, "any"
    )


def test_gemm_strided_operands_and_column_major_scales(device, poison_outputs):
    """a a column slice, a_s column-major (as `column_major_scales` writes it), b_s a slice."""
    a, b, a_s, b_s = make_gemm(37, 96, 128, [32, 32], device, seed=3)
    wide = torch.cat([a.view(torch.uint8)] * 2, dim=1).view(FP8_DTYPE)[:, 128:]
    a_s_cm = a_s.t().contiguous().t()
    b_s_wide = torch.cat([b_s, b_s], dim=1)[:, : b_s.shape[1]]
    got = tk.w8a8_block_fp8_matmul(wide, b, a_s_cm, b_s_wide, [32, 32], torch.float32)
    assert_gemm_close(
        got, ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [32, 32], torch.float32), device, "strided"
    )


def test_gemm_program_order_groups(device, poison_outputs):
    """Small tiles and GROUP_M = 2 over 5 row tiles: the last group of row tiles is partial."""
    a, b, a_s, b_s = make_gemm(70, 40, 64, [64, 32], device, seed=11)
    cfg = tk.Fp8GemmConfig(block_m=16, block_n=16, group_m=2, num_warps=4, num_stages=1)
    got = tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, [64, 32], torch.float32, config=cfg)
    assert_gemm_close(
        got, ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [64, 32], torch.float32), device, "groups"
    )


def test_quantize_then_gemm_matches_twin_pipeline(device, poison_outputs):
    """The layer's path: quantize the activations with the kernel, then the GEMM, at [128, 128]."""
    gen = torch.Generator().manual_seed(5)
    x = spread((5, 256), gen, torch.bfloat16, device)
    b, b_s = ref.quantize_fp8_block(spread((128, 256), gen, device=device), [128, 128])
    a, a_s = tk.per_token_group_quant_fp8(x, 128)
    got = tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128])
    a_r, a_s_r = ref.per_token_group_quant_fp8(x, 128)
    assert_gemm_close(got, ref.w8a8_block_fp8_matmul(a_r, b, a_s_r, b_s, [128, 128]), device, "pipeline")


@pytest.mark.parametrize("M", [3, 37])
@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_split_k_matches_twin(M, split_k, device, poison_outputs):
    """K's 4 k-blocks in runs of 2 + 2 (3 runs asked: no empty run) and 1 x 4 (5 asked, one per
    k-block given), over one row tile and three: each run's fp32 partials summed in order, the
    output rounded once."""
    a, b, a_s, b_s = make_gemm(M, 96, 128, [32, 32], device, seed=split_k + M)
    cfg = tk.Fp8GemmConfig(block_m=16, block_n=32, group_m=8, num_warps=4, num_stages=1, split_k=split_k)
    for dtype in (torch.float32, torch.bfloat16):
        got = tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, [32, 32], dtype, config=cfg)
        expected = ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [32, 32], dtype)
        assert_gemm_close(got, expected, device, f"split_k={split_k} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_linear_quantizes_in_the_gemm(dtype, split_k, device, poison_outputs):
    """`w8a8_block_fp8_linear(x, ...)` is `per_token_group_quant_fp8` then the GEMM, bit for bit
    in fp32 at the same tiles (the same x_q and x_s reach the same dots: one ulp of a scale
    would show), over two row tiles, with an all-zero group and one below eps; and the twin's
    pipeline within the GEMM tolerance."""
    gen = torch.Generator().manual_seed(7)
    x = spread((21, 256), gen, dtype, device)
    x[3, :128] = 0.0
    x[4, 128:] = 1e-12
    b, b_s = ref.quantize_fp8_block(spread((96, 256), gen, device=device), [32, 128])
    cfg = tk.Fp8GemmConfig(block_m=16, block_n=32, group_m=8, num_warps=4, num_stages=1, split_k=split_k)
    got = tk.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32, config=cfg)
    a, a_s = tk.per_token_group_quant_fp8(x, 128)
    want = tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, [32, 128], torch.float32, config=cfg)
    assert torch.equal(got, want)
    assert tk.w8a8_block_fp8_linear(x, b, b_s, [32, 128], config=cfg).dtype == dtype
    twin = ref.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32)
    assert_gemm_close(got, twin, device, f"{dtype} split_k={split_k}")


def test_linear_rejects_bad_input(device):
    b, b_s = ref.quantize_fp8_block(torch.randn(64, 128, device=device), [64, 64])
    with pytest.raises(ValueError, match="w8a8_block_fp8_linear: x must be"):
        tk.w8a8_block_fp8_linear(b, b, b_s, [64, 64])
    with pytest.raises(ValueError, match="a .M, K. and b .N, K. must share K"):
        tk.w8a8_block_fp8_linear(torch.randn(2, 64, device=device), b, b_s, [64, 64])


def test_empty_inputs(device):
    a, b, a_s, b_s = make_gemm(1, 64, 64, [32, 32], device)
    for fn in (tk.w8a8_block_fp8_matmul, ref.w8a8_block_fp8_matmul):
        assert fn(a[:0], b, a_s[:0], b_s, [32, 32]).shape == (0, 64)
    x = torch.randn(0, 128, device=device)
    for quant in (tk.per_token_group_quant_fp8, ref.per_token_group_quant_fp8):
        x_q, x_s = quant(x, 64)
        assert x_q.shape == (0, 128) and x_s.shape == (0, 2)


# ----------------------------------------------------------------------------------------------
# Tile configs
# ----------------------------------------------------------------------------------------------


def test_config_table(monkeypatch):
    monkeypatch.setattr(tk, "interpreting", lambda: False)
    monkeypatch.setattr(tk, "num_sms", lambda: 132)
    for M in (1, 16, 64, 256, 1024, 4096):
        for N in (1024, 4096, 6144, 24576):
            cfg = tk.block_fp8_config(M, N, [128, 128], 4096)
            assert 128 % cfg.block_n == 0 and cfg.block_n >= 32, (M, N, cfg)
            assert cfg.block_m in (16, 32, 64, 128) and (M > 64 or cfg.block_m <= max(16, M)), (M, N, cfg)
            assert cfg.split_k == 1 or M <= 16, (M, N, cfg)
    # decode: 128-column tiles, the k-blocks split until there are two programs per SM
    decode = tk.block_fp8_config(1, 4096, [128, 128], 12288)
    assert (decode.block_m, decode.block_n, decode.num_stages, decode.split_k) == (16, 128, 3, 8)
    assert tk.block_fp8_config(1, 24576, [128, 128], 4096).split_k == 2  # 192 tiles x 2 >= 264
    assert tk.block_fp8_config(1, 4096, [128, 128], 1024).split_k == 4  # runs of >= 2 of the 8 k-blocks
    assert tk.block_fp8_config(1, 4096, [128, 128]).split_k == 1  # K unknown: no split
    assert tk.block_fp8_config(1, 4096, [128, 128], 1280).split_k == 4  # 10 k-blocks: runs of 3, 3, 3, 1
    assert tk.block_fp8_config(1, 4096, [128, 128], 768).split_k == 2  # 6 k-blocks: runs of 3
    assert tk.block_fp8_config(17, 4096, [128, 128], 4096).block_n == 32  # 128 column tiles of 32
    large = tk.block_fp8_config(4096, 4096, [128, 128], 4096)
    assert (large.block_m, large.block_n, large.num_warps, large.num_stages) == (128, 128, 8, 4)
    assert tk.block_fp8_config(1, 4096, [48, 128]).block_n == 16  # the widest power of two dividing 48


# ----------------------------------------------------------------------------------------------
# torch's block-wise scaled_mm
# ----------------------------------------------------------------------------------------------


def test_scaled_mm_path(device):
    a, b, a_s, b_s = make_gemm(64, 256, 512, [128, 128], device)
    reason = tk.scaled_mm_block_unavailable(a.device, [128, 128], 256)
    if reason is not None:
        with pytest.raises(RuntimeError, match="scaled_mm_block_fp8: "):
            tk.scaled_mm_block_fp8(a, b, a_s, b_s, [128, 128])
        return
    got = tk.scaled_mm_block_fp8(a, b, a_s, b_s, [128, 128])
    expected = ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128], torch.float32)
    assert_close(got.float(), expected, 1e-2, "scaled_mm vs twin")


# ----------------------------------------------------------------------------------------------
# Input checks (shared by both sides)
# ----------------------------------------------------------------------------------------------


def _good():
    return make_gemm(4, 64, 64, [32, 32], "cpu")


BAD_GEMM = {
    "a must be torch.float8_e4m3fn": lambda a, b, a_s, b_s: (a.float(), b, a_s, b_s, [32, 32]),
    "b must be torch.float8_e4m3fn": lambda a, b, a_s, b_s: (a, b.to(torch.bfloat16), a_s, b_s, [32, 32]),
    "a must be 2-D": lambda a, b, a_s, b_s: (a[None], b, a_s, b_s, [32, 32]),
    "must share K": lambda a, b, a_s, b_s: (a, b[:, :32], a_s, b_s, [32, 32]),
    "multiple of the block size bk": lambda a, b, a_s, b_s: (a[:, :48], b[:, :48], a_s, b_s, [32, 32]),
    "a_s must be \\[M, K // bk\\]": lambda a, b, a_s, b_s: (a, b, a_s[:, :1], b_s, [32, 32]),
    "b_s must be \\[ceil\\(N / bn\\), K // bk\\]": lambda a, b, a_s, b_s: (a, b, a_s, b_s[:1], [32, 32]),
    "b_s must be torch.float32": lambda a, b, a_s, b_s: (a, b, a_s, b_s.double(), [32, 32]),
    "block_size must be \\[bn, bk\\]": lambda a, b, a_s, b_s: (a, b, a_s, b_s, [32]),
}


@pytest.mark.parametrize("message", list(BAD_GEMM))
@pytest.mark.parametrize("fn", [tk.w8a8_block_fp8_matmul, ref.w8a8_block_fp8_matmul], ids=["triton", "twin"])
def test_gemm_rejects_bad_input(fn, message):
    args = BAD_GEMM[message](*_good())
    with pytest.raises(ValueError, match=f"w8a8_block_fp8_matmul: .*{message}"):
        fn(*args)


def test_gemm_rejects_bad_output_dtype_and_triton_blocks():
    a, b, a_s, b_s = _good()
    for fn in (tk.w8a8_block_fp8_matmul, ref.w8a8_block_fp8_matmul):
        with pytest.raises(ValueError, match="output_dtype must be"):
            fn(a, b, a_s, b_s, [32, 32], torch.int32)
    # the twin takes any block size; the kernel needs bk a power of two >= 32, bn a multiple of 16
    a, b, a_s, b_s = make_gemm(3, 40, 48, [20, 24], "cpu")
    ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [20, 24])
    with pytest.raises(ValueError, match="bk = 24 must be a power of two >= 32"):
        tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, [20, 24])
    a, b, a_s, b_s = make_gemm(3, 40, 64, [20, 32], "cpu")
    with pytest.raises(ValueError, match="bn = 20 must be a multiple of 16"):
        tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, [20, 32])


@pytest.mark.parametrize(
    "fn", [tk.per_token_group_quant_fp8, ref.per_token_group_quant_fp8], ids=["triton", "twin"]
)
def test_quant_rejects_bad_input(fn):
    x = torch.randn(4, 256)
    with pytest.raises(
        ValueError, match="per_token_group_quant_fp8: K = x.shape\\[1\\] = 256 must be a multiple"
    ):
        fn(x, 96)
    with pytest.raises(ValueError, match="per_token_group_quant_fp8: x must be"):
        fn(x.to(torch.int32), 128)
    with pytest.raises(ValueError, match="per_token_group_quant_fp8: x must be 2-D"):
        fn(x[None], 128)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        fn(x, 0)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fn(x.t().contiguous().t(), 2)


def test_block_quant_rejects_bad_input():
    w = torch.randn(64, 64)
    with pytest.raises(ValueError, match="quantize_fp8_block: block_size"):
        ref.quantize_fp8_block(w, [0, 32])
    with pytest.raises(ValueError, match="quantize_fp8_block: w must be"):
        ref.quantize_fp8_block(w.to(FP8_DTYPE), [32, 32])
    w_q, s = ref.quantize_fp8_block(w, [32, 32])
    with pytest.raises(ValueError, match="dequantize_fp8_block: scale_inv must be \\[ceil"):
        ref.dequantize_fp8_block(w_q, s[:1], [32, 32], torch.float32)
    with pytest.raises(ValueError, match="dequantize_fp8_block: w_q must be"):
        ref.dequantize_fp8_block(w, s, [32, 32], torch.float32)


# ----------------------------------------------------------------------------------------------
# Static activation scales: one calibrated scale for the whole tensor
# ----------------------------------------------------------------------------------------------


def static_scale(x: torch.Tensor, headroom: float) -> torch.Tensor:
    """A [1] float32 scale amax |x| / 448 * headroom on x's device: below 1, every value past
    headroom * amax saturates."""
    return torch.tensor([float(x.abs().max()) / FP8_MAX * headroom], dtype=torch.float32, device=x.device)


def e4m3_ties(n: int, gen) -> torch.Tensor:
    """n midpoints between neighbouring e4m3 values (fp64, random signs), all below 448:
    2^e * (1 + (k + 1/2) / 8) between normals, (k + 1/2) * 2^-9 between subnormals."""
    e = torch.randint(-6, 8, (n,), generator=gen).double()
    k = torch.randint(0, 8, (n,), generator=gen).double()
    ties = torch.where(e > -6, torch.exp2(e) * (1 + (k + 0.5) / 8), (k + 0.5) * 2.0**-9)
    return ties * (torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_quant_twin_is_nearest_e4m3(dtype):
    """x_q = e4m3(x / s) for a static s a sixteenth of the calibrated one: the values within
    +-448 half an e4m3 step from x / s (fp64) at most, every one past it exactly +-448; the
    scale comes back as given, [1] float32."""
    x = spread((9, 160), torch.Generator().manual_seed(3), dtype)
    s = static_scale(x, 1 / 16)
    x_q, got_s = ref.scaled_fp8_quant(x, s)
    assert x_q.dtype == FP8_DTYPE and x_q.shape == (9, 160)
    assert got_s.dtype == torch.float32 and got_s.shape == (1,) and torch.equal(got_s, s)
    v, q = x.double() / s.double(), x_q.double()
    inside = v.abs() <= FP8_MAX
    assert inside.sum() > 100 and (v.abs() > 2 * FP8_MAX).sum() > 10, "no saturation to check"
    assert ((v - q).abs()[inside] <= 0.5 * e4m3_step(v[inside]) * (1 + 1e-6)).all()
    assert torch.equal(q[~inside], FP8_MAX * v[~inside].sign())


def test_scaled_quant_twin_rounds_ties_to_even():
    """x / s on midpoints of the e4m3 grid (s = 1/8: the quotients are exact) land half a step
    away, on the neighbour whose mantissa is even."""
    ties = e4m3_ties(512, torch.Generator().manual_seed(4))
    x_q, _ = ref.scaled_fp8_quant((ties / 8).float()[None], torch.tensor([0.125]))
    assert torch.equal((x_q.double()[0] - ties).abs(), 0.5 * e4m3_step(ties))
    assert not (x_q.view(torch.uint8) & 1).any(), "a tie rounded to an odd mantissa"


def test_linear_twin_static_scale_matches_fp64():
    """The twin's `w8a8_block_fp8_linear(..., input_scale=s)` is the product of e4m3(x / s) * s
    and the dequantized weight in fp64, s standing for every token-group's scale."""
    gen = torch.Generator().manual_seed(6)
    x = spread((7, 256), gen)
    s = static_scale(x, 1 / 4)
    b, b_s = ref.quantize_fp8_block(spread((72, 256), gen) / 16, [32, 128])
    got = ref.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32, input_scale=s)
    x_q, _ = ref.scaled_fp8_quant(x, s)
    expected = dequantized_product(x_q, b, s.expand(7, 2), b_s, [32, 128])
    assert_close(got, expected.float(), 1e-6, "static twin vs fp64")


def assert_scaled_quant_equal(x, scale):
    got_q, got_s = tk.scaled_fp8_quant(x, scale)
    want_q, want_s = ref.scaled_fp8_quant(x, scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), "x_q bytes differ"
    assert got_s.dtype == torch.float32 and got_s.shape == (1,)
    assert torch.equal(got_s, want_s), "scale differs"
    return got_q, got_s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("M", "K"), [(1, 128), (37, 96), (3, 1500)])
def test_scaled_quant_bit_exact(M, K, dtype, device, poison_outputs):
    """A static scale a sixteenth of the calibrated one, over one row tile and two (37 x 96:
    masked rows and columns) or two column tiles (K = 1500): the same bytes as the twin, and
    the values past 448 * s are exactly +-448."""
    x = spread((M, K), torch.Generator().manual_seed(M + K), dtype, device)
    s = static_scale(x, 1 / 16)
    x_q, got_s = assert_scaled_quant_equal(x, s)
    assert torch.equal(got_s, s)
    past = (x.double() / s.double()).abs() > FP8_MAX + 16  # beyond 448's half step, too
    assert past.any(), "no saturation to check"
    assert (x_q.float().abs()[past] == FP8_MAX).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_quant_ties_bit_exact(dtype, device, poison_outputs):
    """Midpoints of the e4m3 grid (s = 1/8), normal and subnormal, round as the twin rounds
    them: to the even neighbour."""
    ties = e4m3_ties(3 * 160, torch.Generator().manual_seed(5))
    x = (ties / 8).view(3, 160).to(device=device, dtype=dtype)
    assert torch.equal(x.double().cpu() * 8, ties.view(3, 160)), "ties not exact in this dtype"
    x_q, _ = assert_scaled_quant_equal(x, torch.tensor([0.125], device=device))
    assert not (x_q.view(torch.uint8) & 1).any()


def ties_under(s: torch.Tensor, n: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(x fp32, ties fp64): x whose fp32 quotient x / s is exactly an e4m3 midpoint (searched
    within 3 ulps of ties * s; the ties no x reaches are left out)."""
    ties = e4m3_ties(n, gen)
    x0 = (ties * s.double()).float()
    candidates, up, down = [x0], x0, x0
    for _ in range(3):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        candidates += [up, down]
    x, found = x0, torch.zeros(n, dtype=torch.bool)
    for c in reversed(candidates):  # the nearest candidate last: it wins
        on_tie = c / s == ties.float()
        x, found = torch.where(on_tie, c, x), found | on_tie
    return x[found], ties[found]


def test_scaled_quant_ties_under_any_scale(device, poison_outputs):
    """s = 1.7 (not a power of two) and x with x / s exactly on e4m3 midpoints: the twin rounds
    them to the even neighbour, half a step away, and the kernel to the same bytes. A product
    with 1 / s instead of the IEEE division misses some of the midpoints and rounds those the
    other way: the case tells them apart."""
    s = torch.tensor([1.7])
    x, ties = ties_under(s, 480, torch.Generator().manual_seed(6))
    assert len(ties) > 300 and (x * (1 / s) != ties.float()).sum() > 20
    x_q, _ = ref.scaled_fp8_quant(x[None], s)
    assert torch.equal((x_q.double()[0] - ties).abs(), 0.5 * e4m3_step(ties))
    assert not (x_q.view(torch.uint8) & 1).any(), "a tie rounded to an odd mantissa"
    assert_scaled_quant_equal(x[None].to(device), s.to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_quant_dynamic_scale(dtype, device, poison_outputs):
    """scale None: max(amax |x|, 1e-10) / 448, rounded once to fp32 (the fp64 quotient of two
    fp32 values, rounded to fp32, is the fp32 quotient), the same on both sides; the amax maps to
    +-448. An all-zero x keeps the eps scale and zeros."""
    x = spread((13, 192), torch.Generator().manual_seed(9), dtype, device)
    x_q, s = assert_scaled_quant_equal(x, None)
    expected = torch.tensor([float(x.abs().max()) / FP8_MAX], dtype=torch.float32)
    assert torch.equal(s.cpu(), expected)
    assert float(x_q.float().abs().max()) == FP8_MAX
    x_q, s = assert_scaled_quant_equal(torch.zeros_like(x), None)
    assert torch.equal(s.cpu(), torch.tensor([1e-10]) / FP8_MAX)
    assert not x_q.float().any()


def test_scaled_quant_strided_rows(device, poison_outputs):
    """x a column slice of a wider tensor (row stride != K), static and dynamic."""
    wide = spread((9, 512), torch.Generator().manual_seed(2), device=device)
    x = wide[:, 128:384]
    assert_scaled_quant_equal(x, static_scale(x, 1 / 8))
    assert_scaled_quant_equal(x, None)


def test_static_scale_empty_inputs(device):
    """No tokens with a static scale: empty x_q and the scale back; an empty GEMM output."""
    s = torch.tensor([0.5], device=device)
    x = torch.randn(0, 128, device=device)
    for quant in (tk.scaled_fp8_quant, ref.scaled_fp8_quant):
        x_q, got_s = quant(x, s)
        assert x_q.shape == (0, 128) and x_q.dtype == FP8_DTYPE and torch.equal(got_s, s)
    b, b_s = ref.quantize_fp8_block(torch.randn(64, 128, device=device), [32, 32])
    for linear in (tk.w8a8_block_fp8_linear, ref.w8a8_block_fp8_linear):
        assert linear(x, b, b_s, [32, 32], input_scale=s).shape == (0, 64)


@pytest.mark.parametrize("shape", [(0, 128), (3, 0)])
@pytest.mark.parametrize("quant", [tk.scaled_fp8_quant, ref.scaled_fp8_quant], ids=["triton", "twin"])
def test_scaled_quant_empty_dynamic(quant, shape, device):
    """No values and no scale: the eps scale, as an all-zero x gets."""
    x_q, s = quant(torch.randn(shape, device=device), None)
    assert x_q.shape == shape and torch.equal(s.cpu(), torch.tensor([1e-10]) / FP8_MAX)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_linear_static_scale_quantizes_in_the_gemm(dtype, split_k, device, poison_outputs):
    """`w8a8_block_fp8_linear(x, ..., input_scale=s)` is `scaled_fp8_quant(x, s)` then the GEMM
    with s broadcast, bit for bit in fp32 at the same tiles, over two row tiles; the twin's
    static pipeline within the GEMM tolerance; and with s an eighth of the calibrated scale
    (the large rows saturate) far from the dynamic result: the scale is used."""
    gen = torch.Generator().manual_seed(8)
    x = spread((21, 256), gen, dtype, device)
    s = static_scale(x, 1 / 8)
    # the weight scaled down: fp16 outputs stay finite
    b, b_s = ref.quantize_fp8_block(spread((96, 256), gen, device=device) / 64, [32, 128])
    cfg = tk.Fp8GemmConfig(block_m=16, block_n=32, group_m=8, num_warps=4, num_stages=1, split_k=split_k)
    got = tk.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32, input_scale=s, config=cfg)
    a, a_s = tk.scaled_fp8_quant(x, s)
    a_s = tk.broadcast_input_scale(a_s, 21, 2)
    assert a_s.shape == (21, 2) and a_s.stride() == (0, 0)
    want = tk.w8a8_block_fp8_matmul(a, b, a_s, b_s, [32, 128], torch.float32, config=cfg)
    assert torch.equal(got, want)
    twin = ref.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32, input_scale=s)
    assert_gemm_close(got, twin, device, f"static {dtype} split_k={split_k}")
    dynamic = tk.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32, config=cfg)
    diff = float((got - dynamic).abs().max())
    assert diff > 0.1 * float(dynamic.abs().max()), f"static and dynamic differ by {diff:.3g} only"
    assert tk.w8a8_block_fp8_linear(x, b, b_s, [32, 128], input_scale=s, config=cfg).dtype == dtype


ONE_FLOAT32 = "the input scale must be a float32 tensor of one element, "
BAD_INPUT_SCALE = {
    "float64": (lambda s: s.double(), ONE_FLOAT32 + r"got torch.float64 of shape \(1,\)"),
    "two_elements": (lambda s: s.repeat(2), ONE_FLOAT32 + r"got torch.float32 of shape \(2,\)"),
    "not_a_tensor": (lambda s: 0.5, ONE_FLOAT32 + "got float"),
    "other_device": (lambda s: s.to("meta"), "the input scale is on meta but x is on cpu"),
}
STATIC_ENTRY_POINTS = {
    "linear-triton": ("w8a8_block_fp8_linear", tk.w8a8_block_fp8_linear),
    "linear-twin": ("w8a8_block_fp8_linear", ref.w8a8_block_fp8_linear),
    "quant-triton": ("scaled_fp8_quant", tk.scaled_fp8_quant),
    "quant-twin": ("scaled_fp8_quant", ref.scaled_fp8_quant),
}


@pytest.mark.parametrize("case", list(BAD_INPUT_SCALE))
@pytest.mark.parametrize("entry", list(STATIC_ENTRY_POINTS))
def test_rejects_bad_input_scale(entry, case):
    """A static scale that is not one float32 element on x's device, named, on both sides."""
    name, fn = STATIC_ENTRY_POINTS[entry]
    bad, message = BAD_INPUT_SCALE[case]
    x, scale = torch.randn(4, 64), bad(torch.tensor([0.5]))
    with pytest.raises(ValueError, match=f"^{name}: {message}"):
        if name == "scaled_fp8_quant":
            fn(x, scale)
        else:
            b, b_s = ref.quantize_fp8_block(torch.randn(64, 64), [32, 32])
            fn(x, b, b_s, [32, 32], input_scale=scale)


@pytest.mark.parametrize("fn", [tk.scaled_fp8_quant, ref.scaled_fp8_quant], ids=["triton", "twin"])
def test_scaled_quant_rejects_bad_input(fn):
    x, s = torch.randn(4, 64), torch.tensor([0.5])
    with pytest.raises(ValueError, match="^scaled_fp8_quant: x must be 2-D"):
        fn(x[None], s)
    with pytest.raises(ValueError, match="^scaled_fp8_quant: x must be"):
        fn(x.to(torch.int32), s)
    with pytest.raises(ValueError, match="^scaled_fp8_quant: x must be"):
        fn(x.to(FP8_DTYPE), None)
    with pytest.raises(ValueError, match="^scaled_fp8_quant: x's last dim must be contiguous"):
        fn(x.t().contiguous().t(), s)
    for one in (s.reshape(()), s.reshape(1, 1)):  # one element of any shape: it comes back as [1]
        assert fn(x, one)[1].shape == (1,)


# ----------------------------------------------------------------------------------------------
# One scale per tensor or per output row: torch._scaled_mm
# ----------------------------------------------------------------------------------------------


def per_tensor_gemm(M, N, K, device, seed=0):
    """x quantized by one scale, w by one scale per row (as a per-tensor checkpoint's shards):
    (a [M, K], b [N, K], scale_a [1], row scales [N])."""
    gen = torch.Generator().manual_seed(seed)
    x = spread((M, K), gen, device=device)
    w = spread((N, K), gen, device=device) / K**0.5
    a, scale_a = ref.scaled_fp8_quant(x)
    w_rows = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [N]
    b = (w / w_rows[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return a, b, scale_a, w_rows.float()


@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "row"])
@pytest.mark.parametrize("fold", [False, True], ids=["scale_a", "folded"])
def test_scaled_mm_twin_matches_fp64(per_row, fold):
    """C = (a * s_a) @ (b * s_b[n])^T in fp64, s_b one number or one per row; s_a given or already
    folded into s_b (None)."""
    a, b, s_a, rows = per_tensor_gemm(7, 48, 96, "cpu")
    s_b = rows if per_row else rows[:1]
    got = (
        ref.scaled_mm_fp8(a, b, None, s_a * s_b, torch.float32)
        if fold
        else ref.scaled_mm_fp8(a, b, s_a, s_b, torch.float32)
    )
    expected = (a.double() * s_a.double()) @ (b.double() * s_b.double().reshape(-1, 1)).T
    assert_close(got, expected.float(), 1e-6, "scaled_mm twin vs fp64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "row"])
@pytest.mark.parametrize("M", [1, 5, 40])
def test_scaled_mm_matches_twin(M, per_row, dtype, device):
    """`scaled_mm_fp8` (torch._scaled_mm: cuBLASLt / CUTLASS on the GPU, torch's own on the CPU)
    against the twin, at row counts that are not multiples of 16; where torch cannot run the case
    (`scaled_mm_fp8_unavailable`), it raises a RuntimeError naming why."""
    a, b, s_a, rows = per_tensor_gemm(M, 64, 256, device, seed=M)
    s_b = (s_a * rows) if per_row else rows[:1]
    scale_a = None if per_row else s_a  # the layers' forms: row-wise with scale_a folded in
    reason = tk.scaled_mm_fp8_unavailable(a.device, dtype, 64, 256, per_row=per_row)
    if reason is not None:
        with pytest.raises(RuntimeError, match=f"^scaled_mm_fp8: {reason}"):
            tk.scaled_mm_fp8(a, b, scale_a, s_b, dtype)
        return
    got = tk.scaled_mm_fp8(a, b, scale_a, s_b, dtype)
    assert_gemm_close(got, ref.scaled_mm_fp8(a, b, scale_a, s_b, dtype), device, f"{dtype} M={M}")


def test_scaled_mm_row_scales_any_row_count(device):
    """Row-wise calls of growing and shrinking row counts (the unit row scales behind a folded
    scale_a are sliced from one buffer that grows), and a scale_a given to a row-wise call."""
    dtype = torch.bfloat16
    if tk.scaled_mm_fp8_unavailable(device, dtype, 32, 64, per_row=True) is not None:
        pytest.skip("no row-wise scaled_mm here")
    for M in (3, 2500, 17, 2500, 1):
        a, b, s_a, rows = per_tensor_gemm(M, 32, 64, device, seed=M)
        got = tk.scaled_mm_fp8(a, b, None, s_a * rows, dtype)
        assert_gemm_close(got, ref.scaled_mm_fp8(a, b, None, s_a * rows, dtype), device, f"M={M}")
        got = tk.scaled_mm_fp8(a, b, s_a, rows, dtype)
        assert_gemm_close(got, ref.scaled_mm_fp8(a, b, s_a, rows, dtype), device, f"M={M}, scale_a")


def test_scaled_mm_is_the_block_gemm_of_uniform_scales(device):
    """With a per-tensor weight held as block scales (every block of a row band alike) and a
    static input scale broadcast, the block GEMM's twin and `scaled_mm_fp8` on the folded scales
    compute the same product (one factor outside the sum instead of one per k-block)."""
    a, b, s_a, rows = per_tensor_gemm(24, 64, 256, "cpu")
    rows = rows.reshape(2, 32)[:, :1].expand(2, 32).reshape(64).contiguous()  # two 32-row shards
    b_s = rows.reshape(2, 32)[:, :1].expand(2, 2).contiguous()  # [N / 32, K / 128]
    block = ref.w8a8_block_fp8_matmul(
        a, b, tk.broadcast_input_scale(s_a, 24, 2), b_s, [32, 128], torch.float32
    )
    assert_close(ref.scaled_mm_fp8(a, b, None, s_a * rows, torch.float32), block, 1e-6, "twin")
    a, b, s_a, rows = (t.to(device) for t in (a, b, s_a, rows))
    if tk.scaled_mm_fp8_unavailable(device, torch.bfloat16, 64, 256, per_row=True) is None:
        got = tk.scaled_mm_fp8(a, b, None, s_a * rows, torch.bfloat16)
        assert_gemm_close(got, block.to(device, torch.bfloat16), device, "scaled_mm vs block twin")


def test_scaled_mm_empty_and_unavailable():
    a, b, s_a, rows = per_tensor_gemm(4, 48, 64, "cpu")
    empty = tk.scaled_mm_fp8(a[:0], b, s_a, rows[:1], torch.bfloat16)
    assert empty.shape == (0, 48) and empty.dtype == torch.bfloat16
    assert ref.scaled_mm_fp8(a[:0], b, s_a, rows[:1]).shape == (0, 48)
    assert tk.scaled_mm_fp8_unavailable("cpu", torch.float16, 48, 64, per_row=True) is None
    reason = tk.scaled_mm_fp8_unavailable("cpu", torch.bfloat16, 40, 64, per_row=False)
    assert reason == "scaled_mm needs N and K multiples of 16, got N = 40, K = 64"
    with pytest.raises(RuntimeError, match="^scaled_mm_fp8: scaled_mm needs N and K multiples of 16"):
        tk.scaled_mm_fp8(a, b[:40], s_a, rows[:1])
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        reason = tk.scaled_mm_fp8_unavailable("cuda", torch.float16, 48, 64, per_row=True)
        assert reason is not None  # row-wise: bfloat16 output only
        assert (tk.scaled_mm_fp8_unavailable("cuda", torch.float16, 48, 64, per_row=False) is None) == (
            (major, minor) >= (8, 9)
        )


BAD_SCALED_MM = {
    "a must be torch.float8_e4m3fn": lambda a, b, s_a, s_b: (a.float(), b, s_a, s_b),
    "b must be 2-D": lambda a, b, s_a, s_b: (a, b[None], s_a, s_b),
    r"a \[M, K\] and b \[N, K\] must share K": lambda a, b, s_a, s_b: (a, b[:, :32], s_a, s_b),
    "b's last dim must be contiguous": lambda a, b, s_a, s_b: (a, b.t().contiguous().t(), s_a, s_b),
    r"scale_b must be float32 of 1 or N = 48 elements, got torch.float32 of shape \(2,\)": (
        lambda a, b, s_a, s_b: (a, b, s_a, s_b.repeat(2))
    ),
    r"scale_b must be float32 of 1 or N = 48 elements, got torch.float64": (
        lambda a, b, s_a, s_b: (a, b, s_a, s_b.double())
    ),
    "the input scale must be a float32 tensor of one element": lambda a, b, s_a, s_b: (
        a,
        b,
        s_a.repeat(2),
        s_b,
    ),
    "a, b and scale_b must be on one device": lambda a, b, s_a, s_b: (a, b, s_a, s_b.to("meta")),
}


@pytest.mark.parametrize("message", list(BAD_SCALED_MM))
@pytest.mark.parametrize("fn", [tk.scaled_mm_fp8, ref.scaled_mm_fp8], ids=["torch", "twin"])
def test_scaled_mm_rejects_bad_input(fn, message):
    a, b, s_a, rows = per_tensor_gemm(4, 48, 64, "cpu")
    with pytest.raises(ValueError, match=f"^scaled_mm_fp8: {message}"):
        fn(*BAD_SCALED_MM[message](a, b, s_a, rows[:1]))
    with pytest.raises(ValueError, match="^scaled_mm_fp8: output_dtype must be"):
        fn(a, b, s_a, rows[:1], torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_scaled_mm_row_scales_never_grow_inside_a_capture():
    """A row-wise call of more rows than any before allocates its unit row scales: inside a CUDA
    graph capture it says to run the call once first; after that it captures and replays."""
    if tk.scaled_mm_fp8_unavailable("cuda", torch.bfloat16, 32, 64, per_row=True) is not None:
        pytest.skip("no row-wise scaled_mm here")
    M = 1 << 20  # more rows than any other test's
    a, b, s_a, rows = per_tensor_gemm(M, 32, 64, "cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture; run the same call once before"):
        with torch.cuda.graph(graph):
            tk.scaled_mm_fp8(a, b, None, s_a * rows, torch.bfloat16)
    expected = tk.scaled_mm_fp8(a, b, None, s_a * rows, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.scaled_mm_fp8(a, b, None, s_a * rows, torch.bfloat16)
    graph.replay()
    assert torch.equal(out, expected)
