"""The Gluon block-scaled FP8 GEMM for Hopper (`tilellm.kernels.fp8_gemm_hopper`).

On any machine: it compiles for sm_90a (Triton's own ptxas, no GPU) into warpgroup MMAs fed by
TMA, with register reallocation between the partitions, without spilling, in the shared memory
an H100/H200 has; `supports` takes the operands TMA can copy and refuses the others. On a Hopper
GPU: its output against the PyTorch twin over row counts that cross the 64-row warpgroup halves
and 128-row tiles, columns past a whole weight block, odd and even k-block counts, bf16 and fp16
outputs and activation scales in either layout; and `w8a8_block_fp8_matmul` picks it for many
tokens only.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import assert_close, compile_for_sm90
from tilellm.kernels import fp8_gemm
from tilellm.kernels.reference import fp8_gemm as ref

H100_SHARED = 227 * 1024
COMPILED = [(4, "bfloat16"), (5, "float16")]


@pytest.fixture(scope="module")
def compiled() -> dict:
    calls = {repr(v): dict(stages=v[0], output_dtype=f"torch.{v[1]}") for v in COMPILED}
    return compile_for_sm90("fp8_gemm_hopper", calls)


@pytest.mark.parametrize("variant", COMPILED, ids=lambda v: f"stages{v[0]}-{v[1]}")
def test_compiles_for_sm90_without_spills(compiled, variant):
    k = compiled[repr(variant)]
    assert "wgmma.mma_async" in k["ptx"] and "e4m3" in k["ptx"], "products must be e4m3 warpgroup MMAs"
    assert "setmaxnreg" in k["ptx"], "partitions must rebalance registers (producer gives, consumers take)"
    assert "cp.async.bulk.tensor" in k["ptx"], "A and B tiles must arrive by TMA"
    assert k["shared"] <= H100_SHARED, f"{k['shared']} B of shared memory"
    assert "LOCAL:0" in k["usage"], f"register spills:\n{k['usage']}"


def _operands(M: int, N: int, K: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(device)
    w_q, w_s = ref.quantize_fp8_block(w, [128, 128])
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    x_q, x_s = ref.per_token_group_quant_fp8(x, 128)
    return x_q, w_q, x_s, w_s


def test_supports_what_tma_copies():
    from tilellm.kernels import fp8_gemm_hopper as gh

    a, b, _, _ = _operands(64, 256, 256, "cpu")
    assert gh.supports(a, b, [128, 128], torch.bfloat16)
    assert gh.supports(a, b, (128, 128), torch.float16)
    assert not gh.supports(a, b, [128, 128], torch.float32)  # the output is staged in 16 bits
    assert not gh.supports(a, b, [64, 128], torch.bfloat16)  # weight blocks other than 128 x 128
    assert not gh.supports(a[:, 1:129], b[:, :128], [128, 128], torch.bfloat16)  # a row start off 16 bytes
    assert not gh.supports(a.t().contiguous().t(), b, [128, 128], torch.bfloat16)  # A column-major
    assert not gh.supports(a, b[:252], [128, 128], torch.bfloat16)  # output rows off 16 bytes
    a_q, b_q, _, _ = _operands(16, 128, 384, "cpu")
    assert gh.supports(a_q, b_q, [128, 128], torch.bfloat16)  # three k-blocks


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (H100/H200)")

# (M, N, K): rows across the warpgroup halves and 128-row tiles, N past whole 128-row weight
# blocks (576: DeepSeek-V3's kv_a_proj_with_mqa), k-block counts 1, 2, 3, 8 and 24
CASES = [
    (1, 256, 128),
    (63, 128, 256),
    (129, 136, 384),
    (300, 576, 1024),
    (1000, 1024, 3072),
    (4100, 384, 256),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major-scales", "column-major-scales"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
def test_against_the_twin(shape, dtype, column_major):
    from tilellm.kernels import fp8_gemm_hopper as gh

    M, N, K = shape
    a, b, a_s, b_s = _operands(M, N, K, "cuda", seed=M + N)
    if column_major:
        a_s = a_s.t().contiguous().t()  # strides (1, M): the layout cuBLAS reads
    assert gh.supports(a, b, [128, 128], dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    gh.launch_block_fp8_gemm(a, b, a_s, b_s, out)
    expected = ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128], dtype)
    # the tensor cores' fp8 sums against the twin's exact ones, then one 16-bit rounding
    assert_close(out, expected, 1e-2, f"{shape} {dtype}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_ring_depths(stages):
    from tilellm.kernels import fp8_gemm_hopper as gh

    a, b, a_s, b_s = _operands(700, 512, 2048, "cuda", seed=stages)
    out = torch.full((700, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    gh.launch_block_fp8_gemm(a, b, a_s, b_s, out, stages=stages)
    assert_close(out, ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128]), 1e-2, f"stages {stages}")


@pytest.mark.gpu
@needs_hopper
def test_many_tokens_run_the_gluon_kernel(monkeypatch):
    from tilellm.kernels import fp8_gemm_hopper as gh

    calls = []
    launch = gh.launch_block_fp8_gemm

    def counted(a, *args, **kwargs):
        calls.append(a.shape[0])
        launch(a, *args, **kwargs)

    monkeypatch.setattr(gh, "launch_block_fp8_gemm", counted)
    for M in (fp8_gemm.GLUON_MIN_TOKENS - 1, fp8_gemm.GLUON_MIN_TOKENS, 3000):
        a, b, a_s, b_s = _operands(M, 384, 512, "cuda", seed=M)
        got = fp8_gemm.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128])
        assert_close(got, ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128]), 1e-2, f"M={M}")
    assert calls == [fp8_gemm.GLUON_MIN_TOKENS, 3000]
    # operands it does not take (N not a multiple of 8) run the Triton kernel
    a, b, a_s, b_s = _operands(2048, 260, 256, "cuda")
    got = fp8_gemm.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128])
    assert_close(got, ref.w8a8_block_fp8_matmul(a, b, a_s, b_s, [128, 128]), 1e-2, "N=260")
    assert calls == [fp8_gemm.GLUON_MIN_TOKENS, 3000]
