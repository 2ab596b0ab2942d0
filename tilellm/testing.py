"""Tiny Hugging Face model directories for tests and demos, built locally (nothing is downloaded).

`make_tiny_model` writes what a real checkpoint has: `config.json`, safetensors weights (one file,
or shards plus `model.safetensors.index.json`), `generation_config.json` and a byte-level BPE
tokenizer (`tokenizer.json` + `tokenizer_config.json` with a ChatML chat template). `transformers`
loads the directory as it would a downloaded one, which makes it the correctness oracle.

`make_random_model_dir` writes a `config.json` only, for `load_format="dummy"` benchmarks on
real model shapes (e.g. Qwen3-0.6B) without weights.

Neither imports `transformers`: the configs are written the way released checkpoints spell them
(`rope_theta` / `rope_scaling` / `torch_dtype`), which keeps a call well under a second.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

CHATML_TEMPLATE = (
    # Qwen's tool format: the tools' JSON in the system turn, calls as <tool_call> JSON in the
    # assistant's turn, a tool's answer as a <tool_response> in a user turn.
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\\n</tools>\\n\\nFor each call, return {"name": <function-name>, "arguments": <args-object>} '
    "within <tool_call></tool_call> tags.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    # Qwen3's thinking switch (chat_template_kwargs={"enable_thinking": False}): an empty think block.
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# name -> (model_type, qkv bias, per-head q/k norm)
_ARCHS = {
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "LlamaForCausalLM": ("llama", False, False),
}

# Text the BPE trainer learns its merges from: plain English plus some multi-byte UTF-8.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and
predicts the next one. The engine keeps the keys and values of every token in a paged cache,
so that many requests can share the memory of one accelerator. Each request is split into blocks
of the same size; a block table maps the logical blocks of a request to physical blocks.
Once upon a time there was a little robot who liked to count the stars at night. One, two, three,
four, five, six, seven, eight, nine, ten. The robot wrote every number into a small notebook and
showed it to the moon. The moon smiled and said: "you have counted well, but there are more."
Hello, world! How are you today? I am fine, thank you. What is the capital of France? It is Paris.
The weather is nice in the spring and the summer; in the autumn the leaves turn red and yellow.
Scheduling, batching, prefill, decode, attention, softmax, matrix, kernel, memory, throughput.
Café, naïve, résumé, Zürich, São Paulo, 東京, 北京, Москва, Ελλάδα, emoji 🙂 and 🚀 too.
"""


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _make_state_dict(cfg: dict, arch: str, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with HF names, scaled so activations stay O(1) and logits are well spread.

    NOTE: a small embedding and gain-2 output projections keep the residual stream from being
    just the current token's embedding, which would make greedy decoding repeat one token.
    """
    _, qkv_bias, qk_norm = _ARCHS[arch]
    gen = torch.Generator().manual_seed(seed)
    h, i_size, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return _normal((out_f, in_f), gain / math.sqrt(in_f), gen)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + _normal((n,), 0.1, gen)

    sd = {"model.embed_tokens.weight": _normal((vocab, h), 0.25, gen)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "self_attn.q_proj.weight"] = linear(hq * d, h)
        sd[p + "self_attn.k_proj.weight"] = linear(hkv * d, h)
        sd[p + "self_attn.v_proj.weight"] = linear(hkv * d, h)
        if qkv_bias:
            sd[p + "self_attn.q_proj.bias"] = _normal((hq * d,), 0.1, gen)
            sd[p + "self_attn.k_proj.bias"] = _normal((hkv * d,), 0.1, gen)
            sd[p + "self_attn.v_proj.bias"] = _normal((hkv * d,), 0.1, gen)
        sd[p + "self_attn.o_proj.weight"] = linear(h, hq * d, gain=2.0)
        if qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm(d)
            sd[p + "self_attn.k_norm.weight"] = norm(d)
        sd[p + "post_attention_layernorm.weight"] = norm(h)
        sd[p + "mlp.gate_proj.weight"] = linear(i_size, h)
        sd[p + "mlp.up_proj.weight"] = linear(i_size, h)
        sd[p + "mlp.down_proj.weight"] = linear(h, i_size, gain=2.0)
    sd["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = _normal((vocab, h), 0.5, gen)
    return sd


def _save_weights(path: pathlib.Path, sd: dict[str, torch.Tensor], num_shards: int) -> None:
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    if num_shards == 1:
        save_file(sd, str(path / "model.safetensors"), metadata=meta)
        return
    names = list(sd)
    per_shard = math.ceil(len(names) / num_shards)
    weight_map: dict[str, str] = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = names[s * per_shard : (s + 1) * per_shard]
        save_file({n: sd[n] for n in chunk}, str(path / fname), metadata=meta)
        weight_map.update(dict.fromkeys(chunk, fname))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _byte_level(model: Any) -> Any:
    """A `tokenizers.Tokenizer` of `model` with byte-level pre-tokenizing and decoding (GPT-2's, Qwen's)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _write_tokenizer(tok: Any, path: pathlib.Path, max_len: int | None = None) -> dict[str, int]:
    """Add the special tokens (the last ids), write `tok` and its config (ChatML template) into
    `path`; returns the special tokens' ids."""
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    added = {str(ids[t]): {"content": t, **flags} for t in SPECIAL_TOKENS}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        **({"model_max_length": max_len} if max_len is not None else {}),
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    return ids


def _save_tokenizer(path: pathlib.Path, vocab_size: int, max_len: int) -> dict[str, int]:
    """Byte-level BPE trained on `_TRAINING_TEXT`; special tokens take the last ids. Returns their ids."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    return _write_tokenizer(tok, path, max_len)


def make_tiny_model(
    path: str | pathlib.Path,
    arch: str = "Qwen3ForCausalLM",
    *,
    seed: int = 0,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    dtype: str = "float32",
    max_position_embeddings: int = 512,
    rope_scaling: dict | None = None,
    num_shards: int = 1,
) -> pathlib.Path:
    """Write a random `arch` model plus tokenizer into `path` (created if needed); returns the path.

    Token ids: the byte-level BPE vocabulary (at most `vocab_size - 3` entries) followed by
    `<|endoftext|>` (eos), `<|im_start|>` and `<|im_end|>`. `config.eos_token_id` is
    `<|endoftext|>`; `generation_config.json` lists both `<|endoftext|>` and `<|im_end|>`, as Qwen's do.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCHS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be at least 260 (256 bytes + 3 special tokens), got {vocab_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    model_type = _ARCHS[arch][0]
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)

    ids = _save_tokenizer(path, vocab_size, max_position_embeddings)
    eos_id = ids[EOS_TOKEN]
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "attention_bias": False,  # Qwen2 always has q/k/v biases and ignores this
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
    }
    if model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    if model_type == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen_cfg = {"eos_token_id": [eos_id, ids[IM_END]], "pad_token_id": eos_id, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))

    sd = _make_state_dict(config, arch, seed)
    _save_weights(path, {k: v.to(_DTYPES[dtype]).contiguous() for k, v in sd.items()}, num_shards)
    return path


