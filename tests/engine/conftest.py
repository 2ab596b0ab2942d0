"""Fixtures for the engine tests: tiny random checkpoints and a `transformers` greedy oracle."""

from __future__ import annotations

import pytest
import torch

# Two cores shared by many processes: one thread each is much faster than oversubscription.
torch.set_num_threads(1)

# The engine settings the logits processors (penalties, biases, bad words) are checked under.
PROCESSING_SETTINGS = {
    "default": dict(num_kv_blocks=96),
    "async": dict(num_kv_blocks=96),
    "tiny_pool_preempts": dict(num_kv_blocks=10, max_num_seqs=8),
    "speculative_plain_requests": dict(
        num_kv_blocks=96,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    ),
}


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from tilellm.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM", seed=1))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from tilellm.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", seed=2))


@pytest.fixture(scope="session")
def tiny_deepseek_v2(tmp_path_factory) -> str:
    """MLA with one q_proj (as DeepSeek-V2-Lite), group-limited softmax router, YaRN rope."""
    from tilellm.testing import make_tiny_moe_model

    yarn = {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
    }  # fmt: skip
    path = tmp_path_factory.mktemp("deepseek_v2")
    return str(make_tiny_moe_model(path, "DeepseekV2ForCausalLM", seed=3, rope_scaling=yarn))


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory) -> str:
    """MLA with q_a/q_b (q_lora_rank), sigmoid router with correction bias and groups."""
    from tilellm.testing import make_tiny_moe_model

    path = tmp_path_factory.mktemp("deepseek_v3")
    return str(make_tiny_moe_model(path, "DeepseekV3ForCausalLM", seed=4, q_lora_rank=48))


@pytest.fixture(scope="session")
def tiny_deepseek_v32(tmp_path_factory) -> str:
    """DeepSeek-V3.2: V3 plus the lightning indexer keeping the top 8 keys of each query token."""
    from tilellm.testing import make_tiny_moe_model

    path = tmp_path_factory.mktemp("deepseek_v32")
    return str(make_tiny_moe_model(path, "DeepseekV32ForCausalLM", seed=6, q_lora_rank=48))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    from tilellm.testing import make_tiny_moe_model

    return str(make_tiny_moe_model(tmp_path_factory.mktemp("qwen3_moe"), "Qwen3MoeForCausalLM", seed=5))


_HF_CACHE: dict[str, object] = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations by `transformers` (fp32, CPU), one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = _HF_CACHE.get(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos does
        _HF_CACHE[model_dir] = model
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs
