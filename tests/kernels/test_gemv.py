"""`gemv.py`'s kernels (one row, and up to GEMV_MAX_ROWS), reached through `skinny.py`'s wrappers:
against the fp64 product, their gated and normalised launches against the separate launches bit
for bit, the loop over long rows, and the layers' choice of them (`gemv_enabled`: one 16-bit row on
a CUDA device, up to GEMV_MAX_ROWS with `TILELLM_GEMV=1`), the LM head's included.

On the CPU the kernel runs under Triton's interpreter (16-bit products: the kernel sums in fp32
without `tl.dot`, which the interpreter runs correctly in 16 bits), and through a decoder's
RMSNorm, linear layer and gated MLP with the switch forced; on the GPU at Qwen3's layer shapes
and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import assert_close
from tests.kernels.test_skinny import _fp64
from tilellm.kernels import gemv, skinny
from tilellm.kernels.fused import rms_norm, silu_and_mul
from tilellm.kernels.skinny import skinny_linear, skinny_linear_silu_and_mul, skinny_rms_norm_linear
from tilellm.models.layers import linear as linear_layers
from tilellm.models.layers.linear import ColumnParallelLinear, ParallelLMHead

HALF = [torch.bfloat16, torch.float16]
# (N, K): a partial last column tile, K not a power of two, K = 1, Qwen3-0.6B-like widths
SHAPES = [(48, 64), (37, 200), (5, 7), (3, 1), (64, 1024)]


def _operands(N, K, dtype, device, seed=0, bias=False, rows=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device=device, dtype=dtype)
    b = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, w, b


@pytest.fixture
def gemv_calls(monkeypatch):
    """`TILELLM_GEMV=1`, and the shapes (x, weight) of the calls that reached `gemv.py`'s launch."""
    monkeypatch.setenv("TILELLM_GEMV", "1")
    calls = []
    real = skinny.launch_gemv

    def spy(x, weight, *args, **kwargs):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(skinny, "launch_gemv", spy)
    return calls


def test_tiles():
    """One row: K padded to a power of two, 1-4 weight rows of at most TILE_ELEMENTS, a loop past
    MAX_BLOCK_K. More rows: M padded to a power of two, the product within ROWS_PRODUCT_ELEMENTS.
    Nothing depends on N, so gated and plain launches sum a column alike."""
    assert gemv.gemv_tile(1, 1024) == (1, 4, 1024, 1)
    assert gemv.gemv_tile(1, 3072) == (1, 2, 4096, 1)
    assert gemv.gemv_tile(1, 7) == (1, 4, 8, 1)
    assert gemv.gemv_tile(1, 12288) == (1, 1, 16384, 1)
    assert gemv.gemv_tile(1, 40000) == (1, 1, gemv.MAX_BLOCK_K, 3)
    assert gemv.gemv_tile(2, 1024) == (2, 4, 1024, 1)
    assert gemv.gemv_tile(5, 1024) == (8, 2, 1024, 1)
    assert gemv.gemv_tile(8, 3072) == (8, 1, 2048, 2)
    assert gemv.gemv_fuses_norm(8, 2048) and not gemv.gemv_fuses_norm(8, 3072)