def save_synthetic_tokenizer(path: str | pathlib.Path, vocab_size: int, seed: int = 0) -> pathlib.Path:
    """A byte-level BPE tokenizer of exactly `vocab_size` entries written into `path`, for
    benchmarks whose cost depends on the vocabulary (structured outputs' masks over Qwen3's
    151,936 tokens) where no real tokenizer can be fetched. Its merges join random pairs of
    existing tokens (letters and spaces most often), so entries have a word-like spread of
    lengths; the special tokens take the last ids. Returns `path`."""
    from tokenizers import models, pre_tokenizers

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(sorted(alphabet))}
    common = [c for c in "abcdefghijklmnopqrstuvwxyz" + "\u0120" * 6 + "etaoinshr" if c in vocab]
    tokens = list(vocab)
    merges: list[tuple[str, str]] = []
    target = vocab_size - len(SPECIAL_TOKENS)
    while len(vocab) < target:
        # the left side: usually a recent (longer) token, the right: usually a common character
        a = tokens[-rng.randint(1, min(len(tokens), 4000))] if rng.random() < 0.7 else rng.choice(common)
        b = rng.choice(common) if rng.random() < 0.8 else rng.choice(tokens)
        if len(a) + len(b) > 16 or (a + b) in vocab:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append((a, b))
    _write_tokenizer(_byte_level(models.BPE(vocab=vocab, merges=merges)), path)
    return path


