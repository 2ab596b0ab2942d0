"""Loader: config and weight errors name the file / tensor / architecture; dtype, dummy weights,
KV spec, tensor-parallel slicing, and RoPE frequencies identical to transformers'."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tilellm.models import get_model_class, load_model, model_kv_spec, supported_architectures
from tilellm.models.layers.rotary_embedding import inverse_frequencies, rope_config
from tilellm.testing import make_random_model_dir, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM")


def _copy_model(src, dst):
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nope", device="cpu")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, device="cpu")


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"],')
    with pytest.raises(ValueError, match=r"malformed JSON in .*config\.json"):
        load_model(tmp_path, device="cpu")


def test_config_without_architectures(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ValueError, match="no 'architectures' entry"):
        load_model(tmp_path, device="cpu")


def test_unknown_architecture(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'FooForCausalLM'.*supported: .*Qwen3ForCausalLM.*config\.json"):
        load_model(d, device="cpu")
    with pytest.raises(ValueError, match="FooForCausalLM"):
        get_model_class("FooForCausalLM")
    assert supported_architectures() == [
        "DeepseekV2ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ]


def test_missing_expert_weight_is_named(tmp_path):
    """Each expert's matrices land in slices of the stacked parameters; one missing is named
    with its checkpoint name."""
    from safetensors.torch import load_file, save_file

    from tilellm.testing import make_tiny_moe_model

    d = make_tiny_moe_model(tmp_path / "m", "DeepseekV3ForCausalLM")
    model, _ = load_model(d, device="cpu")
    experts = model.model.layers[1].mlp.experts
    sd = load_file(str(d / "model.safetensors"))
    e3 = sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(experts.w13_weight[3, experts.intermediate_per_rank :], e3)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing weight\(s\) 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"
    ):
        load_model(d, device="cpu")


def test_missing_safetensors(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in"):
        load_model(d, device="cpu")


def test_missing_shard_listed_in_index(tmp_path):
    d = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", num_shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors.*index\.json"):
        load_model(d, device="cpu")


def test_missing_tensor(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    del sd["model.layers.0.self_attn.k_norm.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing weight.*'model\.layers\.0\.self_attn\.k_norm\.weight'"
    ) as e:
        load_model(d, device="cpu")
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert "model.safetensors" in str(e.value)


def test_untied_model_needs_lm_head(tmp_path):
    d = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie_word_embeddings=False)
    sd = load_file(d / "model.safetensors")
    del sd["lm_head.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match="'lm_head.weight'"):
        load_model(d, device="cpu")


def test_unexpected_tensor(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight' in .*model"
    ):
        load_model(d, device="cpu")


def test_wrong_shape_names_tensor_and_file(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(16, 64)  # should be [2 * 16, 64]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.v_proj\.weight' from .*model\.safetensors"
    ):
        load_model(d, device="cpu")


def test_tied_checkpoint_may_carry_lm_head(tmp_path, tiny):
    """Some tied checkpoints also store lm_head.weight: it is ignored, the embedding is used."""
    d = _copy_model(tiny, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, d / "model.safetensors")
    model, _ = load_model(d, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bad_options(tiny):
    with pytest.raises(ValueError, match="load_format"):
        load_model(tiny, device="cpu", load_format="pt")
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="attention_backend|backend"):
        load_model(tiny, device="cpu", attention_backend="flash")
    with pytest.raises(ValueError, match="tp_rank"):
        load_model(tiny, device="cpu", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_model(tiny, device="cpu", tp_size=3)


# ---------------------------------------------------------------------------------------------
# what gets loaded
# ---------------------------------------------------------------------------------------------


def test_weights_are_merged_and_tied(tiny):
    model, config = load_model(tiny, device="cpu")
    sd = load_file(tiny / "model.safetensors")
    attn = model.model.layers[1].self_attn
    expected_qkv = torch.cat([sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
    expected_gate_up = torch.cat([sd[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    torch.testing.assert_close(
        model.model.layers[1].mlp.gate_up_proj.weight, expected_gate_up, rtol=0, atol=0
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert len(model.attention_layers()) == 2


@pytest.mark.parametrize("dtype, expected", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_dtype_auto_follows_config(tmp_path, dtype, expected):
    d = make_tiny_model(tmp_path, "Qwen3ForCausalLM", dtype="bfloat16")
    model, _ = load_model(d, device="cpu", dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    # the RoPE table stays fp32 whatever the model dtype
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_dummy_weights_from_config_only(tmp_path):
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 320,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    d = make_random_model_dir(tmp_path, config)
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]
    model, _ = load_model(d, device="cpu", dtype="float32", load_format="dummy")
    assert torch.all(model.model.norm.weight == 1)
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert 0.01 < w.std().item() < 0.03
    again, _ = load_model(d, device="cpu", dtype="float32", load_format="dummy")
    torch.testing.assert_close(again.model.layers[0].self_attn.qkv_proj.weight, w)  # seeded


def test_model_kv_spec(tiny):
    _, config = load_model(tiny, device="cpu")
    assert model_kv_spec(config) == (2, 2, 16)
    assert model_kv_spec(config, tp_size=2) == (2, 1, 16)
    assert model_kv_spec(config, tp_size=4) == (2, 1, 16)  # 2 KV heads replicated over 4 ranks


# ---------------------------------------------------------------------------------------------
# tensor-parallel slicing (each rank loads only its shard)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards(tmp_path, tp_size):
    d = make_tiny_model(tmp_path, "Qwen2ForCausalLM", vocab_size=383, tie_word_embeddings=False)
    sd = load_file(d / "model.safetensors")
    hq, hkv, hd = 4, 2, 16
    q_rows = hq // tp_size * hd
    replicas = max(1, tp_size // hkv)
    for rank in range(tp_size):
        model, _ = load_model(d, device="cpu", tp_rank=rank, tp_size=tp_size)
        attn = model.model.layers[0].self_attn
        kv_head = rank // replicas if tp_size > hkv else rank
        kv_rows = slice(kv_head * hd, (kv_head + 1) * hd)
        p = "model.layers.0.self_attn."
        for name in ("weight", "bias"):
            expected = torch.cat(
                [
                    sd[p + f"q_proj.{name}"][rank * q_rows : (rank + 1) * q_rows],
                    sd[p + f"k_proj.{name}"][kv_rows],
                    sd[p + f"v_proj.{name}"][kv_rows],
                ]
            )
            torch.testing.assert_close(getattr(attn.qkv_proj, name), expected, rtol=0, atol=0)
        o_cols = slice(rank * q_rows, (rank + 1) * q_rows)
        torch.testing.assert_close(attn.o_proj.weight, sd[p + "o_proj.weight"][:, o_cols], rtol=0, atol=0)
        i_rows = 128 // tp_size
        mlp = model.model.layers[0].mlp
        gate_up = torch.cat(
            [
                sd[f"model.layers.0.mlp.{n}_proj.weight"][rank * i_rows : (rank + 1) * i_rows]
                for n in ("gate", "up")
            ]
        )
        torch.testing.assert_close(mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
        # vocab 383 over tp ranks: ceil-sized row blocks, the last one zero-padded
        per_rank = -(-383 // tp_size)
        rows = sd["lm_head.weight"][rank * per_rank : (rank + 1) * per_rank]
        torch.testing.assert_close(model.lm_head.weight[: rows.shape[0]], rows, rtol=0, atol=0)
        assert torch.all(model.lm_head.weight[rows.shape[0] :] == 0)


# ---------------------------------------------------------------------------------------------
# RoPE frequencies: identical to transformers' for every supported rope_type
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_inverse_frequencies_match_transformers(tmp_path, scaling):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = make_tiny_model(tmp_path, "LlamaForCausalLM", head_dim=128, hidden_size=512, rope_scaling=scaling)
    config = AutoConfig.from_pretrained(d)
    theta, parsed = rope_config(config)
    ours = inverse_frequencies(128, theta, parsed)
    if scaling is None:
        expected = 1.0 / (theta ** (torch.arange(0, 128, 2).float() / 128))
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        assert attention_factor == 1.0
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_unsupported_rope_type(tmp_path):
    d = make_tiny_model(tmp_path, "LlamaForCausalLM", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        load_model(d, device="cpu")


def test_sliding_window_is_rejected(tmp_path, tiny):
    d = _copy_model(tiny, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=16)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(d, device="cpu")