ROWS = [1, 3, 8]  # one row, a partial row tile, a full one


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize(("N", "K"), SHAPES)
def test_matches_fp64(N, K, M, dtype, bias, gemv_calls):
    """Up to GEMV_MAX_ROWS rows in 16 bits go to the kernels and land within one output rounding
    of the fp64 product (plus the bias)."""
    x, w, b = _operands(N, K, dtype, "cpu", seed=N + K + M, bias=bias, rows=M)
    got = skinny_linear(x, w, b)
    assert gemv_calls == [((M, K), (N, K))]
    assert got.dtype == dtype and got.shape == (M, N)
    assert_close(got.float(), _fp64(x, w, b).float(), 8e-3, f"{dtype} M={M} N={N} K={K}")


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_more_rows_and_fp32_keep_the_skinny_kernel(gemv_calls):
    """More than GEMV_MAX_ROWS rows, or fp32, run `skinny.py`'s own kernel (fp16 for the rows:
    that kernel's `tl.dot` is wrong in bf16 under the interpreter)."""
    x, w, _ = _operands(16, 64, torch.float16, "cpu", rows=gemv.GEMV_MAX_ROWS + 1)
    assert_close(skinny_linear(x, w).float(), _fp64(x, w, None).float(), 8e-3, "rows")
    x, w, _ = _operands(16, 64, torch.float32, "cpu")
    assert_close(skinny_linear(x, w), _fp64(x, w, None).float(), 1e-5, "fp32")
    assert gemv_calls == []


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize(("N", "K"), SHAPES)
def test_gated_and_normalised_launches_give_the_separate_launches_bits(N, K, M, dtype, gemv_calls):
    """The gate-up launch is `skinny_linear` then `silu_and_mul` bit for bit; the norm's launch
    gives `rms_norm`'s residual stream bit for bit and, on these inputs, the layer on `rms_norm`'s
    output bit for bit; with and without a residual, gated or not, with a bias."""
    x, w, b = _operands(2 * N, K, dtype, "cpu", seed=K + M, bias=True, rows=M)
    w = w / 2  # (fp16 products well inside its range)
    assert torch.equal(skinny_linear_silu_and_mul(x, w, b), silu_and_mul(skinny_linear(x, w, b)))
    gen = torch.Generator().manual_seed(N)
    r = torch.randn(M, K, generator=gen).to(dtype)
    nw = (torch.rand(K, generator=gen) + 0.5).to(dtype)
    for gated, layer in ((False, skinny_linear), (True, skinny_linear_silu_and_mul)):
        y, h = skinny_rms_norm_linear(x, nw, 1e-6, w, b, residual=r, silu_and_mul=gated)
        normed, expected_h = rms_norm(x, nw, 1e-6, residual=r)
        assert torch.equal(h, expected_h)
        assert torch.equal(y, layer(normed, w, b)), f"gated={gated}"
        y = skinny_rms_norm_linear(x, nw, 1e-6, w, b, silu_and_mul=gated)
        assert torch.equal(y, layer(rms_norm(x, nw, 1e-6), w, b)), f"no residual, gated={gated}"
    assert len(gemv_calls) == 10  # 2, then 4 for each of the two layers


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("n_tiles", [2, 3])
def test_rows_programs_of_several_column_tiles_give_the_same_bits(monkeypatch, n_tiles, gemv_calls):
    """ROWS_N_TILES column tiles a program (x read and normalised once for them): the bits of one
    tile a program, plain, gated and with the norm, over a last program whose tiles run past N."""
    x, w, b = _operands(2 * 37, 200, torch.float16, "cpu", seed=n_tiles, bias=True, rows=3)
    w = w / 2
    nw = (torch.rand(200, generator=torch.Generator().manual_seed(1)) + 0.5).half()
    r = torch.randn(3, 200, generator=torch.Generator().manual_seed(2)).half()

    def launches():
        return (
            skinny_linear(x, w, b),
            skinny_linear_silu_and_mul(x, w, b),
            *skinny_rms_norm_linear(x, nw, 1e-6, w, b, residual=r, silu_and_mul=True),
        )

    want = launches()
    monkeypatch.setattr(gemv, "ROWS_N_TILES", n_tiles)
    got = launches()
    assert all(torch.equal(g, e) for g, e in zip(got, want))
    assert len(gemv_calls) == 6 and gemv.gemv_tile(3, 200)[1] * n_tiles < 37


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("M", ROWS)
def test_rows_longer_than_a_tile_loop_over_k(monkeypatch, dtype, M, gemv_calls):
    """Rows longer than a tile (MAX_BLOCK_K made 64, ROWS_PRODUCT_ELEMENTS 512) loop over K,
    gated or not; the norm's launch then keeps `skinny.py`'s kernel (its prologue needs the whole
    row in one tile)."""
    monkeypatch.setattr(gemv, "MAX_BLOCK_K", 64)
    monkeypatch.setattr(gemv, "ROWS_PRODUCT_ELEMENTS", 512)
    x, w, b = _operands(12, 200, dtype, "cpu", seed=3, bias=True, rows=M)
    assert gemv.gemv_tile(M, 200)[3] > 1
    assert_close(skinny_linear(x, w, b).float(), _fp64(x, w, b).float(), 8e-3, "loop")
    assert torch.equal(skinny_linear_silu_and_mul(x, w, b), silu_and_mul(skinny_linear(x, w, b)))
    assert len(gemv_calls) == 3
    # (in fp16: `skinny.py`'s kernel runs `tl.dot`, which the interpreter gets wrong in bf16)
    x, w, b = x.half(), w.half(), b.half()
    nw = torch.ones(200, dtype=torch.float16)
    y = skinny_rms_norm_linear(x, nw, 1e-6, w, b)
    assert len(gemv_calls) == 3
    assert_close(y.float(), F.linear(rms_norm(x, nw, 1e-6).float(), w.float(), b.float()), 8e-3, "norm")