def make_random_model_dir(path: str | pathlib.Path, config_dict: dict) -> pathlib.Path:
    """Write only `config.json` (for `load_format="dummy"`); returns the directory."""
    if "architectures" not in config_dict:
        raise ValueError("config_dict needs an 'architectures' entry, e.g. ['Qwen3ForCausalLM']")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict, indent=2))
    return path


# Qwen3-0.6B's architecture (E1-E3 in docs/workloads.md), for benchmarks with random weights.
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


# Qwen3-8B's architecture (the tensor-parallel benchmark), for random weights: untied
# embeddings, 36 layers, 32 query / 8 KV heads of 128, 8.2 B parameters (16.4 GB in bf16).
QWEN3_8B_CONFIG = {
    **QWEN3_0_6B_CONFIG,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}


# -- mixture-of-experts and MLA models ---------------------------------------------------------

# name -> model_type of the tiny MoE checkpoints `make_tiny_moe_model` writes
_MOE_ARCHS = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def _moe_config(arch: str, *, vocab_size: int, eos_id: int, q_lora_rank: int | None, rope_scaling) -> dict:
    """A small config of `arch`, spelled as its released checkpoints spell theirs."""
    common = {
        "architectures": [arch],
        "model_type": _MOE_ARCHS[arch],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,  # the dense layers'
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
    }
    if arch == "Qwen3MoeForCausalLM":
        return {
            **common,
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],  # a dense layer between two sparse ones
            "norm_topk_prob": True,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    deepseek = {
        **common,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": q_lora_rank,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 24,  # unequal to the qk head dim (32), as DeepSeek's 128 vs 192
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 4,
        "topk_group": 2,
    }
    if arch == "DeepseekV2ForCausalLM":
        return {
            **deepseek,
            "topk_method": "group_limited_greedy",
            "scoring_func": "softmax",
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
        }
    v3 = {
        **deepseek,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_interleave": True,
    }
    if arch == "DeepseekV32ForCausalLM":
        # a selection smaller than most prompts, so that which keys it keeps matters
        return {**v3, "index_topk": 8, "index_head_dim": 32, "index_n_heads": 8}
    return v3


