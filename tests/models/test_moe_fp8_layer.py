"""`FusedMoE` with FP8 experts: `enable_fp8`'s parameters, loading fp8 checkpoint tensors with
block or per-tensor scales through `weight_loader` (one rank, and two tensor-parallel ranks whose
partial sums add up), online quantization of loaded experts, the errors, and a tiny DeepSeek-V3
checkpoint in both released FP8 forms through the model loader.

The checkpoint is built per expert as the HF directories hold it: gate_proj / up_proj [I, H] and
down_proj [H, I] in e4m3 with `weight_scale_inv` [cdiv(rows, bn), cdiv(cols, bk)] (or a scalar
`weight_scale`); the expected output is the fused-MoE twin on the same matrices stacked by hand.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import tilellm.kernels.moe as triton_moe
import tilellm.kernels.reference.moe as ref
from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8
from tilellm.kernels.reference.fp8_gemm import quantize_fp8_block
from tilellm.models import load_model
from tilellm.models.layers.moe import FusedMoE, quantize_experts_fp8
from tilellm.testing import make_tiny_moe_model, quantize_model_dir_fp8

E, H, I, T, K = 4, 64, 128, 11, 2
BLOCK = (32, 32)
MATRICES = ("gate_proj", "up_proj", "down_proj")

# the twin, and the Triton kernel on CPU tensors (under the interpreter: no CUDA)
OPS = [
    pytest.param(ref, id="reference"),
    pytest.param(triton_moe, id="triton", marks=pytest.mark.interpreter),
]


def checkpoint(
    per_tensor: bool = False, seed: int = 0
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(expert, matrix) -> (e4m3 weight, its scale: block [cdiv(rows, bn), cdiv(cols, bk)] or 0-d)."""
    gen = torch.Generator().manual_seed(seed)
    ckpt = {}
    for e in range(E):
        for m in MATRICES:
            shape = (H, I) if m == "down_proj" else (I, H)
            w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            if per_tensor:
                scale = w.abs().amax() / FP8_MAX
                ckpt[e, m] = (quantize_fp8(w, scale), scale)
            else:
                ckpt[e, m] = quantize_fp8_block(w, list(BLOCK))
    return ckpt


