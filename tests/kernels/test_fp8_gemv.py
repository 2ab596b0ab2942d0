"""`fp8_gemv.py`'s kernel, reached through `fp8_gemm.w8a8_block_fp8_linear` with `TILELLM_GEMV=1`:
against the PyTorch twin (the same x_q and x_s, the exact e4m3 products summed in fp32 in another
order: within fp32's accumulation error on the CPU and the GPU alike, since neither side runs the
tensor cores), with dynamic and static activation scales, the loop over long rows, and when the
switch sends a call there.

Outputs start as NaN (`poison_outputs`), so a column or row the kernel skips shows up.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_fp8_gemm import bf16_ulps, poison_outputs, spread  # noqa: F401 (a fixture)
from tilellm.kernels import fp8_gemm as tk
from tilellm.kernels import fp8_gemv
from tilellm.kernels.reference import fp8_gemm as ref

# the e4m3 products are exact in fp32; only the order of the fp32 sums differs from the twin's
SUM_ORDER_TOL = 1e-5


@pytest.fixture
def gemv_calls(monkeypatch):
    """`TILELLM_GEMV=1`, and the shapes (x, weight) of the calls that reached the kernel's launch."""
    monkeypatch.setenv("TILELLM_GEMV", "1")
    calls = []
    real = tk.launch_fp8_gemv

    def spy(x, weight, *args, **kwargs):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(tk, "launch_fp8_gemv", spy)
    return calls


def _operands(M, N, K, block_size, dtype, device, seed=0):
    """x [M, K] in `dtype` with an all-zero group (row 0) and one below eps (the last row) where
    they leave other values in the row, and the weight quantized in [bn, bk] blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = spread((M, K), gen, dtype, device)
    bk = block_size[1]
    if K >= 2 * bk:
        x[0, :bk] = 0.0
        if M > 1:
            x[-1, bk : 2 * bk] = 1e-12
    b, b_s = ref.quantize_fp8_block(spread((N, K), gen, device=device) / K**0.5, block_size)
    return x, b, b_s


def _assert_twin(got, want, what):
    """Each row within SUM_ORDER_TOL of that row's largest output (the rows' scales span 2^12);
    16-bit outputs: that, or one ulp of the twin's."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.isfinite(want).all() and (want.abs().amax(dim=1) > 0).all(), f"{what}: a degenerate case"
    g, e = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(g).all(), f"{what}: non-finite outputs (a tile never written?)"
    near = (g - e).abs() <= SUM_ORDER_TOL * e.abs().amax(dim=1, keepdim=True)
    if got.dtype == torch.float32:
        assert near.all(), (
            f"{what}: {int((~near).sum())} elements off, worst row {int((~near).sum(1).argmax())}"
        )
        return
    if got.dtype == torch.bfloat16:
        within_ulp = bf16_ulps(got.cpu(), want.cpu()) <= 1
    else:
        within_ulp = (g - e).abs() <= e.abs() * 2.0**-10 + 2.0**-24
    assert (near | within_ulp).all(), f"{what}: {int((~(near | within_ulp)).sum())} elements off"


def test_tiles():
    """M padded to a power of two; the row's groups padded to a power of two, at most MAX_BLOCK_K
    channels a chunk; 1 to MAX_BLOCK_N weight rows of at most TILE_ELEMENTS."""
    assert fp8_gemv.fp8_gemv_tile(1, 1024, 128) == (1, 8, 8, 1)
    assert fp8_gemv.fp8_gemv_tile(3, 3072, 128) == (4, 8, 32, 1)
    assert fp8_gemv.fp8_gemv_tile(8, 12288, 128) == (8, 2, 128, 1)
    assert fp8_gemv.fp8_gemv_tile(1, 18432, 128) == (1, 2, 128, 2)
    assert fp8_gemv.fp8_gemv_tile(1, 40960, 128) == (1, 2, 128, 3)
    assert fp8_gemv.fp8_gemv_tile(5, 64, 64) == (8, 8, 1, 1)


# (M, N, K, [bn, bk]): a partial last block of rows, N not a multiple of the tile, groups not a
# power of two, blocks narrower than the tile and wider
CASES = [
    (1, 96, 256, [32, 128]),
    (3, 200, 384, [128, 128]),
    (8, 37, 192, [16, 64]),
    (2, 5, 128, [128, 128]),
]