def _moe_state_dict(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with HF names, scaled as `_make_state_dict`'s (O(1) activations, spread logits)."""
    gen = torch.Generator().manual_seed(seed)
    h, hq, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return _normal((out_f, in_f), gain / math.sqrt(in_f), gen)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + _normal((n,), 0.1, gen)

    def mlp(prefix: str, inter: int) -> None:
        sd[prefix + "gate_proj.weight"] = linear(inter, h)
        sd[prefix + "up_proj.weight"] = linear(inter, h)
        sd[prefix + "down_proj.weight"] = linear(h, inter, gain=2.0)

    is_qwen = cfg["model_type"] == "qwen3_moe"
    num_experts = cfg["num_experts"] if is_qwen else cfg["n_routed_experts"]
    sd = {"model.embed_tokens.weight": _normal((vocab, h), 0.25, gen)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "post_attention_layernorm.weight"] = norm(h)
        a = p + "self_attn."
        if is_qwen:
            d, hkv = cfg["head_dim"], cfg["num_key_value_heads"]
            sd[a + "q_proj.weight"] = linear(hq * d, h)
            sd[a + "k_proj.weight"] = linear(hkv * d, h)
            sd[a + "v_proj.weight"] = linear(hkv * d, h)
            sd[a + "o_proj.weight"] = linear(h, hq * d, gain=2.0)
            sd[a + "q_norm.weight"] = norm(d)
            sd[a + "k_norm.weight"] = norm(d)
            sparse = layer not in cfg["mlp_only_layers"] and (layer + 1) % cfg["decoder_sparse_step"] == 0
        else:
            dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            rank, q_rank = cfg["kv_lora_rank"], cfg["q_lora_rank"]
            if q_rank is None:
                sd[a + "q_proj.weight"] = linear(hq * (dn + dr), h)
            else:
                sd[a + "q_a_proj.weight"] = linear(q_rank, h)
                sd[a + "q_a_layernorm.weight"] = norm(q_rank)
                sd[a + "q_b_proj.weight"] = linear(hq * (dn + dr), q_rank)
            if "index_topk" in cfg:  # DeepSeek-V3.2's lightning indexer
                hi, di = cfg["index_n_heads"], cfg["index_head_dim"]
                sd[a + "indexer.wq_b.weight"] = linear(hi * di, q_rank, gain=2.0)
                sd[a + "indexer.wk.weight"] = linear(di, h, gain=2.0)
                sd[a + "indexer.k_norm.weight"] = norm(di)
                sd[a + "indexer.k_norm.bias"] = _normal((di,), 0.1, gen)
                sd[a + "indexer.weights_proj.weight"] = linear(hi, h)
            sd[a + "kv_a_proj_with_mqa.weight"] = linear(rank + dr, h)
            sd[a + "kv_a_layernorm.weight"] = norm(rank)
            sd[a + "kv_b_proj.weight"] = linear(hq * (dn + dv), rank)
            sd[a + "o_proj.weight"] = linear(h, hq * dv, gain=2.0)
            sparse = layer >= cfg["first_k_dense_replace"] and layer % cfg["moe_layer_freq"] == 0
        m = p + "mlp."
        if not sparse:
            mlp(m, cfg["intermediate_size"])
            continue
        # a router with spread logits, so that different tokens pick different experts
        sd[m + "gate.weight"] = linear(num_experts, h, gain=3.0)
        if cfg["model_type"] in ("deepseek_v3", "deepseek_v32"):
            sd[m + "gate.e_score_correction_bias"] = _normal((num_experts,), 0.1, gen)
        for e in range(num_experts):
            mlp(f"{m}experts.{e}.", cfg["moe_intermediate_size"])
        if not is_qwen and cfg["n_shared_experts"]:
            mlp(m + "shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    sd["model.norm.weight"] = norm(h)
    sd["lm_head.weight"] = _normal((vocab, h), 0.5, gen)
    return sd


def make_tiny_moe_model(
    path: str | pathlib.Path,
    arch: str = "DeepseekV2ForCausalLM",
    *,
    seed: int = 0,
    vocab_size: int = 384,
    q_lora_rank: int | None = None,
    rope_scaling: dict | None = None,
) -> pathlib.Path:
    """Write a random DeepSeek-V2 / V3 / V3.2 (MLA + MoE) or Qwen3-MoE model plus tokenizer into `path`.

    Three layers (DeepSeek: one dense, then two MoE; Qwen3-MoE: MoE, dense, MoE), 8 routed
    experts of width 32, top-2. DeepSeek: 4 heads, kv_lora_rank 32, 16 nope + 16 rotary query
    dims, value head dim 24, one shared expert, 4 expert groups of which 2 compete.
    `q_lora_rank` (DeepSeek only): None = one q_proj (as DeepSeek-V2-Lite), else q_a/q_b.
    DeepSeek-V3.2 (which needs `q_lora_rank`): an indexer of 8 heads of 32 choosing the top 8 keys.
    """
    if arch not in _MOE_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_MOE_ARCHS)}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = _save_tokenizer(path, vocab_size, 512)
    eos_id = ids[EOS_TOKEN]
    config = _moe_config(
        arch, vocab_size=vocab_size, eos_id=eos_id, q_lora_rank=q_lora_rank, rope_scaling=rope_scaling
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen_cfg = {"eos_token_id": [eos_id, ids[IM_END]], "pad_token_id": eos_id, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    _save_weights(path, {k: v.contiguous() for k, v in _moe_state_dict(config, seed).items()}, 1)
    return path


# DeepSeek-V2-Lite's architecture (E5 in docs/workloads.md): MLA with a 512 + 64 latent, 64 routed
# experts (top-6) of width 1408 plus 2 shared, the first layer dense; 15.7 B parameters.
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
}

# Qwen3-30B-A3B's architecture (E5): 48 layers of GQA (32 / 4 heads of 128) and 128 experts
# (top-8) of width 768, no shared expert; 30.5 B parameters, 3.3 B active per token.
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


# A reduced DeepSeek-V3.2 (E6 in docs/workloads.md): full width (hidden 7168, 128 heads, MLA
# 512 + 64, the 64-head indexer keeping 2048 keys, 256 experts top-8 + 1 shared) but two layers,
# the first dense: about 28 GB of bf16 weights on one GPU.
DEEPSEEK_V32_REDUCED_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


# -- FP8 checkpoints ---------------------------------------------------------------------------

_FP8_MAX = 448.0  # the largest e4m3 magnitude
# module names (last part) whose weights FP8 checkpoints keep in the model dtype: embeddings, the
# LM head, MoE routers and DeepSeek-V3.2's fp32 indexer weights (norms are 1-D, never converted)
_FP8_KEPT = ("embed_tokens", "lm_head", "gate", "weights_proj")


def _read_checkpoint(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def _copy_checkpoint_files(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Everything but the weights (config.json is rewritten by the caller)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())


def _is_fp8_linear(name: str, t: torch.Tensor, not_convert: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    if not name.endswith(".weight") or t.dim() != 2 or module.rpartition(".")[2] in _FP8_KEPT:
        return False
    return not any(f".{m}." in f".{module}." for m in not_convert)


def _quantize_block(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale_inv fp32 [ceil(N / bn), ceil(K / bk)]): each block's
    amax / 448, the values divided by their block's scale and rounded to nearest (torch's cast)."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w.float()
    scale = padded.abs().view(nb, bn, kb, bk).amax(dim=(1, 3)).clamp(min=1e-12) / _FP8_MAX
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / full).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale


def calibrate_input_scales(
    model_dir: str | pathlib.Path, *, num_prompts: int = 4, prompt_len: int = 48, seed: int = 0
) -> dict[str, float]:
    """Static activation scales of a checkpoint, as AutoFP8 calibrates them: transformers runs
    `num_prompts` random prompts of `prompt_len` tokens (fp32) and each linear layer's scale is
    the largest |input| it saw / 448. Returns checkpoint module name -> scale, for every
    nn.Linear and for every expert's gate_proj / up_proj (their input) and down_proj (SiLU(gate)
    * up) of the fused experts; an expert no token reached gets its layer's largest."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, experts_implementation="eager"
    ).eval()
    amax: dict[str, float] = {}

    def record(name: str, x: torch.Tensor) -> None:
        amax[name] = max(amax.get(name, 0.0), float(x.detach().abs().max()))

    hooks, experts = [], {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(lambda m, args, name=name: record(name, args[0])))
        elif type(module).__name__.endswith("Experts"):
            experts[name] = module
    # the eager experts call F.linear on one expert's slice of gate_up_proj / down_proj at a time
    slices = {}
    for name, module in experts.items():
        for e in range(module.gate_up_proj.shape[0]):
            slices[module.gate_up_proj[e].data_ptr()] = (f"{name}.{e}.gate_proj", f"{name}.{e}.up_proj")
            slices[module.down_proj[e].data_ptr()] = (f"{name}.{e}.down_proj",)
    linear = torch.nn.functional.linear

    def recording_linear(x, w, b=None):
        for name in slices.get(w.data_ptr(), ()):
            record(name, x)
        return linear(x, w, b)

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (num_prompts, prompt_len), generator=gen)
    torch.nn.functional.linear = recording_linear
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        torch.nn.functional.linear = linear
        for h in hooks:
            h.remove()
    for name, module in experts.items():  # experts no token reached: their layer's largest
        for matrices in (("gate_proj", "up_proj"), ("down_proj",)):
            names = [f"{name}.{e}.{m}" for e in range(module.gate_up_proj.shape[0]) for m in matrices]
            top = max((amax[n] for n in names if n in amax), default=1.0)
            amax.update({n: top for n in names if n not in amax})
    return {name: max(v, 1e-6) / _FP8_MAX for name, v in amax.items()}


def quantize_model_dir_fp8(
    src_dir: str | pathlib.Path,
    dst_dir: str | pathlib.Path,
    block_size: tuple[int, int] = (128, 128),
    *,
    per_tensor: bool = False,
    activation_scheme: str | None = None,
    not_convert: tuple[str, ...] = (),
) -> pathlib.Path:
    """Write an FP8 copy of checkpoint `src_dir` into `dst_dir` in the released format; returns it.

    Block form (DeepSeek-V3, Qwen3-*-FP8): every linear `X.weight` [N, K] becomes e4m3 with
    `X.weight_scale_inv` fp32 [ceil(N / bn), ceil(K / bk)], and config.json gets
    `quantization_config` {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
    "weight_block_size": block_size}. `per_tensor`: one scalar `X.weight_scale` per weight (no
    weight_block_size) and, with `activation_scheme` "static" (its default there), a calibrated
    `X.input_scale` (`calibrate_input_scales`: AutoFP8's format); "dynamic" writes none.
    Embeddings, the LM head, norms, MoE routers and the modules named in `not_convert` (written
    as `modules_to_not_convert`) keep their dtype; the tokenizer and other files are copied.
    """
    from safetensors.torch import save_file

    scheme = activation_scheme or ("static" if per_tensor else "dynamic")
    if scheme not in ("static", "dynamic") or (scheme == "static" and not per_tensor):
        raise ValueError(f"activation_scheme {activation_scheme!r}: 'dynamic', or 'static' with per_tensor")
    src, dst = pathlib.Path(src_dir), pathlib.Path(dst_dir)
    _copy_checkpoint_files(src, dst)
    input_scales = calibrate_input_scales(src) if scheme == "static" else {}
    out: dict[str, torch.Tensor] = {}
    for name, t in _read_checkpoint(src).items():
        if not _is_fp8_linear(name, t, tuple(not_convert)):
            out[name] = t.contiguous()
            continue
        prefix = name.removesuffix("weight")
        if per_tensor:
            scale = t.float().abs().amax().clamp(min=1e-12) / _FP8_MAX
            out[name] = (t.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
            out[prefix + "weight_scale"] = scale.reshape(())
            if scheme == "static":
                out[prefix + "input_scale"] = torch.tensor(input_scales[prefix.removesuffix(".")])
        else:
            out[name], out[prefix + "weight_scale_inv"] = _quantize_block(t, *block_size)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3"}
    qc["activation_scheme"] = scheme
    if not per_tensor:
        qc["weight_block_size"] = list(block_size)
    if not_convert:
        qc["modules_to_not_convert"] = list(not_convert)
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def dequantize_model_dir(fp8_dir: str | pathlib.Path, dst_dir: str | pathlib.Path) -> pathlib.Path:
    """Write the dequantized copy of FP8 checkpoint `fp8_dir` (weight * the scale of its block,
    in config.json's torch_dtype; input scales dropped; no quantization_config) into `dst_dir`:
    what `transformers` loads as the oracle of an FP8 model. Returns `dst_dir`."""
    from safetensors.torch import save_file

    src, dst = pathlib.Path(fp8_dir), pathlib.Path(dst_dir)
    _copy_checkpoint_files(src, dst)
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    dtype = _DTYPES[config.get("torch_dtype") or "float32"]
    sd = _read_checkpoint(src)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith((".weight_scale_inv", ".weight_scale", ".input_scale")):
            continue
        prefix = name.removesuffix("weight")
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t
        elif prefix + "weight_scale" in sd:
            out[name] = (t.float() * sd[prefix + "weight_scale"].float()).to(dtype)
        else:
            bn, bk = qc["weight_block_size"]
            scale = sd[prefix + "weight_scale_inv"]
            n, k = t.shape
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            out[name] = (t.float() * full).to(dtype)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
