"""FP8 checkpoints: block-scaled and per-tensor ones load as FP8 (weights bit-identical to the
file's, scales equal), tensor-parallel ranks hold the blocks of their rows and columns, layers run
W8A8 (the twin GEMM on the dequantized weights), `quantization="fp8"` quantizes a float
checkpoint as it loads, and bad checkpoints or arguments fail with errors that name the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tilellm.kernels.reference.fp8_gemm import (
    dequantize_fp8_block,
    per_token_group_quant_fp8,
    quantize_fp8_block,
)
from tilellm.models import load_model
from tilellm.models.layers.linear import UNQUANTIZED, QuantizedActivation
from tilellm.models.quantization import Fp8Config, dequantize_linear_, resolve_quantization
from tilellm.testing import dequantize_model_dir, make_tiny_model, make_tiny_moe_model, quantize_model_dir_fp8

BLOCK = (32, 32)
# head_dim 32: every q / k / v shard (64 / 32 / 32 rows per rank at tp_size 2) and gate / up
# shard (64) falls on whole blocks of 32 rows; K (64 or 128, 64 per rank for o_proj / down_proj)
# is a multiple of 32
TINY = dict(head_dim=32, num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_model(root / "src", "Qwen3ForCausalLM", seed=7, vocab_size=383, **TINY)
    block = quantize_model_dir_fp8(src, root / "block", BLOCK)
    return {
        "src": src,
        "block": block,
        "per_tensor": quantize_model_dir_fp8(src, root / "per_tensor", per_tensor=True),
        "dequant": dequantize_model_dir(block, root / "dequant"),
    }


def _load(d, **kw):
    model, _ = load_model(d, device="cpu", attention_backend="reference", **kw)
    return model


def _dequantized(layer) -> torch.Tensor:
    bn, bk = layer.quant_method.block_size
    return dequantize_fp8_block(layer.weight, layer.weight_scale_inv, [bn, bk], torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _merged(sd: dict, prefix: str, parts: tuple[str, ...], suffix: str) -> torch.Tensor:
    return torch.cat([sd[f"{prefix}{p}.{suffix}"] for p in parts])


QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
# the PyTorch twins, and Triton's kernels on the CPU model (under the interpreter: no CUDA)
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.interpreter)]


def _fp8_layers(model) -> list[tuple]:
    """(module, checkpoint prefix, checkpoint parts) of every FP8 linear layer of the tiny Qwen3."""
    out = []
    for i, layer in enumerate(model.model.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out += [
            (layer.self_attn.qkv_proj, a, QKV),
            (layer.self_attn.o_proj, a, ("o_proj",)),
            (layer.mlp.gate_up_proj, m, GATE_UP),
            (layer.mlp.down_proj, m, ("down_proj",)),
        ]
    return out


# ---------------------------------------------------------------------------------------------
# block-scaled checkpoints
# ---------------------------------------------------------------------------------------------


def test_block_checkpoint_loads_fp8_weights_and_scales(dirs):
    sd = load_file(dirs["block"] / "model.safetensors")
    model = _load(dirs["block"])
    for mod, prefix, parts in _fp8_layers(model):
        assert mod.weight.dtype == FP8_DTYPE and mod.quant_method.block_size == BLOCK
        assert _same_bits(mod.weight.data, _merged(sd, prefix, parts, "weight"))
        assert torch.equal(mod.weight_scale_inv, _merged(sd, prefix, parts, "weight_scale_inv"))
    assert all(layer.input_layernorm.weight.dtype == torch.float32 for layer in model.model.layers)
    assert model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_layers_run_the_w8a8_gemm_on_the_dequantized_weights(dirs, backend):
    """y = (x quantized per token and 32-wide group) @ (dequantized W)^T, in fp32: what the block
    GEMM computes exactly up to the order of fp32 additions, with the twin or the Triton kernels
    (the fused-ops backend picks them, as it picks RMSNorm's)."""
    deq = load_file(dirs["dequant"] / "model.safetensors")
    layer = _load(dirs["block"], fused_ops_backend=backend).model.layers[1]
    module = {"reference": "tilellm.kernels.reference.fp8_gemm", "triton": "tilellm.kernels.fp8_gemm"}[
        backend
    ]
    assert layer.mlp.down_proj.quant_method.ops.__name__ == module
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    for mod, name, k in [
        (layer.self_attn.qkv_proj, None, 64),
        (layer.self_attn.o_proj, "model.layers.1.self_attn.o_proj.weight", 128),
        (layer.mlp.down_proj, "model.layers.1.mlp.down_proj.weight", 128),
    ]:
        w = deq[name] if name else _merged(deq, "model.layers.1.self_attn.", QKV, "weight")
        x_q, x_s = per_token_group_quant_fp8(x[:, :k].contiguous(), BLOCK[1])
        x_deq = x_q.float() * x_s.repeat_interleave(BLOCK[1], dim=1)
        torch.testing.assert_close(mod(x[:, :k]), x_deq @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_tokens", [8, 16, 17, 40])
def test_fp8_down_proj_quantizes_silu_and_mul_in_its_launch(dirs, backend, num_tokens, monkeypatch):
    """Steps whose down_proj input is quantized in a launch of its own (more than 16 tokens) get it
    from SiLU-and-mul's launch: the MLP's output is bit-identical to down_proj(silu_and_mul(.));
    steps of up to 16 tokens keep the GEMM's in-kernel quantization."""
    mlp = _load(dirs["block"], fused_ops_backend=backend).model.layers[1].mlp
    ops, calls = mlp.act_fn.ops, []
    fused = ops.silu_and_mul_per_token_group_quant_fp8
    monkeypatch.setattr(
        ops, "silu_and_mul_per_token_group_quant_fp8", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(3))
    got = mlp(x)
    want = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)))
    assert torch.equal(got, want)
    assert len(calls) == (1 if num_tokens > 16 else 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_tokens", [16, 17, 40])
@pytest.mark.parametrize("first_layer", [False, True])  # no residual yet in the first layer
def test_fp8_qkv_and_gate_up_take_their_input_quantized_in_the_norms_launch(
    dirs, backend, num_tokens, first_layer, monkeypatch
):
    """Steps whose qkv_proj / gate_up_proj input is quantized in a launch of its own (more than 16
    tokens) get it from the RMSNorm before, as a `QuantizedActivation`: the layers' outputs and
    the residual bit-identical to the norm then the layer; up to 16 tokens the norm returns the
    tensor and the GEMM quantizes as it loads."""
    layer = _load(dirs["block"], fused_ops_backend=backend).model.layers[1]
    ops, calls = layer.input_layernorm.ops, []
    fused = ops.rms_norm_per_token_group_quant_fp8
    monkeypatch.setattr(
        ops, "rms_norm_per_token_group_quant_fp8", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    gen = torch.Generator().manual_seed(num_tokens)
    x, residual = torch.randn(num_tokens, 64, generator=gen), torch.randn(num_tokens, 64, generator=gen)
    assert layer.self_attn.input_linear is layer.self_attn.qkv_proj
    assert layer.mlp.input_linear is layer.mlp.gate_up_proj
    for norm, linear in [
        (layer.input_layernorm, layer.self_attn.qkv_proj),
        (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
    ]:
        if first_layer:
            got, want = norm(x, quant_for=linear), norm(x)
        else:
            (got, got_res), (want, want_res) = norm(x, residual, quant_for=linear), norm(x, residual)
            assert torch.equal(got_res, want_res)
        assert isinstance(got, QuantizedActivation) == (num_tokens > 16)
        assert torch.equal(linear(got), linear(want))
    assert len(calls) == (2 if num_tokens > 16 else 0)


def test_moe_and_mla_blocks_name_no_single_input_linear(tmp_path):
    """An MoE block's input goes to its router and experts, MLA's to several projections: the
    norms before them quantize nothing (`PreNormDecoderLayer` finds no `input_linear`); DeepSeek's
    dense first layer's MLP names its gate_up_proj."""
    src = make_tiny_moe_model(tmp_path / "src", vocab_size=383)
    layers = _load(quantize_model_dir_fp8(src, tmp_path / "fp8", (16, 16))).model.layers
    assert layers[0].mlp.input_linear is layers[0].mlp.gate_up_proj
    assert layers[0].mlp.gate_up_proj.input_group_quant(32) == (16, False)
    for layer in layers[1:]:
        assert getattr(layer.mlp, "input_linear", None) is None
    assert all(layer.self_attn.input_linear is None for layer in layers)  # no q_lora_rank: q_proj


def test_deepseek_q_and_latent_down_projections_run_as_one_fp8_gemm(tmp_path):
    """DeepSeek-V3 (q_lora_rank): q_a_proj and kv_a_proj_with_mqa load into `fused_qkv_a_proj`,
    their FP8 weights and block scales stacked bit for bit; the input norm quantizes for it from
    17 tokens and its output equals the norm then the layer. (The twins: the tiny model's 48-wide
    q latent needs blocks of 16, and the Triton GEMM's k-blocks are at least 32 wide.)"""
    src = make_tiny_moe_model(tmp_path / "src", "DeepseekV3ForCausalLM", q_lora_rank=48, vocab_size=383)
    d = quantize_model_dir_fp8(src, tmp_path / "fp8", (16, 16))
    sd = load_file(d / "model.safetensors")
    layer = _load(d).model.layers[1]
    fused = layer.self_attn.fused_qkv_a_proj
    parts = ("q_a_proj", "kv_a_proj_with_mqa")
    assert _same_bits(fused.weight.data, _merged(sd, "model.layers.1.self_attn.", parts, "weight"))
    assert torch.equal(
        fused.weight_scale_inv, _merged(sd, "model.layers.1.self_attn.", parts, "weight_scale_inv")
    )
    assert layer.self_attn.input_linear is fused
    x, residual = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    (got, got_res), (want, want_res) = (
        layer.input_layernorm(x, residual, quant_for=fused),
        layer.input_layernorm(x, residual),
    )
    assert isinstance(got, QuantizedActivation) and torch.equal(got_res, want_res)
    assert torch.equal(fused(got), fused(want))


@pytest.mark.interpreter
def test_layer_of_a_partial_last_block_runs_cublas_on_whole_blocks(monkeypatch):
    """cuBLAS's block-scaled GEMM takes N in whole blocks of rows: a layer whose last block is
    partial (DeepSeek-V3's fused_qkv_a_proj: 1536 + 576 rows; here 32 + 16 in blocks of 32) holds
    its weight zero-padded to whole blocks for it, and its output is the block GEMM's, the padding
    columns dropped. (cuBLAS stood in for by the twin GEMM, refusing partial blocks as it does.)"""
    from tilellm.kernels import fp8_gemm
    from tilellm.kernels.reference import fp8_gemm as ref_gemm
    from tilellm.models import quantization
    from tilellm.models.layers.linear import MergedColumnParallelLinear
    from tilellm.models.quantization import Fp8LinearMethod

    def cublas(a, b, a_s, b_s, block_size, dtype):
        if b.shape[0] % block_size[0]:
            raise AssertionError("N must be whole blocks")
        calls.append(tuple(b.shape))
        return ref_gemm.w8a8_block_fp8_matmul(a, b, a_s, b_s, block_size, dtype)

    calls: list[tuple] = []
    monkeypatch.setattr(fp8_gemm, "scaled_mm_block_unavailable", lambda device, block, n: None)
    monkeypatch.setattr(fp8_gemm, "scaled_mm_block_fp8", cublas)
    monkeypatch.setattr(quantization, "SCALED_MM_MIN_TOKENS", 32)  # the interpreter's GEMMs are slow
    gen = torch.Generator().manual_seed(4)
    layer = MergedColumnParallelLinear(64, [32, 16])
    layer.weight.data = torch.randn(48, 64, generator=gen)
    layer.quant_method = Fp8LinearMethod((32, 32), fp8_gemm, online=True)
    layer.process_weights_after_loading(torch.float32)
    assert layer.quant_method.use_scaled_mm and layer.scaled_mm_weight.shape == (64, 64)
    assert _same_bits(layer.scaled_mm_weight[:48], layer.weight.data)
    assert not layer.scaled_mm_weight[48:].float().any()
    assert layer.weight.data_ptr() == layer.scaled_mm_weight.data_ptr()  # one copy of the weight
    x = torch.randn(32, 64, generator=gen)
    x_q, x_s = per_token_group_quant_fp8(x, 32)
    want = (x_q.float() * x_s.repeat_interleave(32, dim=1)) @ _dequantized(layer).T
    got = layer(x)
    assert calls == [(64, 64)] and got.shape == (32, 48)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dequantize_linear_(layer, torch.float32)
    assert not hasattr(layer, "scaled_mm_weight")


def test_deepseek_experts_mla_and_indexer(tmp_path):
    """DeepSeek-V3.2 in [16, 16] blocks: the experts load as FP8 with the file's scales; MLA's
    kv_b_proj, read raw, is dequantized once loaded; the router and the indexer's fp32
    weights_proj stay unquantized, its wq_b and wk are FP8."""
    src = make_tiny_moe_model(tmp_path / "src", "DeepseekV32ForCausalLM", q_lora_rank=48, vocab_size=383)
    d = quantize_model_dir_fp8(src, tmp_path / "fp8", (16, 16))
    sd = load_file(d / "model.safetensors")
    layer = _load(d).model.layers[1]
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    kv_b = layer.self_attn.kv_b_proj
    assert kv_b.quant_method is UNQUANTIZED and not hasattr(kv_b, "weight_scale_inv")
    want = dequantize_fp8_block(
        sd[a + "kv_b_proj.weight"], sd[a + "kv_b_proj.weight_scale_inv"], [16, 16], torch.float32
    )
    assert torch.equal(kv_b.weight, want)
    indexer = layer.self_attn.indexer
    assert indexer.weights_proj.weight.dtype == torch.float32 and indexer.wq_b.weight.dtype == FP8_DTYPE
    # the indexer reads the block's input beside fused_qkv_a_proj: the norm quantizes nothing
    assert layer.self_attn.fused_qkv_a_proj.weight.dtype == FP8_DTYPE and layer.self_attn.input_linear is None
    assert layer.mlp.gate.weight.dtype == torch.float32
    experts = layer.mlp.experts
    for param, parts in [("w13_weight", GATE_UP), ("w2_weight", ("down_proj",))]:
        for suffix in ("", "_scale_inv"):
            name = "weight" + suffix
            want = torch.stack([_merged(sd, f"{m}experts.{e}.", parts, name) for e in range(8)])
            got = getattr(experts, param + suffix).data
            assert _same_bits(got, want) if not suffix else torch.equal(got, want)


def test_modules_to_not_convert_stay_in_the_model_dtype(dirs, tmp_path):
    d = quantize_model_dir_fp8(dirs["src"], tmp_path / "q", BLOCK, not_convert=("model.layers.0.mlp",))
    model = _load(d)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.down_proj.quant_method is UNQUANTIZED
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == FP8_DTYPE


def test_dummy_fp8_weights_behave_like_quantized_normal(dirs):
    layer = _load(dirs["block"], load_format="dummy").model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == FP8_DTYPE
    w = _dequantized(layer)
    assert abs(w.std().item() - 0.02) < 0.002 and w.abs().max().item() <= 4 * 0.02 + 1e-6


# ---------------------------------------------------------------------------------------------
# per-tensor checkpoints
# ---------------------------------------------------------------------------------------------


def test_per_tensor_checkpoint_becomes_block_scales(dirs):
    """gate_up's shards (128 rows each) fall on blocks of 128 rows, qkv's (128 / 64 / 64 rows) on
    blocks of 64 (`per_tensor_rows`): each shard keeps its own scale and the file's values bit for
    bit. K = 64 < 128: one 64-wide group per token."""
    sd = load_file(dirs["per_tensor"] / "model.safetensors")
    model = _load(dirs["per_tensor"])
    m, a = "model.layers.0.mlp.", "model.layers.0.self_attn."
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert gate_up.quant_method.block_size == (128, 64)
    scales = [sd[f"{m}{p}.weight_scale"].item() for p in GATE_UP]
    assert gate_up.weight_scale_inv.flatten().tolist() == pytest.approx(scales, rel=0)
    assert _same_bits(gate_up.weight.data, _merged(sd, m, GATE_UP, "weight"))

    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.block_size == (64, 64)
    q, k, v = (sd[f"{a}{p}.weight_scale"].item() for p in QKV)
    assert qkv.weight_scale_inv.flatten().tolist() == pytest.approx([q, q, k, v], rel=0)
    assert _same_bits(qkv.weight.data, _merged(sd, a, QKV, "weight"))

    down = model.model.layers[0].mlp.down_proj  # K = 128: blocks of 128 x 128
    assert down.quant_method.block_size == (128, 128)
    assert down.weight_scale_inv.flatten().tolist() == pytest.approx(
        [sd[m + "down_proj.weight_scale"].item()]
    )


def test_per_tensor_shards_off_every_block_are_requantized_to_the_largest_scale(tmp_path):
    """head_dim 8 and one KV head: k and v have 8 rows each, on no block of 16 or more rows, so
    qkv's shards all move to the largest scale (vLLM's rule), which moves a value by at most
    half a step of the coarser grid."""
    src = make_tiny_model(tmp_path / "src", "Qwen3ForCausalLM", vocab_size=383, head_dim=8, num_kv_heads=1)
    d = quantize_model_dir_fp8(src, tmp_path / "q", per_tensor=True)
    sd = load_file(d / "model.safetensors")
    a = "model.layers.0.self_attn."
    qkv = _load(d).model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.block_size[0] == 128
    top = max(sd[f"{a}{p}.weight_scale"].item() for p in QKV)
    assert len({sd[f"{a}{p}.weight_scale"].item() for p in QKV}) > 1
    assert qkv.weight_scale_inv.flatten().tolist() == pytest.approx([top], rel=0)
    want = torch.cat([sd[f"{a}{p}.weight"].float() * sd[f"{a}{p}.weight_scale"] for p in QKV])
    torch.testing.assert_close(_dequantized(qkv), want, rtol=2**-4, atol=top * 2**-9)


def test_per_tensor_ranks_hold_the_single_rank_values(dirs):
    """At tensor_parallel_size 2 gate_up's shards (64 rows a rank) fall on blocks of 64 rows: each
    rank holds exactly its rows of the one-rank weights (no requantization that one rank would
    not do)."""
    whole = _dequantized(_load(dirs["per_tensor"]).model.layers[0].mlp.gate_up_proj)
    gate, up = whole[:128], whole[128:]
    for rank in range(2):
        part = _load(dirs["per_tensor"], tp_rank=rank, tp_size=2).model.layers[0].mlp.gate_up_proj
        assert part.quant_method.block_size[0] == 64
        rows = slice(rank * 64, (rank + 1) * 64)
        torch.testing.assert_close(_dequantized(part), torch.cat([gate[rows], up[rows]]), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# tensor parallelism: each rank's blocks are the blocks of its rows / columns
# ---------------------------------------------------------------------------------------------


def test_tensor_parallel_ranks_hold_their_slices_of_the_dequantized_weights(dirs):
    deq = load_file(dirs["dequant"] / "model.safetensors")
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    for rank in range(2):
        layer = _load(dirs["block"], tp_rank=rank, tp_size=2).model.layers[0]

        def rows(name: str, n: int, rank: int = rank) -> torch.Tensor:
            return deq[name][rank * n : (rank + 1) * n]

        qkv = torch.cat(
            [rows(a + "q_proj.weight", 64), rows(a + "k_proj.weight", 32), rows(a + "v_proj.weight", 32)]
        )
        torch.testing.assert_close(_dequantized(layer.self_attn.qkv_proj), qkv, rtol=0, atol=0)
        gate_up = torch.cat([rows(m + "gate_proj.weight", 64), rows(m + "up_proj.weight", 64)])
        torch.testing.assert_close(_dequantized(layer.mlp.gate_up_proj), gate_up, rtol=0, atol=0)
        for mod, name in [
            (layer.self_attn.o_proj, a + "o_proj.weight"),
            (layer.mlp.down_proj, m + "down_proj.weight"),
        ]:
            want = deq[name][:, rank * 64 : (rank + 1) * 64]
            torch.testing.assert_close(_dequantized(mod), want, rtol=0, atol=0)


def test_misaligned_tensor_parallel_shard_is_named(tmp_path):
    """head_dim 16: k_proj's 16 rows per rank would split a 32-row scale block."""
    src = make_tiny_model(tmp_path / "src", "Qwen3ForCausalLM", vocab_size=383)
    d = quantize_model_dir_fp8(src, tmp_path / "q", BLOCK)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj shard 'k'.*16 rows.*block of 32"
    ):
        _load(d, tp_rank=1, tp_size=2)


# ---------------------------------------------------------------------------------------------
# online quantization
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_online_quantization_of_a_float_checkpoint(tmp_path, dtype):
    src = make_tiny_model(
        tmp_path, "LlamaForCausalLM", vocab_size=383, dtype=dtype, hidden_size=128,
        head_dim=32, intermediate_size=256, tie_word_embeddings=False,
    )  # fmt: skip
    sd = load_file(tmp_path / "model.safetensors")
    model = _load(src, dtype="auto", quantization="fp8")
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.quant_method.block_size == (128, 128)
    w_q, scale = quantize_fp8_block(_merged(sd, "model.layers.1.self_attn.", QKV, "weight"), [128, 128])
    assert _same_bits(qkv.weight.data, w_q) and torch.equal(qkv.weight_scale_inv, scale)
    assert model.lm_head.weight.dtype == getattr(torch, dtype)


def test_online_quantization_needs_block_multiple_inputs(dirs):
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj: its 64 input features"):
        _load(dirs["src"], quantization="fp8")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def _rewrite(d, tmp_path, *, config=None, drop=(), retype=()):
    """A copy of checkpoint `d` with config.json's quantization_config replaced and tensors dropped
    or cast to float32."""
    out = tmp_path / "copy"
    out.mkdir()
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = config
        (out / "config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "model.safetensors")
    sd = {k: (v.float() if k in retype else v) for k, v in sd.items() if k not in drop}
    save_file(sd, str(out / "model.safetensors"))
    return out


def test_unknown_quant_method_is_named(dirs, tmp_path):
    d = _rewrite(dirs["src"], tmp_path, config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match=r"quant_method 'awq' is not supported; supported: 'fp8'"):
        _load(d)
    assert Fp8Config.from_config({}) is None


def test_unsupported_quantization_argument(dirs):
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported; choose one of None, 'fp8'"):
        _load(dirs["src"], quantization="int4")
    assert resolve_quantization({}, None) == (None, False)


def test_missing_weight_scale_is_named(dirs, tmp_path):
    d = _rewrite(dirs["block"], tmp_path, drop={"model.layers.1.self_attn.k_proj.weight_scale_inv"})
    with pytest.raises(
        ValueError, match=r"missing weight\(s\) 'model\.layers\.1\.self_attn\.k_proj\.weight_scale_inv'"
    ):
        _load(d)


def test_unquantized_tensor_for_an_fp8_layer_is_refused(dirs, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    d = _rewrite(dirs["block"], tmp_path, retype={name})
    with pytest.raises(ValueError, match=rf"{name}.*float32 but the parameter is torch\.float8_e4m3fn"):
        _load(d)


def test_wrong_scale_shape_is_named(dirs, tmp_path):
    """A checkpoint quantized in 32-row blocks read as 64-row ones: the scales' shape tells."""
    wrong = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 32]}
    d = _rewrite(dirs["block"], tmp_path, config=wrong)
    with pytest.raises(
        ValueError,
        match=r"weight_scale_inv' from .*has shape \(\d+, \d+\), expected .*one scale per \[64, 32\] block",
    ):
        _load(d)


# ---------------------------------------------------------------------------------------------
# static activation scales (per-tensor checkpoints, activation_scheme "static")
# ---------------------------------------------------------------------------------------------


def _static_dequantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x quantized by one static scale (saturating at +-448) and dequantized, in fp32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def test_static_checkpoint_loads_each_layers_largest_input_scale(dirs, tmp_path):
    """The file's `X.input_scale`s are loaded; a merged layer keeps the largest of its parts' (they
    all quantize the same input once), a single layer its own. Calibration gives q, k and v (gate
    and up) one scale, as they read one input; here each part gets its own, so the largest is a
    real choice."""
    d = _rewrite(dirs["per_tensor"], tmp_path)
    sd = load_file(d / "model.safetensors")
    assert json.loads((d / "config.json").read_text())["quantization_config"]["activation_scheme"] == "static"
    for n, name in enumerate(sorted(k for k in sd if k.endswith("input_scale"))):
        sd[name] = sd[name] * (1 + n % 3 / 4)
    save_file(sd, str(d / "model.safetensors"))
    model = _load(d)
    for mod, prefix, parts in _fp8_layers(model):
        scales = [sd[f"{prefix}{p}.input_scale"].item() for p in parts]
        assert mod.quant_method.static_activations and "static" in repr(mod.quant_method)
        assert mod.input_scale.shape == (1,) and mod.input_scale.item() == max(scales)
        assert len(parts) == 1 or len(set(scales)) > 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_tokens", [5, 40])  # in-GEMM quantization (<= 16 tokens), then two passes
def test_static_layers_quantize_their_input_by_the_input_scale(dirs, backend, num_tokens):
    """y = (x quantized by the layer's one input scale) @ (its dequantized W)^T in fp32, inputs
    beyond 448 x scale saturating: with the twin and with the Triton kernels; and not the
    per-token-group product (the static scale is what runs)."""
    model = _load(dirs["per_tensor"], fused_ops_backend=backend)
    gen = torch.Generator().manual_seed(num_tokens)
    for mod in (model.model.layers[1].self_attn.o_proj, model.model.layers[0].mlp.gate_up_proj):
        s = mod.input_scale.item()
        x = torch.randn(num_tokens, mod.in_features, generator=gen) * (100 * s)
        x[0, 0] = 1000 * s  # past 448 x s: saturates
        w = _dequantized(mod)
        torch.testing.assert_close(mod(x), _static_dequantized(x, s) @ w.T, rtol=1e-5, atol=1e-5)
        x_q, x_s = per_token_group_quant_fp8(x, mod.quant_method.block_size[1])
        dynamic = (x_q.float() * x_s.repeat_interleave(mod.quant_method.block_size[1], dim=1)) @ w.T
        assert not torch.allclose(mod(x), dynamic, rtol=1e-3, atol=1e-3)


@pytest.mark.interpreter
def test_static_layers_run_scaled_mm_for_many_tokens(dirs, monkeypatch):
    """With the Triton kernels (where torch has a scaled_mm: on the CPU always), a static layer's
    many-token steps run `scaled_mm_fp8` on the input scale folded into its weight scales: one
    number for a single matrix, one per output row for a merged layer whose shards' scales differ.
    The product is the same as the block GEMM's, and the twins' backend never takes this path."""
    from tilellm.kernels import fp8_gemm
    from tilellm.models import quantization

    model = _load(dirs["per_tensor"], fused_ops_backend="triton")
    calls = []
    real = fp8_gemm.scaled_mm_fp8
    monkeypatch.setattr(fp8_gemm, "scaled_mm_fp8", lambda *a: calls.append(a[3].numel()) or real(*a))
    monkeypatch.setattr(quantization, "SCALED_MM_MIN_TOKENS", 24)  # the interpreter's GEMMs are slow
    gen = torch.Generator().manual_seed(5)
    qkv, o = model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].self_attn.o_proj
    for mod in (qkv, o):
        s = mod.input_scale.item()
        assert mod.quant_method.use_scaled_mm
        rows = mod.weight_scale_inv[:, :1].repeat_interleave(mod.quant_method.block_size[0], 0)[:, 0]
        expected_b = s * rows if mod is qkv else s * rows[:1]
        torch.testing.assert_close(mod.scaled_mm_scale_b, expected_b.float(), rtol=0, atol=0)
        x = torch.randn(24, mod.in_features, generator=gen) * (100 * s)
        x[0, 0] = 1000 * s  # past 448 x s: saturates
        torch.testing.assert_close(
            mod(x), _static_dequantized(x, s) @ _dequantized(mod).T, rtol=1e-5, atol=1e-5
        )
        calls_before = len(calls)
        mod(x[:23])  # below the threshold: the block GEMM
        assert len(calls) == calls_before
    assert calls == [qkv.out_features, 1]
    assert len(set(qkv.scaled_mm_scale_b.tolist())) > 1, "the tiny qkv's shards share one scale"
    assert not _load(dirs["per_tensor"]).model.layers[0].self_attn.o_proj.quant_method.use_scaled_mm
    dequantize_linear_(o, torch.float32)  # read raw from then on: the folded scales go too
    assert not hasattr(o, "scaled_mm_scale_b") and not hasattr(o, "input_scale")


@pytest.mark.interpreter
def test_static_layer_with_scales_varying_along_a_row_keeps_the_block_gemm(tmp_path, monkeypatch):
    """A per-tensor static checkpoint whose down_proj ships block-shaped scales (two k-blocks, the
    second 4x the first: loaded as block scales) has no one scale per row, so the layer keeps the
    block GEMM at every size and its product stays right."""
    from tilellm.models import quantization

    src = make_tiny_model(
        tmp_path / "src", "Qwen3ForCausalLM", seed=7, vocab_size=383, **{**TINY, "intermediate_size": 256}
    )
    d = _rewrite(quantize_model_dir_fp8(src, tmp_path / "pt", per_tensor=True), tmp_path)
    sd = load_file(d / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight_scale"
    scale = torch.full((1, 2), float(sd[key]))
    scale[:, 1] *= 4
    sd[key] = scale
    save_file(sd, str(d / "model.safetensors"))
    down = _load(d, fused_ops_backend="triton").model.layers[0].mlp.down_proj
    assert down.weight_scale_inv.shape == (1, 2) and not down.quant_method.use_scaled_mm
    monkeypatch.setattr(quantization, "SCALED_MM_MIN_TOKENS", 24)
    s = down.input_scale.item()
    x = torch.randn(24, down.in_features, generator=torch.Generator().manual_seed(0)) * (50 * s)
    torch.testing.assert_close(
        down(x), _static_dequantized(x, s) @ _dequantized(down).T, rtol=1e-5, atol=1e-5
    )


def test_per_tensor_checkpoint_with_dynamic_activations(dirs, tmp_path):
    """activation_scheme "dynamic" on per-tensor weights: no input scales needed; any in the file
    are not read, and the layers quantize per token and group."""
    d = quantize_model_dir_fp8(dirs["src"], tmp_path / "dyn", per_tensor=True, activation_scheme="dynamic")
    assert not any(k.endswith("input_scale") for k in load_file(d / "model.safetensors"))
    down = _load(d).model.layers[0].mlp.down_proj
    assert not down.quant_method.static_activations and not hasattr(down, "input_scale")
    cfg = json.loads((dirs["per_tensor"] / "config.json").read_text())["quantization_config"]
    with_scales = _rewrite(dirs["per_tensor"], tmp_path, config={**cfg, "activation_scheme": "dynamic"})
    assert not hasattr(_load(with_scales).model.layers[0].mlp.down_proj, "input_scale")


def test_dummy_weights_get_a_static_input_scale(dirs):
    from tilellm.models.quantization import DUMMY_INPUT_SCALE

    model = _load(dirs["per_tensor"], load_format="dummy")
    scale = model.model.layers[0].self_attn.qkv_proj.input_scale
    assert torch.equal(scale, torch.tensor([DUMMY_INPUT_SCALE], dtype=torch.float32))


def test_static_scheme_on_a_block_checkpoint_is_refused(dirs, tmp_path):
    static = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": list(BLOCK)}
    d = _rewrite(dirs["block"], tmp_path, config=static)
    with pytest.raises(ValueError, match=r"activation_scheme 'static' is only supported with per-tensor"):
        _load(d)


def test_missing_input_scale_is_named(dirs, tmp_path):
    d = _rewrite(dirs["per_tensor"], tmp_path, drop={"model.layers.1.self_attn.v_proj.input_scale"})
    with pytest.raises(
        ValueError, match=r"missing weight\(s\) 'model\.layers\.1\.self_attn\.v_proj\.input_scale'"
    ):
        _load(d)


@pytest.mark.parametrize("bad", [-0.5, 0.0, float("inf"), [0.1, 0.2]])
def test_bad_input_scale_is_named(dirs, tmp_path, bad):
    name = "model.layers.0.mlp.up_proj.input_scale"
    d = _rewrite(dirs["per_tensor"], tmp_path)
    sd = load_file(d / "model.safetensors")
    sd[name] = torch.tensor(bad)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"cannot load tensor '{name}'.*input_scale must"):
        _load(d)


def test_static_scheme_without_any_input_scale_says_what_to_change(dirs, tmp_path):
    sd = load_file(dirs["per_tensor"] / "model.safetensors")
    d = _rewrite(dirs["per_tensor"], tmp_path, drop={k for k in sd if k.endswith("input_scale")})
    with pytest.raises(ValueError, match=r"no input_scale tensors; set activation_scheme to 'dynamic'"):
        _load(d)