def test_one_cuda_row_by_default_more_when_asked(monkeypatch):
    """Unset, `TILELLM_GEMV` gives linear layers one-row 16-bit steps on a CUDA device and nothing
    on the CPU; "0" nothing; "1" 1 to GEMV_MAX_ROWS rows (and `skinny.py`'s calls on the CPU
    too); never fp32, and linear layers never on the CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("TILELLM_GEMV", raising=False)
    assert gemv.gemv_max_rows(cuda) == 1 and gemv.gemv_max_rows(cpu) == 0
    assert gemv.gemv_enabled(cuda, 1, torch.bfloat16) and not gemv.gemv_enabled(cuda, 2, torch.bfloat16)
    assert not gemv.gemv_enabled(cpu, 1, torch.bfloat16) and not gemv.gemv_runs(1, torch.float16, cpu)
    monkeypatch.setenv("TILELLM_GEMV", "0")
    assert gemv.gemv_max_rows(cuda) == 0 and not gemv.gemv_enabled(cuda, 1, torch.bfloat16)
    monkeypatch.setenv("TILELLM_GEMV", "1")
    for dtype in (torch.float32, *HALF):
        assert not gemv.gemv_enabled(cpu, 1, dtype)
    assert not gemv.gemv_enabled(cuda, 1, torch.float32)
    assert gemv.gemv_enabled(cuda, 1, torch.bfloat16) and gemv.gemv_enabled(
        cuda, gemv.GEMV_MAX_ROWS, torch.float16
    )
    assert not gemv.gemv_enabled(cuda, 0, torch.bfloat16)
    assert not gemv.gemv_enabled(cuda, gemv.GEMV_MAX_ROWS + 1, torch.bfloat16)
    assert gemv.gemv_runs(1, torch.float16, cpu) and not gemv.gemv_runs(1, torch.float32, cpu)


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_switched_off_one_row_calls_keep_the_skinny_kernel(monkeypatch, gemv_calls):
    """Without `TILELLM_GEMV=1`, `skinny.py`'s one-row calls on the CPU (the PDL path's) run its own
    kernel.
    (fp16: that kernel's `tl.dot` is wrong in bf16 under the interpreter.)"""
    monkeypatch.delenv("TILELLM_GEMV")
    x, w, b = _operands(40, 96, torch.float16, "cpu", bias=True)
    assert_close(skinny_linear(x, w, b).float(), _fp64(x, w, b).float(), 8e-3, "switched off")
    assert gemv_calls == []


def _inf_padded(rows: int, cols: int, width: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [rows, cols] fp16 view at column `offset` of rows `width` wide, the whole buffer): the
    memory around the view holds inf, which any load or store reaching it shows."""
    wide = torch.full((rows, width), float("inf"), dtype=torch.float16)
    return wide[:, offset : offset + cols], wide


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("M", ROWS)
def test_strided_views(monkeypatch, M, loop, gemv_calls):
    """A weight that is a column slice of a wider matrix (rows strided past K) and an x whose rows
    are column slices of wider rows (as `split` leaves MLA's q latent), in one tile and in the
    loop over K; then the norm's launch with such an x, residual and residual_out (the padding
    around residual_out left as it was)."""
    if loop:
        monkeypatch.setattr(gemv, "MAX_BLOCK_K", 32)
        monkeypatch.setattr(gemv, "ROWS_PRODUCT_ELEMENTS", 128)
    K, N = 72, 10
    w, _ = _inf_padded(N, K, K + 13, 0)
    w.copy_(torch.randn(N, K) / K**0.5)
    x, _ = _inf_padded(M, K, 2 * K, 5)
    x.copy_(torch.randn(M, K))
    got = skinny_linear(x, w)
    assert gemv_calls == [((M, K), (N, K))]
    assert_close(got.float(), _fp64(x, w, None).float(), 8e-3, f"M={M} loop={loop}")
    if loop:
        return  # (the norm's launch needs a row in one tile)
    r, _ = _inf_padded(M, K, K + 7, 3)
    r.copy_(torch.randn(M, K))
    out, out_buffer = _inf_padded(M, K, K + 9, 4)
    nw = (torch.rand(K) + 0.5).half()
    y, h = skinny_rms_norm_linear(x, nw, 1e-6, w, residual=r, residual_out=out)
    normed, expected_h = rms_norm(x, nw, 1e-6, residual=r)
    assert h is out and torch.equal(out, expected_h)
    assert torch.equal(y, skinny_linear(normed, w))
    padding = torch.ones_like(out_buffer, dtype=torch.bool)
    padding[:, 4 : 4 + K] = False
    assert torch.isinf(out_buffer[padding]).all()


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_layers_take_it_for_few_rows(monkeypatch, gemv_calls):
    """Where it is enabled (forced here on the CPU for up to GEMV_MAX_ROWS rows), a 16-bit linear
    layer runs it for those rows (any leading dims) and cuBLAS above; the LM head too. Both give
    the layer's product."""
    limit = gemv.GEMV_MAX_ROWS
    monkeypatch.setattr(linear_layers, "gemv_enabled", lambda device, rows, dtype: 0 < rows <= limit)
    layer = ColumnParallelLinear(64, 48, bias=True, tp_rank=0, tp_size=1).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64) / 8)
        layer.bias.copy_(torch.randn(48))
    for shape in [(1, 64), (1, 1, 64), (2, 3, 64), (limit, 64), (limit + 1, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        expected = _fp64(x.reshape(-1, 64), layer.weight, layer.bias).float().reshape(*shape[:-1], 48)
        assert_close(layer(x).float(), expected, 8e-3, f"{shape}")
    assert [call[0][0] for call in gemv_calls] == [1, 1, 6, limit]
    head = ParallelLMHead(100, 64).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(100, 64) / 8)
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    assert_close(head(hidden).float(), _fp64(hidden, head.weight, None).float(), 8e-3, "LM head")
    assert gemv_calls[-1] == ((3, 64), (100, 64))
    assert head(torch.randn(limit + 1, 64).to(torch.bfloat16)).shape == (limit + 1, 100)
    assert len(gemv_calls) == 5


@pytest.mark.interpreter  # CPU tensors through the kernel
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True])
def test_decoder_norm_and_mlp_run_in_the_layers_launches(monkeypatch, with_residual, rows, gemv_calls):
    """Where it is enabled (forced here on the CPU), a decoder's RMSNorm hands its rows (one, or
    three) to the linear layer that reads it, and the gated MLP's gate-up takes its SiLU-and-mul: the layer's
    and the MLP's outputs are the norm-then-layer bits, the residual stream is the norm's; with
    the reference ops (the oracle backend) every op runs on its own."""
    from tilellm.kernels import fused
    from tilellm.kernels.reference import fused as reference_fused
    from tilellm.models.layers.layernorm import RMSNorm
    from tilellm.models.layers.linear import NormedActivation
    from tilellm.models.layers.mlp import GatedMLP

    monkeypatch.setattr(linear_layers, "gemv_enabled", lambda device, rows, dtype: 0 < rows <= 8)
    gen = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16
    layer = ColumnParallelLinear(64, 48, bias=False, tp_rank=0, tp_size=1).to(dtype)
    mlp = GatedMLP(64, 40, bias=False, fused_ops=fused).to(dtype)
    norm = RMSNorm(64, 1e-6, fused).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
        for p in (layer.weight, *mlp.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) / 8)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    args = (x, torch.randn(rows, 64, generator=gen).to(dtype)) if with_residual else (x,)
    want = fused.rms_norm(*args[:1], norm.weight, 1e-6, residual=args[1] if with_residual else None)
    want_y, want_res = want if with_residual else (want, None)
    for reader, run, expected in (
        (layer, layer, skinny_linear(want_y, layer.weight)),
        (mlp.input_linear, mlp, mlp.down_proj(silu_and_mul(skinny_linear(want_y, mlp.gate_up_proj.weight)))),
    ):
        got = norm(*args, quant_for=reader)
        got_y, got_res = got if with_residual else (got, None)
        assert isinstance(got_y, NormedActivation)
        assert torch.equal(run(got_y), expected)
        if with_residual:
            assert torch.equal(got_res, want_res)
    # norm + layer, norm + gate-up + SiLU then down_proj; (the expected values' 3 launches first)
    assert len(gemv_calls) == 3 + 3
    reference_norm = RMSNorm(64, 1e-6, reference_fused).to(dtype)
    reference_mlp = GatedMLP(64, 40, bias=False, fused_ops=reference_fused).to(dtype)
    reference_mlp.load_state_dict(mlp.state_dict())
    with torch.no_grad():
        reference_norm.weight.copy_(norm.weight)
    got = reference_norm(*args, quant_for=layer)
    assert not isinstance(got[0] if with_residual else got, NormedActivation)
    calls = []
    monkeypatch.setattr(linear_layers.LinearMethod, "apply_silu_and_mul", lambda *a: calls.append(1))
    reference_mlp(x)
    assert calls == []