@pytest.mark.parametrize("M, N, K, block_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("poison_outputs")
def test_matches_twin(M, N, K, block_size, dtype, device, gemv_calls):
    """Dynamic per-token-group scales, fp32 and x's-dtype outputs, each against the twin."""
    x, b, b_s = _operands(M, N, K, block_size, dtype, device, seed=M + N)
    for out_dtype in (torch.float32, dtype):
        got = tk.w8a8_block_fp8_linear(x, b, b_s, block_size, out_dtype)
        _assert_twin(got, ref.w8a8_block_fp8_linear(x, b, b_s, block_size, out_dtype), f"{out_dtype}")
    assert gemv_calls == [((M, K), (N, K))] * 2


@pytest.mark.parametrize("M, N, K, block_size", CASES)
@pytest.mark.parametrize("column_major_scales", [False, True])
@pytest.mark.usefixtures("poison_outputs")
def test_quantized_input_matches_twin(M, N, K, block_size, column_major_scales, device, gemv_calls):
    """`w8a8_block_fp8_matmul` on x_q and its scales (row- or column-major), as the op before a
    layer hands them over: the kernel loads them, and the result is the twin's."""
    x, b, b_s = _operands(M, N, K, block_size, torch.float32, device, seed=M + N)
    x_q, x_s = tk.per_token_group_quant_fp8(x, block_size[1], column_major_scales=column_major_scales)
    got = tk.w8a8_block_fp8_matmul(x_q, b, x_s, b_s, block_size, torch.float32)
    _assert_twin(got, ref.w8a8_block_fp8_matmul(x_q, b, x_s, b_s, block_size, torch.float32), "x_q")
    assert gemv_calls == [((M, K), (N, K))]


def test_one_row_quantizes_in_the_kernel_more_rows_before_it(device, monkeypatch):
    """`fp8_gemv_quantizes_x`: one or two rows against a tile of 8 weight rows quantize in the
    programs (bf16 x reaches the launch); more rows, or fewer weight rows a program, are quantized
    first (the launch gets e4m3 x and its scales), dynamic and static alike, with the twin's
    result."""
    assert fp8_gemv.fp8_gemv_quantizes_x(1, 1024, 128) and fp8_gemv.fp8_gemv_quantizes_x(2, 1024, 128)
    assert not fp8_gemv.fp8_gemv_quantizes_x(3, 1024, 128)
    assert not fp8_gemv.fp8_gemv_quantizes_x(1, 12288, 128)  # two weight rows a program
    monkeypatch.setenv("TILELLM_GEMV", "1")
    seen = []
    real = tk.launch_fp8_gemv

    def spy(x, weight, *args, x_s=None, **kwargs):
        seen.append((x.shape[0], x.dtype, x_s is not None))
        return real(x, weight, *args, x_s=x_s, **kwargs)

    monkeypatch.setattr(tk, "launch_fp8_gemv", spy)
    for M in (1, 3):
        x, b, b_s = _operands(M, 24, 256, [32, 128], torch.bfloat16, device, seed=M)
        s = (x.float().abs().amax() / 448 / 2).reshape(1)
        for scale in (None, s):
            got = tk.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32, input_scale=scale)
            want = ref.w8a8_block_fp8_linear(x, b, b_s, [32, 128], torch.float32, input_scale=scale)
            _assert_twin(got, want, f"M={M} static={scale is not None}")
    fp8 = torch.float8_e4m3fn
    assert seen == [(1, torch.bfloat16, False)] * 2 + [(3, fp8, True)] * 2


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.usefixtures("poison_outputs")
def test_static_scale_matches_twin(M, device, gemv_calls):
    """A static input scale (one element, small enough that some values saturate at 448)."""
    x, b, b_s = _operands(M, 72, 256, [64, 128], torch.float16, device, seed=3)
    s = (x.float().abs().amax() / 448 / 4).reshape(1)
    got = tk.w8a8_block_fp8_linear(x, b, b_s, [64, 128], torch.float32, input_scale=s)
    _assert_twin(got, ref.w8a8_block_fp8_linear(x, b, b_s, [64, 128], torch.float32, input_scale=s), "static")
    assert len(gemv_calls) == 1


