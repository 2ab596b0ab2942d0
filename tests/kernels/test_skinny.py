"""`skinny_linear` (few-row GEMM) against `F.linear` in fp64, its checks, and the linear layers'
choice of it under programmatic dependent launch (`TILELLM_PDL=1`; `pdl_enabled`);
`skinny_linear_silu_and_mul` against `skinny_linear` then `silu_and_mul`, and the gated MLP's
choice of it; `skinny_rms_norm_linear` (the RMSNorm before a layer in its launch) against
`rms_norm` then the layer, and the decoder's handing of its norm to the layer.

On the CPU the kernel runs under Triton's interpreter without PDL (the `griddepcontrol`
instructions exist only on the GPU); on an H100/H200 the GPU tests run it with and without PDL
and require the same bits.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.kernels.helpers import assert_close
from tilellm.kernels import pdl, skinny
from tilellm.kernels.fused import rms_norm, silu_and_mul
from tilellm.kernels.skinny import (
    SKINNY_MAX_ROWS,
    skinny_config,
    skinny_linear,
    skinny_linear_silu_and_mul,
    skinny_rms_norm_linear,
)
from tilellm.models.layers import linear as linear_layers
from tilellm.models.layers.linear import ColumnParallelLinear
from tilellm.models.layers.mlp import GatedMLP

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.fixture(autouse=True)
def _skinny_kernel_only(monkeypatch):
    """`TILELLM_GEMV=0`: one-row calls on a GPU run this file's kernel, not `gemv.py`'s (tested in
    test_gemv.py), whatever the environment says."""
    monkeypatch.setenv("TILELLM_GEMV", "0")


@contextlib.contextmanager
def _pdl(on: bool):
    """TILELLM_PDL set (or unset) for the calls inside, whatever the environment says."""
    with pytest.MonkeyPatch.context() as mp:
        if on:
            mp.setenv("TILELLM_PDL", "1")
        else:
            mp.delenv("TILELLM_PDL", raising=False)
        pdl._pdl_enabled.cache_clear()
        try:
            yield
        finally:
            pdl._pdl_enabled.cache_clear()


def _operands(M, N, K, dtype, device, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device=device, dtype=dtype)
    b = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, w, b


def _fp64(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("M", "N", "K"),
    [(1, 48, 64), (5, 100, 96), (16, 64, 200), (40, 33, 64), (3, 16, 7)],  # K not a multiple of the tile
)
@pytest.mark.interpreter  # CPU tensors through the kernel
def test_matches_fp64(M, N, K, bias):
    """fp32 on the CPU (the interpreter): within fp32 summation order of the fp64 product, over
    row counts below, at and above 16, column counts that leave a partial tile, and K that does."""
    x, w, b = _operands(M, N, K, torch.float32, "cpu", seed=M + N + K, bias=bias)
    assert_close(skinny_linear(x, w, b), _fp64(x, w, b).float(), 1e-5, f"M={M} N={N} K={K}")


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_strided_operands_and_empty():
    """Rows of x and of the weight with strides past K (the memory past K full of inf: a load that
    reaches it shows), a strided bias, and empty inputs."""
    x, w, b = _operands(6, 32, 72, torch.float32, "cpu", bias=True)
    wide_x = torch.full((6, 100), float("inf"))
    wide_x[:, 10:82] = x
    wide_w = torch.full((32, 90), float("inf"))
    wide_w[:, :72] = w
    got = skinny_linear(wide_x[:, 10:82], wide_w[:, :72], torch.stack((b, -b), 1)[:, 0])
    assert_close(got, _fp64(x, w, b).float(), 1e-5, "strided x, weight and bias")
    assert skinny_linear(x[:0], w).shape == (0, 32)
    b = torch.arange(32.0)
    assert torch.equal(skinny_linear(x[:, :0], w[:, :0], b), b.expand(6, 32))
    assert torch.equal(skinny_linear(x[:, :0], w[:, :0]), torch.zeros(6, 32))


def test_rejects_bad_input():
    x, w, _ = _operands(4, 32, 64, torch.float32, "cpu")
    with pytest.raises(
        ValueError, match=r"^skinny_linear: x must be a 2-D tensor \[M, K\], got \(1, 4, 64\)"
    ):
        skinny_linear(x[None], w)
    with pytest.raises(ValueError, match="^skinny_linear: weight must be float32, float16 or bfloat16"):
        skinny_linear(x, w.to(torch.int32))
    with pytest.raises(ValueError, match="must match x"):
        skinny_linear(x, w[:, :32])
    with pytest.raises(ValueError, match="must match x"):
        skinny_linear(x, w.double().float().half())
    with pytest.raises(ValueError, match="^skinny_linear: weight's last dim must be contiguous"):
        skinny_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match=r"^skinny_linear: bias must be \[N=32\]"):
        skinny_linear(x, w, torch.zeros(31))


def test_config_covers_the_sms(monkeypatch):
    """The widest column tile that still gives every SM a program (132 here, off the GPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert skinny_config(1, 6144, 1024)[0] == 32  # Qwen3-0.6B gate_up: 192 programs
    assert skinny_config(1, 24576, 4096)[0] == 64  # Qwen3-8B gate_up: 384 programs
    assert skinny_config(1, 1024, 3072)[0] == 16  # Qwen3-0.6B down: 64 programs at the narrowest
    assert skinny_config(1, 4096, 4096)[:2] == (16, 128)


def test_prefetch_stays_within_its_budget(monkeypatch):
    """Each program's L2 prefetch: one request per thread, whole rows while every program's rows
    fit in PREFETCH_BUDGET_BYTES, the start of each row beyond (Qwen3-8B's gate_up), never more."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for N, K in [(4096, 1024), (1024, 3072), (6144, 1024), (24576, 4096), (4096, 12288), (151936, 1024)]:
        block_n, _, warps, _, chunks, chunk_bytes = skinny._plan(1, N, K, 2, False)
        assert chunks * block_n == warps * 32 and chunk_bytes % 16 == 0
        programs = -(-N // block_n)
        total = programs * block_n * chunks * chunk_bytes
        assert total <= skinny.PREFETCH_BUDGET_BYTES, (N, K, total)
        if N * K * 2 <= skinny.PREFETCH_BUDGET_BYTES:
            assert chunks * chunk_bytes == 2 * K, (N, K)  # the whole row


def test_pdl_is_off_without_its_switch_and_off_the_gpu(monkeypatch):
    pdl._pdl_enabled.cache_clear()
    monkeypatch.setenv("TILELLM_PDL", "1")
    try:
        assert not pdl.pdl_enabled(torch.device("cpu"))
        if torch.cuda.is_available():
            monkeypatch.delenv("TILELLM_PDL")
            pdl._pdl_enabled.cache_clear()
            assert not pdl.pdl_enabled(torch.device("cuda"))
    finally:
        pdl._pdl_enabled.cache_clear()


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_linear_layers_take_it_for_few_rows_under_pdl(monkeypatch):
    """With PDL on, a plain linear layer runs `skinny_linear` for up to SKINNY_MAX_ROWS rows (any
    leading dims) and cuBLAS above; both give the layer's product. (On the CPU the switch is
    forced in the layer only: the kernel itself then runs without PDL, under the interpreter.)"""
    layer = ColumnParallelLinear(64, 48, bias=True, tp_rank=0, tp_size=1)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64) / 8)
        layer.bias.copy_(torch.randn(48))
    calls = []
    monkeypatch.setattr(linear_layers, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(
        linear_layers, "skinny_linear", lambda *a: calls.append(a[0].shape) or skinny_linear(*a)
    )
    for shape in [(1, 64), (2, 8, 64), (SKINNY_MAX_ROWS, 64), (SKINNY_MAX_ROWS + 1, 64)]:
        x = torch.randn(shape)
        y = layer(x)
        expected = _fp64(x.reshape(-1, 64), layer.weight, layer.bias).float().reshape(*shape[:-1], 48)
        assert_close(y, expected, 1e-5, f"{shape}")
    assert calls == [(1, 64), (16, 64), (SKINNY_MAX_ROWS, 64)]


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("M", "I", "K"), [(1, 48, 64), (5, 32, 200), (16, 64, 96), (40, 16, 7)])
def test_silu_and_mul_in_the_same_launch(M, I, K, bias):
    """fp32 on the CPU: the same bits as `skinny_linear` then `silu_and_mul` (column counts that
    are whole tiles, so both launches sum each output over the same tile shapes), at rows below,
    at and above 16, and K that leaves a partial tile."""
    x, w, b = _operands(M, 2 * I, K, torch.float32, "cpu", seed=M + I + K, bias=bias)
    got = skinny_linear_silu_and_mul(x, w, b)
    assert got.shape == (M, I)
    assert torch.equal(got, silu_and_mul(skinny_linear(x, w, b))), f"M={M} I={I} K={K}"


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_silu_and_mul_partial_tiles_and_empty():
    """An output width that leaves a partial column tile (the gate and up tiles then start at
    different offsets within a tile of the two-launch path): within fp32 summation order of the
    fp64 result; K = 0: silu(b_gate) * b_up; no rows: an empty [0, I]."""
    x, w, b = _operands(3, 2 * 20, 48, torch.float32, "cpu", seed=1, bias=True)
    ref = _fp64(x, w, b)
    gate, up = ref[:, :20], ref[:, 20:]
    assert_close(skinny_linear_silu_and_mul(x, w, b), (gate * torch.sigmoid(gate) * up).float(), 1e-5, "I=20")
    b = torch.linspace(-2, 2, 40)
    got = skinny_linear_silu_and_mul(x[:, :0], w[:, :0], b)
    assert torch.equal(got, silu_and_mul(b.expand(3, 40).contiguous()))
    assert torch.equal(skinny_linear_silu_and_mul(x[:, :0], w[:, :0]), torch.zeros(3, 20))
    assert skinny_linear_silu_and_mul(x[:0], w).shape == (0, 20)


def test_silu_and_mul_rejects_an_odd_weight():
    x, w, _ = _operands(2, 33, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^skinny_linear_silu_and_mul: weight must hold \[gate \| up\]"):
        skinny_linear_silu_and_mul(x, w)
    with pytest.raises(ValueError, match="^skinny_linear: x must be a 2-D tensor"):
        skinny_linear_silu_and_mul(x[None], w[:32])


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_gated_mlp_takes_one_launch_for_few_rows_under_pdl(monkeypatch):
    """With PDL on, the gated MLP's gate-up and SiLU-and-mul run as one `skinny_linear_silu_and_mul`
    for up to SKINNY_MAX_ROWS rows and as the two ops above; the output is the same either way.
    (On the CPU the switch is forced in the layer only, as above.)"""
    from tilellm.kernels import fused

    mlp = GatedMLP(64, 48, bias=True, fused_ops=fused)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 8)
    calls = []
    monkeypatch.setattr(
        linear_layers,
        "skinny_linear_silu_and_mul",
        lambda *a: calls.append(a[0].shape) or skinny_linear_silu_and_mul(*a),
    )
    for shape in [(1, 64), (SKINNY_MAX_ROWS, 64), (SKINNY_MAX_ROWS + 1, 64)]:  # [T, H], as the model calls it
        x = torch.randn(shape, generator=gen)
        monkeypatch.setattr(linear_layers, "pdl_enabled", lambda device: False)
        expected = mlp(x)
        monkeypatch.setattr(linear_layers, "pdl_enabled", lambda device: True)
        got = mlp(x)
        assert got.shape == shape
        assert_close(got, expected, 1e-5, f"{shape}")
    assert calls == [(1, 64), (16, 64)]


def _norm_operands(M, K, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
    r = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
    nw = (torch.rand(K, generator=gen) + 0.5).to(device=device, dtype=dtype)
    return x, r, nw


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("M", "N", "K"), [(1, 48, 64), (5, 32, 200), (16, 64, 96), (40, 16, 7)])
def test_rms_norm_in_the_same_launch(M, N, K, with_residual, gated):
    """fp32 on the CPU: y within fp32 rounding of `rms_norm` then the layer (the row's sum of
    squares is summed in chunks here, whole in the norm's kernel), and the new residual stream
    bit for bit, at rows below, at and above 16 and K that leaves a partial tile."""
    x, r, nw = _norm_operands(M, K, torch.float32, "cpu", seed=M + N + K)
    _, w, b = _operands(M, 2 * N if gated else N, K, torch.float32, "cpu", seed=K, bias=True)
    res = r if with_residual else None
    got = skinny_rms_norm_linear(x, nw, 1e-6, w, b, residual=res, silu_and_mul=gated)
    normed = rms_norm(x, nw, 1e-6, residual=res)
    if with_residual:
        (got, got_res), (normed, expected_res) = got, normed
        assert torch.equal(got_res, expected_res), "residual stream"
    layer = skinny_linear_silu_and_mul if gated else skinny_linear
    assert got.shape == (M, N)
    assert_close(got, layer(normed, w, b), 1e-5, f"M={M} N={N} K={K} gated={gated}")


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_rms_norm_in_the_same_launch_fills_the_given_residual_and_checks():
    """`residual_out` is filled in place (what the decoder was handed before the layer ran); empty
    shapes still produce the residual; bad arguments name the problem."""
    x, r, nw = _norm_operands(3, 64, torch.float32, "cpu", seed=5)
    _, w, _ = _operands(3, 32, 64, torch.float32, "cpu")
    out = torch.full_like(x, float("nan"))
    y, h = skinny_rms_norm_linear(x, nw, 1e-5, w, residual=r, residual_out=out)
    assert h is out and torch.equal(out, x + r)
    y0, h0 = skinny_rms_norm_linear(x, nw, 1e-5, w[:0], residual=r)
    assert y0.shape == (3, 0) and torch.equal(h0, x + r)
    y0, h0 = skinny_rms_norm_linear(x[:0], nw, 1e-5, w, residual=r[:0])
    assert y0.shape == (0, 32) and h0.shape == (0, 64)
    with pytest.raises(ValueError, match=r"^skinny_rms_norm_linear: x has no columns to normalise"):
        skinny_rms_norm_linear(x[:, :0], nw[:0], 1e-5, w[:, :0])
    with pytest.raises(ValueError, match=r"^rms_norm: weight must be \[H=64\]"):
        skinny_rms_norm_linear(x, nw[:10], 1e-5, w)
    with pytest.raises(ValueError, match=r"^skinny_rms_norm_linear: residual_out must be \[M, K\]"):
        skinny_rms_norm_linear(x, nw, 1e-5, w, residual=r, residual_out=out[:, :8])
    with pytest.raises(ValueError, match="^skinny_rms_norm_linear: with silu_and_mul, weight must hold"):
        skinny_rms_norm_linear(x, nw, 1e-5, w[:31], silu_and_mul=True)
    with pytest.raises(ValueError, match="^skinny_rms_norm_linear: residual_out is given without residual"):
        skinny_rms_norm_linear(x, nw, 1e-5, w, residual_out=out)
    buf = torch.empty(4 * 64)
    buf[:192] = r.flatten()
    r_in_buf, shifted = buf[:192].view(3, 64), buf[64:].view(3, 64)  # two rows in common
    # an in-place residual update, or a part of one: the launch reads x and residual again
    for residual, shared in ((r, r), (r, x), (r_in_buf, shifted)):
        with pytest.raises(ValueError, match="^skinny_rms_norm_linear: residual_out must not share memory"):
            skinny_rms_norm_linear(x, nw, 1e-5, w, residual=residual, residual_out=shared)


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("with_residual", [False, True])
def test_decoder_norm_is_run_by_the_layer_under_pdl(monkeypatch, with_residual):
    """With PDL on, an RMSNorm whose reader is a plain linear layer (the decoder's `quant_for`)
    hands it the rows un-normalised for up to SKINNY_MAX_ROWS tokens; the layer's output and the
    residual stream are those of the norm then the layer, and above that many tokens the norm
    runs on its own. The gated MLP takes it too (norm, gate-up and SiLU-and-mul in one launch)."""
    from tilellm.kernels import fused
    from tilellm.models.layers.layernorm import RMSNorm
    from tilellm.models.layers.linear import NormedActivation

    gen = torch.Generator().manual_seed(9)
    norm = RMSNorm(64, 1e-6, fused)
    layer = ColumnParallelLinear(64, 48, bias=False, tp_rank=0, tp_size=1)
    mlp = GatedMLP(64, 40, bias=False, fused_ops=fused)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
        for p in (layer.weight, *mlp.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) / 8)
    launches = []  # the silu_and_mul flag of each norm-and-GEMM launch
    real = linear_layers.skinny_rms_norm_linear
    monkeypatch.setattr(
        linear_layers,
        "skinny_rms_norm_linear",
        lambda *a, **k: launches.append(k["silu_and_mul"]) or real(*a, **k),
    )
    for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen)
        r = torch.randn(rows, 64, generator=gen) if with_residual else None
        monkeypatch.setattr(linear_layers, "pdl_enabled", lambda device: False)
        args = (x,) if r is None else (x, r)
        want = norm(*args)
        want_y, want_res = want if r is not None else (want, None)
        want_out, want_mlp = layer(want_y), mlp(want_y)
        monkeypatch.setattr(linear_layers, "pdl_enabled", lambda device: True)
        for reader, run, expected in ((layer, layer, want_out), (mlp.input_linear, mlp, want_mlp)):
            got = norm(*args, quant_for=reader)
            got_y, got_res = got if r is not None else (got, None)
            assert isinstance(got_y, NormedActivation) == (rows <= SKINNY_MAX_ROWS), rows
            assert_close(run(got_y), expected, 1e-5, f"rows={rows}")
            if r is not None:
                assert torch.equal(got_res, want_res), f"residual rows={rows}"
    # rows 1 and 16: the plain layer's launch, then the MLP's with its SiLU-and-mul
    assert launches == [False, True, False, True]


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_normed_input_taken_by_a_layer_that_does_not_run_the_norm():
    """A `NormedActivation` reaching a layer whose step runs cuBLAS after all: the norm runs in a
    launch of its own (`NormedActivation.normalised`), the residual stream it was promised filled."""
    from tilellm.models.layers.linear import NormedActivation

    x, r, nw = _norm_operands(3, 64, torch.float32, "cpu", seed=2)
    layer = ColumnParallelLinear(64, 24, bias=False, tp_rank=0, tp_size=1)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 64, generator=torch.Generator().manual_seed(3)) / 8)
    res_out = torch.full_like(x, float("nan"))
    y = layer(NormedActivation(x, nw, 1e-6, r, res_out))  # PDL off: the cuBLAS path
    normed, h = rms_norm(x, nw, 1e-6, residual=r)
    assert torch.equal(res_out, h)
    assert torch.equal(y, layer(normed))


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_rms_norm_and_gate_up_keep_the_two_launches_roundings_in_fp16():
    """fp16 under the interpreter, where each rounding to the storage dtype shows: the gate-up
    launch gives `skinny_linear` then `silu_and_mul` bit for bit (its products rounded before the
    activation), and the norm's launch gives `rms_norm` then the layer bit for bit on these
    inputs (the residual sum and each normalised chunk rounded as the norm's kernel stores them;
    the chunked sum of squares rounds as the whole row's here). With a large eps: the same."""
    x, r, nw = _norm_operands(5, 96, torch.float16, "cpu", seed=0)
    _, w, b = _operands(5, 64, 96, torch.float16, "cpu", seed=1, bias=True)
    w = w / 4  # (products well inside fp16's range)
    assert torch.equal(skinny_linear_silu_and_mul(x, w, b), silu_and_mul(skinny_linear(x, w, b)))
    for eps in (1e-6, 0.5):
        for gated, layer in ((False, skinny_linear), (True, skinny_linear_silu_and_mul)):
            y, h = skinny_rms_norm_linear(x, nw, eps, w, b, residual=r, silu_and_mul=gated)
            normed, expected_h = rms_norm(x, nw, eps, residual=r)
            assert torch.equal(h, expected_h)
            assert torch.equal(y, layer(normed, w, b)), f"eps={eps} gated={gated}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("N", "K", "gated"), [(4096, 1024, False), (3072, 1024, True), (256, 4104, False)])
def test_rms_norm_in_the_same_launch_on_the_gpu(N, K, gated, dtype):
    """bf16 / fp16 on the GPU at 1, 5 and 16 rows: within one output rounding of `rms_norm` then
    the layer (the sum of squares may round differently), the residual stream bit for bit; under
    PDL on Hopper the same bits as without."""
    for M in (1, 5, 16):
        x, r, nw = _norm_operands(M, K, dtype, "cuda", seed=M)
        _, w, b = _operands(M, 2 * N if gated else N, K, dtype, "cuda", seed=M, bias=M == 5)
        layer = skinny_linear_silu_and_mul if gated else skinny_linear
        with _pdl(False):
            y, h = skinny_rms_norm_linear(x, nw, 1e-6, w, b, residual=r, silu_and_mul=gated)
            normed, expected_h = rms_norm(x, nw, 1e-6, residual=r)
            expected = layer(normed, w, b)
        assert torch.equal(h, expected_h), f"residual {dtype} M={M}"
        assert_close(y.float(), expected.float(), 2e-2, f"{dtype} M={M} N={N} K={K} gated={gated}")
        if HOPPER:
            with _pdl(True):
                y_pdl, h_pdl = skinny_rms_norm_linear(x, nw, 1e-6, w, b, residual=r, silu_and_mul=gated)
            assert torch.equal(y_pdl, y) and torch.equal(h_pdl, h), f"PDL changed the result: M={M}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("I", "K"), [(3072, 1024), (128, 4104)])
def test_silu_and_mul_in_the_same_launch_on_the_gpu(I, K, dtype):
    """bf16 / fp16 on the GPU at 1, 5 and 16 rows (Qwen3-0.6B's gate-up, and a K past the tile):
    the same bits as `skinny_linear` then `silu_and_mul`, without PDL and, on Hopper, with it."""
    for M in (1, 5, 16):
        x, w, b = _operands(M, 2 * I, K, dtype, "cuda", seed=M, bias=M == 5)
        for on in (False, True) if HOPPER else (False,):
            with _pdl(on):
                got = skinny_linear_silu_and_mul(x, w, b)
                expected = silu_and_mul(skinny_linear(x, w, b))
            assert torch.equal(got, expected), f"{dtype} M={M} I={I} K={K} pdl={on}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("N", "K"), [(4096, 1024), (1024, 3072), (6144, 1024), (256, 4104)])
def test_half_precision_on_the_gpu(N, K, dtype):
    """bf16 / fp16 on the GPU at 1, 5 and 16 rows: within one output rounding of the fp64 product
    (fp32 sums); under PDL on Hopper (prefetch and all) the same bits as without."""
    for M in (1, 5, 16):
        x, w, b = _operands(M, N, K, dtype, "cuda", seed=M, bias=M == 5)
        with _pdl(False):
            got = skinny_linear(x, w, b)
        assert_close(got.float(), _fp64(x, w, b).float(), 8e-3, f"{dtype} M={M} N={N} K={K}")
        if HOPPER:
            with _pdl(True):
                with_pdl = skinny_linear(x, w, b)
            assert torch.equal(with_pdl, got), f"PDL changed the result: {dtype} M={M} N={N} K={K}"


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs sm_90 or newer")
def test_pdl_chain_in_a_cuda_graph():
    """A chain of PDL kernels (RMSNorm, skinny linear, SiLU-and-mul, skinny linear, then RMSNorm,
    the gate-up GEMM with SiLU-and-mul in one launch, skinny linear; each reading the one before)
    captured in a CUDA graph and replayed on new inputs: the same bits as the chain launched
    without PDL."""
    from tilellm.kernels.fused import rms_norm, silu_and_mul

    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 3072
    norm_w = torch.rand(hidden, generator=gen).cuda().bfloat16() + 0.5
    w1 = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).cuda().bfloat16()
    w2 = (torch.randn(hidden, inter, generator=gen) / inter**0.5).cuda().bfloat16()
    x = torch.randn(4, hidden, device="cuda").bfloat16()

    def chain():
        h = skinny_linear(silu_and_mul(skinny_linear(rms_norm(x, norm_w, 1e-6), w1)), w2)
        return skinny_linear(skinny_linear_silu_and_mul(rms_norm(h, norm_w, 1e-6), w1), w2)

    with _pdl(False):
        expected = chain()
    with _pdl(True):
        assert pdl.pdl_enabled(x.device)
        assert torch.equal(chain(), expected), "eager PDL chain"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for seed in range(3):
        x.copy_(torch.randn(4, hidden, generator=torch.Generator().manual_seed(seed + 1)).cuda())
        graph.replay()
        with _pdl(False):
            plain = chain()
        assert torch.equal(out, plain), f"graph replay {seed}"