@pytest.mark.interpreter  # CPU tensors through the kernel
def test_a_norm_that_does_not_fit_the_tile_runs_on_its_own(monkeypatch, gemv_calls):
    """Where a row does not fit the rows kernel's tile (ROWS_PRODUCT_ELEMENTS made 64 here), the
    RMSNorm keeps its own launch and the layer's loops over K: the same output as the norm then
    the layer."""
    from tilellm.kernels import fused
    from tilellm.models.layers.layernorm import RMSNorm

    monkeypatch.setattr(linear_layers, "gemv_enabled", lambda device, rows, dtype: 0 < rows <= 8)
    monkeypatch.setattr(gemv, "ROWS_PRODUCT_ELEMENTS", 64)
    layer = ColumnParallelLinear(64, 24, bias=False, tp_rank=0, tp_size=1).to(torch.float16)
    norm = RMSNorm(64, 1e-6, fused).to(torch.float16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 64) / 8)
    x, r = torch.randn(3, 64).half(), torch.randn(3, 64).half()
    y, res = norm(x, r, quant_for=layer)
    assert isinstance(y, torch.Tensor)
    want_y, want_res = fused.rms_norm(x, norm.weight, 1e-6, residual=r)
    assert torch.equal(y, want_y) and torch.equal(res, want_res)
    assert torch.equal(layer(y), skinny_linear(want_y, layer.weight))
    assert gemv_calls == [((3, 64), (24, 64))] * 2 and gemv.gemv_tile(3, 64)[3] > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize(
    ("N", "K"),
    [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (258, 4104), (8, 20000)],
)
def test_qwen3_shapes_on_the_gpu(N, K, M, dtype, gemv_calls):
    """Qwen3-0.6B's layers and LM head, a partial column tile, rows that loop over K, at 1, 3 and
    8 rows: within one output rounding of the fp64 product; the gated launch bit for bit the plain
    one then `silu_and_mul`; the norm's launch within a rounding of `rms_norm` then the layer, its
    residual stream bit for bit."""
    x, w, b = _operands(N, K, dtype, "cuda", seed=N, bias=True, rows=M)
    assert_close(skinny_linear(x, w, b).float(), _fp64(x, w, b).float(), 8e-3, f"{dtype} M={M} N={N} K={K}")
    if N % 2 == 0:
        assert torch.equal(skinny_linear_silu_and_mul(x, w, b), silu_and_mul(skinny_linear(x, w, b)))
    r = torch.randn(M, K, device="cuda").to(dtype)
    nw = (torch.rand(K, device="cuda") + 0.5).to(dtype)
    y, h = skinny_rms_norm_linear(x, nw, 1e-6, w, b, residual=r)
    normed, expected_h = rms_norm(x, nw, 1e-6, residual=r)
    assert torch.equal(h, expected_h)
    assert_close(y.float(), F.linear(normed.float(), w.float(), b.float()), 8e-3, "norm")
    fused = gemv.gemv_fuses_norm(M, K)  # (else the norm's launch is `skinny.py`'s own)
    assert len(gemv_calls) == (3 if N % 2 == 0 else 1) + (1 if fused else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 3])