@pytest.mark.usefixtures("poison_outputs")
def test_long_rows_loop(device, gemv_calls, monkeypatch):
    """Rows of more groups than a chunk holds (MAX_BLOCK_K lowered to two 64-wide groups): five
    groups in three chunks, the last half empty, at one row and at three."""
    monkeypatch.setattr(fp8_gemv, "MAX_BLOCK_K", 128)
    assert fp8_gemv.fp8_gemv_tile(3, 320, 64)[2:] == (2, 3)
    for M in (1, 3):
        x, b, b_s = _operands(M, 40, 320, [32, 64], torch.float32, device, seed=M)
        got = tk.w8a8_block_fp8_linear(x, b, b_s, [32, 64])
        _assert_twin(got, ref.w8a8_block_fp8_linear(x, b, b_s, [32, 64]), f"M={M}")
        s = (x.abs().amax() / 448).reshape(1)
        got = tk.w8a8_block_fp8_linear(x, b, b_s, [32, 64], input_scale=s)
        _assert_twin(got, ref.w8a8_block_fp8_linear(x, b, b_s, [32, 64], input_scale=s), f"static M={M}")
    assert len(gemv_calls) == 4


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("static", [False, True])
def test_gated_long_rows_and_a_row_strided_normed_input(static, device, monkeypatch):
    """SiLU-and-mul over rows longer than a chunk (MAX_BLOCK_K lowered: five 64-wide groups in
    three chunks), against the twin then `silu_and_mul`; and the norm (with the residual) on x a
    column slice of a wider tensor, as DeepSeek's q latent reaches q_b_proj, against `rms_norm`
    then the twin."""
    from tilellm.kernels.fused import rms_norm, silu_and_mul

    monkeypatch.setattr(fp8_gemv, "MAX_BLOCK_K", 128)
    x, b, b_s = _operands(5, 2 * 24, 320, [32, 64], torch.float32, device, seed=11)
    s = (x.abs().amax() / 448).reshape(1) if static else None
    got = fp8_gemv.fp8_gemv_linear(x, b, b_s, [32, 64], input_scale=s, silu_and_mul=True)
    want = silu_and_mul(ref.w8a8_block_fp8_linear(x, b, b_s, [32, 64], input_scale=s))
    _assert_twin(got, want, "gated, three chunks")
    monkeypatch.undo()
    wide, b, b_s = _operands(3, 40, 384, [32, 128], torch.float32, device, seed=12)
    x = wide[:, 128:]  # [3, 256], row stride 384
    gen = torch.Generator().manual_seed(13)
    r = torch.randn(3, 256, generator=gen).to(device)
    nw = (torch.rand(256, generator=gen) + 0.5).to(device)
    b, b_s = b[:, :256].contiguous(), b_s[:, :2].contiguous()
    s = torch.full((1,), 0.02, device=device) if static else None
    y, h = fp8_gemv.fp8_gemv_linear(x, b, b_s, [32, 128], input_scale=s, norm_weight=nw, residual=r)
    normed, want_h = rms_norm(x, nw, 1e-6, residual=r)
    assert torch.equal(h, want_h)
    _assert_twin(y, ref.w8a8_block_fp8_linear(normed, b, b_s, [32, 128], input_scale=s), "strided x, norm")


def test_switch(device, gemv_calls, monkeypatch):
    """The kernel runs for 1 to GEMV_MAX_ROWS rows with `TILELLM_GEMV=1` and no explicit config;
    more rows, a config, or the switch off run `fp8_gemm.py`'s GEMM. Unset, one row on a CUDA
    device, none on the CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fp8_gemv.fp8_gemv_runs(8, 128, cpu) and not fp8_gemv.fp8_gemv_runs(8, 96, cpu)
    monkeypatch.delenv("TILELLM_GEMV")
    assert fp8_gemv.fp8_gemv_runs(1, 128, cuda) and not fp8_gemv.fp8_gemv_runs(2, 128, cuda)
    assert not fp8_gemv.fp8_gemv_runs(1, 128, cpu)
    monkeypatch.setenv("TILELLM_GEMV", "1")
    x, b, b_s = _operands(fp8_gemv.GEMV_MAX_ROWS + 1, 64, 128, [64, 128], torch.float32, device)
    tk.w8a8_block_fp8_linear(x, b, b_s, [64, 128])
    cfg = tk.Fp8GemmConfig(block_m=16, block_n=32, group_m=8, num_warps=4, num_stages=1)
    tk.w8a8_block_fp8_linear(x[:1], b, b_s, [64, 128], config=cfg)
    assert gemv_calls == []
    monkeypatch.setenv("TILELLM_GEMV", "0")
    tk.w8a8_block_fp8_linear(x[:1], b, b_s, [64, 128])
    assert gemv_calls == []
    monkeypatch.setenv("TILELLM_GEMV", "1")
    tk.w8a8_block_fp8_linear(x[:1], b, b_s, [64, 128])
    assert gemv_calls == [((1, 128), (64, 128))]


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("static", [False, True])
def test_norm_and_activation_launches_give_the_separate_launches_bits(M, static, device, gemv_calls):
    """`fp8_gemv_linear` with the RMSNorm (and the residual) before it and SiLU-and-mul after it:
    the bits of `fused.rms_norm`, then the plain launch, then `fused.silu_and_mul`; the new
    residual stream is `rms_norm`'s bit for bit."""
    from tilellm.kernels.fused import rms_norm, silu_and_mul

    x, b, b_s = _operands(M, 2 * 40, 256, [32, 128], torch.bfloat16, device, seed=M)
    gen = torch.Generator().manual_seed(5)
    r = torch.randn(M, 256, generator=gen).to(device=device, dtype=torch.bfloat16)
    nw = (torch.rand(256, generator=gen) + 0.5).to(device=device, dtype=torch.bfloat16)
    s = torch.full((1,), 0.01, device=device) if static else None
    linear = fp8_gemv.fp8_gemv_linear
    for gated in (False, True):
        plain = linear(x, b, b_s, [32, 128], input_scale=s)
        assert torch.equal(plain, tk.w8a8_block_fp8_linear(x, b, b_s, [32, 128], input_scale=s))
        want = silu_and_mul(plain) if gated else plain
        assert torch.equal(linear(x, b, b_s, [32, 128], input_scale=s, silu_and_mul=gated), want)
        y, h = linear(x, b, b_s, [32, 128], input_scale=s, silu_and_mul=gated, norm_weight=nw, residual=r)
        normed, want_h = rms_norm(x, nw, 1e-6, residual=r)
        assert torch.equal(h, want_h)
        plain = linear(normed, b, b_s, [32, 128], input_scale=s)
        assert torch.equal(y, silu_and_mul(plain) if gated else plain), f"gated={gated}"
        y = linear(x, b, b_s, [32, 128], input_scale=s, silu_and_mul=gated, norm_weight=nw)
        plain = linear(rms_norm(x, nw, 1e-6), b, b_s, [32, 128], input_scale=s)
        assert torch.equal(y, silu_and_mul(plain) if gated else plain), f"no residual, gated={gated}"
    assert len(gemv_calls) == 2  # (the spy sees `w8a8_block_fp8_linear`'s launches only)


