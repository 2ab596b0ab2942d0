"""`tilellm.testing`: tiny model directories that transformers and tokenizers load as real ones."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from tilellm.testing import QWEN3_0_6B_CONFIG, make_random_model_dir, make_tiny_model


def test_files_and_config(tmp_path):
    start = time.perf_counter()
    d = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    assert time.perf_counter() - start < 2.0
    names = {p.name for p in d.iterdir()}
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert names == expected
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "float32"
    sd = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in sd  # tied
    assert sd["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)


def test_seeded(tmp_path):
    a = load_file(make_tiny_model(tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=2) / "model.safetensors")
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a[w], b[w]) and not torch.equal(a[w], c[w])


def test_sharded_index(tmp_path):
    d = make_tiny_model(
        tmp_path, "Qwen2ForCausalLM", num_shards=3, tie_word_embeddings=False, dtype="bfloat16"
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    tensors = {}
    for f in files:
        part = load_file(d / f)
        assert all(index["weight_map"][name] == f for name in part)
        tensors.update(part)
    assert set(tensors) == set(index["weight_map"])
    assert "lm_head.weight" in tensors and "model.layers.0.self_attn.q_proj.bias" in tensors
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_tokenizer_round_trips_and_special_tokens(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    d = make_tiny_model(tmp_path, vocab_size=400)
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() <= 400
    for text in ["Hello, world!", "Café 東京 🙂 — naïve", " leading space\nnew line\ttab", ""]:
        assert tok.decode(tok.encode(text).ids) == text
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert all(i is not None and i < 400 for i in ids.values())
    assert tok.encode("<|im_start|>user").ids[0] == ids["<|im_start|>"]
    cfg = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    assert cfg["eos_token_id"] == ids["<|endoftext|>"]
    assert gen["eos_token_id"] == [ids["<|endoftext|>"], ids["<|im_end|>"]]


def test_transformers_tokenizer_and_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = make_tiny_model(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert tok.eos_token == "<|endoftext|>"
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"
    assert tok.decode(tok(text)["input_ids"]) == text


@pytest.mark.parametrize(
    "kwargs, match", [(dict(arch="GPT2"), "unknown arch"), (dict(vocab_size=100), "vocab_size")]
)
def test_rejects_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_tiny_model(tmp_path, **kwargs)


def test_random_model_dir(tmp_path):
    d = make_random_model_dir(tmp_path, QWEN3_0_6B_CONFIG)
    assert json.loads((d / "config.json").read_text()) == QWEN3_0_6B_CONFIG
    with pytest.raises(ValueError, match="architectures"):
        make_random_model_dir(tmp_path / "x", {"hidden_size": 8})
