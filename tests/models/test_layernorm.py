"""RMSNorm that quantizes its output for the FP8 linear layer reading it (`RMSNorm.forward`'s
`quant_for`): a whole prefill of more than 16 tokens through the model (`PreNormDecoderLayer`)
with the norms' quantization against the same model with it switched off gives the same hidden
states bit for bit, on both fused-ops backends (Triton under the interpreter on CPU), for a bf16
Qwen3, Qwen2 (biases on q/k/v), DeepSeek-V2 (dense first layer, MoE, MLA without q_lora_rank) and
DeepSeek-V3 (`fused_qkv_a_proj`); the fused op runs exactly where one FP8 linear reads the norm's
output; layers the fused op cannot serve quantize their input themselves."""

from __future__ import annotations

import pytest
import torch

from tests.models.paged import PagedKV
from tilellm.attention import BatchKind, attention_context
from tilellm.models import load_model
from tilellm.models.layers.linear import LinearBase
from tilellm.testing import make_tiny_model, make_tiny_moe_model, quantize_model_dir_fp8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    tiny = dict(head_dim=32, num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=128)
    out = {}
    for name, arch in [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]:
        src = make_tiny_model(root / name, arch, seed=5, vocab_size=383, dtype="bfloat16", **tiny)
        out[name] = quantize_model_dir_fp8(src, root / f"{name}_fp8", (32, 32))
    src = make_tiny_moe_model(root / "dsv2", seed=3, vocab_size=383)
    out["deepseek_v2"] = quantize_model_dir_fp8(src, root / "dsv2_fp8", (32, 32))
    # a 48-wide q latent: blocks of 16, which only the twin GEMM runs (Triton's needs k-blocks >= 32)
    src = make_tiny_moe_model(root / "dsv3", "DeepseekV3ForCausalLM", seed=4, q_lora_rank=48, vocab_size=383)
    out["deepseek_v3"] = quantize_model_dir_fp8(src, root / "dsv3_fp8", (16, 16))
    return out


def _prefill(model_dir, backend, lens):
    model, _ = load_model(model_dir, device="cpu", attention_backend="reference", fused_ops_backend=backend)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 380, (n,), generator=gen).tolist() for n in lens]
    kv = PagedKV(model, num_requests=len(prompts), max_len=max(lens))
    ids, positions, meta = kv.step(BatchKind.PREFILL, list(enumerate(prompts)))
    with torch.no_grad(), attention_context(meta):
        return model(ids, positions), model


# the PyTorch twins, and Triton's kernels on the CPU model (under the interpreter: no CUDA)
TRITON_ON_CPU = pytest.mark.interpreter
CASES = [
    pytest.param(name, backend, marks=TRITON_ON_CPU) if backend == "triton" else (name, backend)
    for name in ("qwen3", "qwen2", "deepseek_v2")
    for backend in ("reference", "triton")
] + [("deepseek_v3", "reference")]


@pytest.mark.parametrize("name, backend", CASES)
@pytest.mark.parametrize("lens", [[9, 8], [20, 13]], ids=["17tok", "33tok"])
def test_prefill_with_the_norms_quantization_is_bit_identical(ckpts, name, backend, lens, monkeypatch):
    model_dir = ckpts[name]
    import tilellm.kernels.fused as tf
    import tilellm.kernels.reference.fused as rf

    ops = tf if backend == "triton" else rf
    calls = []
    real = ops.rms_norm_per_token_group_quant_fp8
    monkeypatch.setattr(
        ops, "rms_norm_per_token_group_quant_fp8", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    fused_out, model = _prefill(model_dir, backend, lens)
    n_fused = len(calls)
    with monkeypatch.context() as m:  # the norms hand every linear a tensor
        m.setattr(LinearBase, "input_group_quant", lambda self, n: None)
        plain_out, _ = _prefill(model_dir, backend, lens)
    assert torch.equal(fused_out, plain_out)
    # one fused norm per FP8 qkv_proj / gate_up_proj that is its block's only reader
    want = sum(
        (getattr(layer.self_attn, "input_linear", None) is not None)
        + (getattr(layer.self_attn, "q_latent_linear", None) is not None)  # DeepSeek's q_a_layernorm
        + (getattr(layer.mlp, "input_linear", None) is not None)
        for layer in model.model.layers
    )
    assert n_fused == want > 0
    if name == "deepseek_v3":  # the attention's input goes to fused_qkv_a_proj alone, q's latent to q_b_proj
        attns = [layer.self_attn for layer in model.model.layers]
        assert all(a.input_linear is a.fused_qkv_a_proj and a.q_latent_linear is a.q_b_proj for a in attns)


def test_per_tensor_layer_of_non_power_of_two_group_prefills(tmp_path):
    """A per-tensor dynamic checkpoint whose hidden size is no multiple of 32 holds qkv_proj and
    gate_up_proj in groups of the whole K (48: `per_tensor_group`), which the twin GEMM runs; the
    norms must leave such layers their own quantization (the fused op needs a power of two)."""
    src = make_tiny_model(
        tmp_path / "src", "Qwen3ForCausalLM", seed=1, hidden_size=48, head_dim=16, num_heads=3,
        num_kv_heads=1, intermediate_size=96,
    )  # fmt: skip
    fp8 = quantize_model_dir_fp8(src, tmp_path / "pt", per_tensor=True, activation_scheme="dynamic")
    out, model = _prefill(fp8, "reference", [20])
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.block_size[1] == 48
    assert out.shape == (20, 48) and bool(out.isfinite().all())


@TRITON_ON_CPU
def test_column_major_scales_after_a_scaled_mm_refusal(tmp_path, monkeypatch):
    """A layer that runs cuBLAS's GEMM at 256 tokens asks the norm for column-major scales; where
    cuBLAS then refuses, the Triton GEMM takes the column-major scales as they are: the same
    output as the unfused path on the Triton GEMM (row-major scales)."""
    import tilellm.kernels.fp8_gemm as fg

    src = make_tiny_model(
        tmp_path / "src", "Qwen3ForCausalLM", seed=5, vocab_size=383, dtype="bfloat16",
        head_dim=32, num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=128,
    )  # fmt: skip
    model, _ = load_model(
        quantize_model_dir_fp8(src, tmp_path / "fp8", (32, 32)), device="cpu",
        attention_backend="reference", fused_ops_backend="triton",
    )  # fmt: skip
    refused = []

    def refuse(*args):
        refused.append(args[2].stride())  # the activation scales cuBLAS was handed
        raise RuntimeError("no algorithm (test)")

    monkeypatch.setattr(fg, "scaled_mm_block_fp8", refuse)
    layer = model.model.layers[0]
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    res = torch.randn(256, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for norm, linear in [
        (layer.input_layernorm, layer.self_attn.qkv_proj),
        (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
    ]:
        linear.quant_method.use_scaled_mm = True
        (qa, _), (y, _) = norm(x, res, quant_for=linear), norm(x, res)
        assert qa.column_major_scales and qa.x_s.stride() == (1, 256)
        got = linear(qa)  # refused: Triton's GEMM on the column-major scales
        assert refused[-1] == (1, 256) and linear.quant_method.use_scaled_mm is False
        assert torch.equal(got, linear(y))  # now row-major, Triton's GEMM