def test_linear_rejects_bad_input(device):
    x, b, b_s = _operands(2, 64, 256, [64, 128], torch.float32, device)
    linear = fp8_gemv.fp8_gemv_linear
    with pytest.raises(ValueError, match="takes 1 to 8 rows"):
        linear(torch.zeros(9, 256, device=device), b, b_s, [64, 128])
    with pytest.raises(ValueError, match="an even count"):
        linear(x, b[:63], b_s, [64, 128], silu_and_mul=True)
    with pytest.raises(ValueError, match="norm_weight must be"):
        linear(x, b, b_s, [64, 128], norm_weight=torch.ones(128, device=device))
    with pytest.raises(ValueError, match="residual must be .M, K. = .2, 256."):
        linear(x, b, b_s, [64, 128], norm_weight=torch.ones(256, device=device), residual=x[:1])
    with pytest.raises(ValueError, match="pass norm_weight"):
        linear(x, b, b_s, [64, 128], residual=x)
    with pytest.raises(ValueError, match="pass the residual"):
        linear(x, b, b_s, [64, 128], norm_weight=torch.ones(256, device=device), residual_out=x)
    with pytest.raises(ValueError, match="residual must be .* in torch.float32 .* got .* in torch.float16"):
        linear(x, b, b_s, [64, 128], norm_weight=torch.ones(256, device=device), residual=x.half())
    with pytest.raises(ValueError, match="eps must be a positive number"):
        linear(x, b, b_s, [64, 128], eps=0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_gemv, "MAX_BLOCK_K", 128)
        with pytest.raises(ValueError, match="fits one chunk of 128 channels, got K = 256"):
            linear(x, b, b_s, [64, 128], norm_weight=torch.ones(256, device=device))


QWEN3_LAYERS = {  # (N, K) per layer: Qwen3-0.6B and Qwen3-8B
    "0.6b qkv": (4096, 1024),
    "0.6b down": (1024, 3072),
    "8b gate_up": (24576, 4096),
    "8b down": (4096, 12288),
}


@pytest.mark.gpu
@pytest.mark.parametrize("layer", sorted(QWEN3_LAYERS))
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.usefixtures("poison_outputs")
def test_qwen3_shapes_on_gpu(layer, M, gemv_calls):
    """Qwen3's layer shapes in bf16, 128 x 128 blocks, against the twin."""
    N, K = QWEN3_LAYERS[layer]
    x, b, b_s = _operands(M, N, K, [128, 128], torch.bfloat16, "cuda", seed=M)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = tk.w8a8_block_fp8_linear(x, b, b_s, [128, 128], out_dtype)
        _assert_twin(got, ref.w8a8_block_fp8_linear(x, b, b_s, [128, 128], out_dtype), f"{layer} M={M}")
    assert len(gemv_calls) == 2


@pytest.mark.gpu
def test_cuda_graph_replays_new_inputs(gemv_calls):
    """Captured in a CUDA graph, a replay on new x gives the eager result."""
    x, b, b_s = _operands(2, 1024, 1024, [128, 128], torch.bfloat16, "cuda")
    tk.w8a8_block_fp8_linear(x, b, b_s, [128, 128])  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tk.w8a8_block_fp8_linear(x, b, b_s, [128, 128])
    x.copy_(spread(tuple(x.shape), torch.Generator().manual_seed(9), torch.bfloat16, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, tk.w8a8_block_fp8_linear(x, b, b_s, [128, 128]))