def stacked(ckpt, num_experts=E, hidden=H, inter=I) -> tuple[torch.Tensor, ...]:
    """(w13, w2, w13_scale, w2_scale): the whole (one-rank) fp8 experts and their block scales,
    stacked by hand; a per-tensor scale repeated over its matrix's blocks."""
    bn, bk = BLOCK

    def blocks(e, m, shape):
        scale = ckpt[e, m][1]
        return scale.expand(shape) if scale.dim() == 0 else scale

    experts = range(num_experts)
    w13 = torch.stack([torch.cat([ckpt[e, "gate_proj"][0], ckpt[e, "up_proj"][0]]) for e in experts])
    w2 = torch.stack([ckpt[e, "down_proj"][0] for e in experts])
    half = (inter // bn, hidden // bk)
    w13_s = torch.stack(
        [torch.cat([blocks(e, "gate_proj", half), blocks(e, "up_proj", half)]) for e in experts]
    )
    w2_s = torch.stack([blocks(e, "down_proj", (hidden // bn, inter // bk)) for e in experts])
    return w13, w2, w13_s, w2_s


def load(layer: FusedMoE, ckpt, scale_shape=None) -> None:
    """Every (expert, matrix) weight and scale through weight_loader, as the model loader calls it."""
    for (e, m), (w, scale) in ckpt.items():
        w_param = layer.w2_weight if m == "down_proj" else layer.w13_weight
        s_param = layer.w2_weight_scale_inv if m == "down_proj" else layer.w13_weight_scale_inv
        layer.weight_loader(w_param, w, (e, m))
        layer.weight_loader(s_param, scale if scale_shape is None else scale.reshape(scale_shape), (e, m))


def routing(seed: int = 1, num_experts: int = E) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    weights = torch.rand(T, K, generator=gen)
    ids = torch.rand(T, num_experts, generator=gen).argsort(dim=1)[:, :K].to(torch.int32)
    return x, weights, ids


def fp8_layer(ops=ref, tp_rank: int = 0, tp_size: int = 1, static: bool = False) -> FusedMoE:
    with torch.device("meta"):
        layer = FusedMoE(E, H, I, ops, tp_rank, tp_size)
        layer.enable_fp8(BLOCK, static_activations=static)
    # the loader's materialiser: each parameter allocated in its declared dtype
    for name, p in list(layer.named_parameters()):
        dtype = (
            torch.float32 if getattr(p, "keep_fp32", False) else getattr(p, "tilellm_dtype", torch.float32)
        )
        new = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False)
        for attr in ("keep_fp32", "tilellm_dtype", "is_input_scale"):
            if hasattr(p, attr):
                setattr(new, attr, getattr(p, attr))
        layer._parameters[name] = new
    return layer


def test_enable_fp8_declares_parameters():
    with torch.device("meta"):
        layer = FusedMoE(E, H, I, ref, tp_rank=1, tp_size=2)
        layer.enable_fp8(BLOCK)
    params = dict(layer.named_parameters())
    assert sorted(params) == ["w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv"]
    i_r = I // 2
    assert params["w13_weight"].shape == (E, 2 * i_r, H) and params["w2_weight"].shape == (E, H, i_r)
    assert params["w13_weight_scale_inv"].shape == (E, 2 * i_r // 32, H // 32)
    assert params["w2_weight_scale_inv"].shape == (E, H // 32, i_r // 32)
    for name in ("w13_weight", "w2_weight"):
        assert params[name].tilellm_dtype == FP8_DTYPE and params[name].is_meta
    for name in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
        assert params[name].keep_fp32 and params[name].dtype == torch.float32
    gate_up = tuple((e, m) for e in range(E) for m in ("gate_proj", "up_proj"))
    down = tuple((e, "down_proj") for e in range(E))
    assert layer.param_shard_ids("w13_weight") == layer.param_shard_ids("w13_weight_scale_inv") == gate_up
    assert layer.param_shard_ids("w2_weight") == layer.param_shard_ids("w2_weight_scale_inv") == down
    assert "fp8_block=[32, 32]" in repr(layer)


@pytest.mark.parametrize("ops", OPS)
def test_block_scales_load_and_forward(ops):
    ckpt = checkpoint()
    layer = fp8_layer(ops)
    load(layer, ckpt)
    w13, w2, w13_s, w2_s = stacked(ckpt)
    assert torch.equal(layer.w13_weight.view(torch.uint8), w13.view(torch.uint8))
    assert torch.equal(layer.w13_weight_scale_inv, w13_s) and torch.equal(layer.w2_weight_scale_inv, w2_s)
    x, weights, ids = routing()
    expected = ref.fused_moe(
        x, w13, w2, weights, ids, w13_scale=w13_s, w2_scale=w2_s, block_shape=list(BLOCK)
    )
    torch.testing.assert_close(
        layer(x, weights, ids), expected, rtol=0, atol=1e-2 * float(expected.abs().max())
    )


@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["0-d", "1-element"])
def test_per_tensor_scales(scale_shape):
    """A per-tensor `weight_scale` fills its shard's whole block region."""
    ckpt = checkpoint(per_tensor=True, seed=3)
    layer = fp8_layer()
    load(layer, ckpt, scale_shape)
    w13, w2, w13_s, w2_s = stacked(ckpt)
    assert torch.equal(layer.w13_weight_scale_inv, w13_s) and torch.equal(layer.w2_weight_scale_inv, w2_s)
    assert bool((layer.w13_weight_scale_inv[1, : I // 32] == ckpt[1, "gate_proj"][1]).all())
    x, weights, ids = routing(4)
    expected = ref.fused_moe(
        x, w13, w2, weights, ids, w13_scale=w13_s, w2_scale=w2_s, block_shape=list(BLOCK)
    )
    torch.testing.assert_close(layer(x, weights, ids), expected, rtol=0, atol=1e-6)


def test_tensor_parallel_ranks_add_up():
    """Two ranks load their halves of I (in whole blocks); their partial sums are the whole layer."""
    ckpt = checkpoint(seed=5)
    ranks = [fp8_layer(ref, r, 2) for r in range(2)]
    for layer in ranks:
        load(layer, ckpt)
    w13, w2, w13_s, w2_s = stacked(ckpt)
    i_r = I // 2
    # rank 1's up rows of expert 2: rows [I + i_r, 2I) of the whole w13, scales in blocks of 32
    assert torch.equal(ranks[1].w13_weight[2, i_r:].view(torch.uint8), w13[2, I + i_r :].view(torch.uint8))
    assert torch.equal(ranks[1].w13_weight_scale_inv[2, i_r // 32 :], w13_s[2, (I + i_r) // 32 :])
    assert torch.equal(ranks[1].w2_weight_scale_inv[2], w2_s[2, :, i_r // 32 :])
    x, weights, ids = routing(6)
    got = ranks[0](x, weights, ids) + ranks[1](x, weights, ids)
    expected = ref.fused_moe(
        x, w13, w2, weights, ids, w13_scale=w13_s, w2_scale=w2_s, block_shape=list(BLOCK)
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * float(expected.abs().max()))


def test_online_quantization():
    """bf16-checkpoint experts loaded as usual, then quantized per expert in place."""
    gen = torch.Generator().manual_seed(7)
    layer = FusedMoE(E, H, I, ref)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) / 8, torch.randn(E, H, I, generator=gen) / 11
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
    model = torch.nn.Sequential(layer)
    quantize_experts_fp8(model, BLOCK)
    assert layer.fp8_block_size == BLOCK and layer.w13_weight.dtype == FP8_DTYPE
    assert layer.w2_weight_scale_inv.keep_fp32 and layer.w13_weight.tilellm_dtype == FP8_DTYPE
    q, s = quantize_fp8_block(w13[3], list(BLOCK))
    assert torch.equal(layer.w13_weight[3].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.w13_weight_scale_inv[3], s)
    x, weights, ids = routing(8)
    exact = ref.fused_moe(x, w13, w2, weights, ids)
    rel = float((layer(x, weights, ids) - exact).norm() / exact.norm())
    assert rel < 0.08, f"online fp8 experts differ from bf16 ones by {rel:.3f} (relative norm)"
    quantize_experts_fp8(model, BLOCK)  # already fp8: left alone
    with pytest.raises(ValueError, match="already fp8"):
        layer.quantize_weights_fp8(BLOCK)


@pytest.mark.parametrize(
    ("intermediate", "tp_size", "block", "message"),
    [
        (
            128,
            2,
            (128, 128),
            r"moe_intermediate_size \(128\) / tensor_parallel_size \(2\) = 64 .* \[128, 128\]",
        ),
        (96, 1, (64, 32), r"moe_intermediate_size \(96\) / tensor_parallel_size \(1\) = 96 .* \[64, 32\]"),
        (128, 1, (32, 128), r"hidden_size \(64\) must be a multiple of the block's bk = 128"),
        (128, 1, (32, 24), r"block_shape\[1\] \(bk\) must be a power of two"),
    ],
)
def test_block_errors(intermediate, tp_size, block, message):
    with torch.device("meta"):
        layer = FusedMoE(E, H, intermediate, ref, 0, tp_size)
        with pytest.raises(ValueError, match=message):
            layer.enable_fp8(block)


def test_loading_errors():
    ckpt = checkpoint()
    layer = fp8_layer()
    w, scale = ckpt[0, "gate_proj"]
    with pytest.raises(
        ValueError, match="expert 0 gate_proj: checkpoint tensor is torch.float32 but the experts"
    ):
        layer.weight_loader(layer.w13_weight, w.float(), (0, "gate_proj"))
    with pytest.raises(ValueError, match=r"expert 0 up_proj scale: checkpoint shard has shape \(4, 1\)"):
        layer.weight_loader(layer.w13_weight_scale_inv, scale[:, :1], (0, "up_proj"))
    unquantized = FusedMoE(E, H, I, ref)
    with pytest.raises(ValueError, match="fp8 checkpoints need FusedMoE.enable_fp8"):
        unquantized.weight_loader(unquantized.w13_weight, w, (0, "gate_proj"))


# ----------------------------------------------------------------------------------------------
# A DeepSeek-V3 checkpoint in the released FP8 formats, through the model loader
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_fp8")
    src = make_tiny_moe_model(root / "src", "DeepseekV3ForCausalLM", seed=3)
    return {
        "src": src,
        "block": quantize_model_dir_fp8(src, root / "block", BLOCK),
        "per_tensor": quantize_model_dir_fp8(src, root / "per_tensor", per_tensor=True),
    }


@pytest.mark.parametrize("form", ["block", "per_tensor"])
def test_deepseek_v3_checkpoint_loads_fp8_experts(deepseek_dirs, form):
    """The loaded experts hold the file's e4m3 values and scales (a per-tensor scale repeated
    over its matrix's blocks) and run within fp8's error of the original float experts."""
    sd = load_file(deepseek_dirs[form] / "model.safetensors")
    model, _ = load_model(deepseek_dirs[form], device="cpu", attention_backend="reference")
    experts = model.model.layers[1].mlp.experts
    assert experts.fp8_block_size == BLOCK and experts.w13_weight.dtype == FP8_DTYPE
    name = "weight_scale" if form == "per_tensor" else "weight_scale_inv"
    ckpt = {}
    for e in range(8):
        for m in MATRICES:
            prefix = f"model.layers.1.mlp.experts.{e}.{m}."
            ckpt[e, m] = (sd[prefix + "weight"], sd[prefix + name])
    w13, w2, w13_s, w2_s = stacked(ckpt, num_experts=8, hidden=64, inter=32)  # the tiny model's experts
    assert torch.equal(experts.w13_weight.view(torch.uint8), w13.view(torch.uint8))
    assert torch.equal(experts.w2_weight.view(torch.uint8), w2.view(torch.uint8))
    assert torch.equal(experts.w13_weight_scale_inv, w13_s) and torch.equal(experts.w2_weight_scale_inv, w2_s)

    source = load_file(deepseek_dirs["src"] / "model.safetensors")
    exact_w13 = torch.stack(
        [
            torch.cat([source[f"model.layers.1.mlp.experts.{e}.{m}.weight"] for m in MATRICES[:2]])
            for e in range(8)
        ]
    )
    exact_w2 = torch.stack([source[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(8)])
    x, weights, ids = routing(9, num_experts=8)
    exact = ref.fused_moe(x, exact_w13, exact_w2, weights, ids)
    rel = float((experts(x, weights, ids) - exact).norm() / exact.norm())
    assert rel < 0.08, f"{form} fp8 experts differ from the float ones by {rel:.3f} (relative norm)"


# ----------------------------------------------------------------------------------------------
# Static activation scales (per-tensor checkpoints, activation_scheme "static")
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ops", OPS)
def test_static_input_scales_load_reduce_and_forward(ops):
    """Each expert's gate / up / down `input_scale` loads into w13_input_scale [E, 2] and
    w2_input_scale [E]; once loading is done each is its largest ([1]: one quantization of the
    shared input, vLLM's rule), and the layer is the fused MoE with those a1 / a2 scales, unlike
    the per-token-group one."""
    ckpt = checkpoint(per_tensor=True, seed=5)
    layer = fp8_layer(ops, static=True)
    assert layer.w13_input_scale.shape == (E, 2) and layer.w2_input_scale.shape == (E,)
    assert layer.param_shard_ids("w13_input_scale") == layer.param_shard_ids("w13_weight")
    load(layer, ckpt)
    input_scales = {(e, m): 0.01 * (1 + e + 3 * MATRICES.index(m)) for e in range(E) for m in MATRICES}
    for (e, m), value in input_scales.items():
        param = layer.w2_input_scale if m == "down_proj" else layer.w13_input_scale
        layer.weight_loader(param, torch.tensor(value), (e, m))
    layer.process_weights_after_loading(torch.float32)
    a1 = max(v for (e, m), v in input_scales.items() if m != "down_proj")
    a2 = max(v for (e, m), v in input_scales.items() if m == "down_proj")
    assert layer.w13_input_scale.tolist() == pytest.approx(
        [a1]
    ) and layer.w2_input_scale.tolist() == pytest.approx([a2])
    assert "static activations" in repr(layer)
    w13, w2, w13_s, w2_s = stacked(ckpt)
    x, weights, ids = routing()
    kwargs = dict(w13_scale=w13_s, w2_scale=w2_s, block_shape=list(BLOCK))
    expected = ref.fused_moe(
        x, w13, w2, weights, ids, **kwargs, a1_scale=layer.w13_input_scale, a2_scale=layer.w2_input_scale
    )
    got = layer(x, weights, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * float(expected.abs().max()))
    dynamic = ref.fused_moe(x, w13, w2, weights, ids, **kwargs)
    assert not torch.allclose(got, dynamic, rtol=0, atol=1e-2 * float(dynamic.abs().max()))


def test_bad_static_input_scale_is_named():
    layer = fp8_layer(static=True)
    with pytest.raises(ValueError, match=r"expert 2 up_proj: input_scale must be a positive finite number"):
        layer.weight_loader(layer.w13_input_scale, torch.tensor(-1.0), (2, "up_proj"))


def test_deepseek_v3_static_checkpoint_experts(deepseek_dirs):
    """A calibrated per-tensor DeepSeek-V3 checkpoint: the experts keep the largest gate / up and
    down input scales of the file."""
    sd = load_file(deepseek_dirs["per_tensor"] / "model.safetensors")
    model, _ = load_model(deepseek_dirs["per_tensor"], device="cpu", attention_backend="reference")
    experts = model.model.layers[1].mlp.experts
    p = "model.layers.1.mlp.experts"
    gate_up = max(sd[f"{p}.{e}.{m}.input_scale"].item() for e in range(8) for m in MATRICES[:2])
    down = max(sd[f"{p}.{e}.down_proj.input_scale"].item() for e in range(8))
    assert experts.static_activations
    assert experts.w13_input_scale.tolist() == [gate_up] and experts.w2_input_scale.tolist() == [down]


def test_one_expert_static_scales_reduce_to_one_element():
    """E = 1: the [1, 2] gate/up scales still become one ([1]), so the layer runs."""
    with torch.device("meta"):
        layer = FusedMoE(1, H, I, ref)
        layer.enable_fp8(BLOCK, static_activations=True)
    for name, p in list(layer.named_parameters()):
        dtype = (
            torch.float32 if getattr(p, "keep_fp32", False) else getattr(p, "tilellm_dtype", torch.float32)
        )
        layer._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False)
    ckpt = {(0, m): w for (e, m), w in checkpoint(per_tensor=True).items() if e == 0}
    load(layer, ckpt)
    for m, value in zip(MATRICES, (0.02, 0.03, 0.05)):
        layer.weight_loader(
            layer.w2_input_scale if m == "down_proj" else layer.w13_input_scale, torch.tensor(value), (0, m)
        )
    layer.process_weights_after_loading(torch.float32)
    assert layer.w13_input_scale.tolist() == pytest.approx(
        [0.03]
    ) and layer.w2_input_scale.tolist() == pytest.approx([0.05])
    x = torch.randn(3, H)
    out = layer(x, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32))
    assert out.shape == (3, H) and bool(torch.isfinite(out).all())