def test_a_decoder_mlp_chain_in_a_cuda_graph(gemv_calls, M):
    """RMSNorm and gate-up with SiLU-and-mul in one launch, then down_proj, at one row and three,
    captured in a CUDA graph and replayed on new inputs: the bits of the same chain run eagerly."""
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 3072
    nw = (torch.rand(hidden, generator=gen) + 0.5).cuda().bfloat16()
    w1 = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).cuda().bfloat16()
    w2 = (torch.randn(hidden, inter, generator=gen) / inter**0.5).cuda().bfloat16()
    x = torch.randn(M, hidden, device="cuda").bfloat16()
    r = torch.randn(M, hidden, device="cuda").bfloat16()

    def chain():
        act, h = skinny_rms_norm_linear(x, nw, 1e-6, w1, residual=r, silu_and_mul=True)
        return skinny_linear(act, w2), h

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_h = chain()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed + 1)
        x.copy_(torch.randn(M, hidden, generator=g).cuda())
        r.copy_(torch.randn(M, hidden, generator=g).cuda())
        graph.replay()
        y, h = chain()
        assert torch.equal(out, y) and torch.equal(out_h, h), f"replay {seed}"
    assert gemv_calls and all(call[0] in ((M, hidden), (M, inter)) for call in gemv_calls)
