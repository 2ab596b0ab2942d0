"""Greedy tokens of the engine == `transformers` on tiny random MoE checkpoints (fp32, CPU):
DeepSeek-V2 (MLA, softmax router, YaRN), DeepSeek-V3 (MLA with q_lora_rank, sigmoid router with
correction bias and expert groups) and Qwen3-MoE, under the engine settings the dense models
pass (the same batch and configurations as `test_greedy_vs_hf`, plus 64-token blocks).
"""

from __future__ import annotations

import pytest

from tests.engine.test_greedy_vs_hf import CONFIGS, MAX_TOKENS, _prompts, expected, run_twice
from tilellm import LLM, SamplingParams

MOE_CONFIGS = {**CONFIGS, "block_size_64": dict(num_kv_blocks=16, block_size=64)}
MODELS = ["tiny_deepseek_v2", "tiny_deepseek_v3", "tiny_qwen3_moe"]


def test_checkpoints_are_not_degenerate(request):
    """The oracle's continuations vary (no model repeats one token for every prompt), so that
    equal tokens say something."""
    for name in MODELS:
        want = expected(request.getfixturevalue(name))
        assert len({tuple(w) for w in want}) == len(want)
        assert all(len(set(w)) > 1 for w in want[1:])


@pytest.mark.parametrize("config", list(MOE_CONFIGS))
def test_deepseek_v2_greedy_matches_hf(tiny_deepseek_v2, config):
    llm, first, second = run_twice(tiny_deepseek_v2, **MOE_CONFIGS[config])
    want = expected(tiny_deepseek_v2)
    assert first == want
    assert second == want
    stats = llm.llm_engine.get_stats()
    if config == "tiny_pool_preempts":
        assert stats.num_preemptions > 0
    if config in ("default", "block_size_1"):
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("model", ["tiny_deepseek_v3", "tiny_qwen3_moe"])
@pytest.mark.parametrize("config", list(MOE_CONFIGS))
def test_v3_and_qwen3_moe_greedy_match_hf(request, model, config):
    model_dir = request.getfixturevalue(model)
    _, first, second = run_twice(model_dir, **MOE_CONFIGS[config])
    want = expected(model_dir)
    assert first == want
    assert second == want


@pytest.mark.parametrize("model", ["tiny_deepseek_v2"])
def test_triton_kernels_greedy_match_hf(request, model):
    """The Triton MLA / MoE / prefill kernels under the interpreter: prefill, cached-prefix and
    chunked steps, and decode. (DeepSeek-V2 runs every kernel the other two would: MLA, the
    unequal-dims prefill and fused MoE; V3's router and Qwen3-MoE's GQA are PyTorch or covered
    by the dense models' Triton test. On a GPU the whole file runs the Triton kernels.)"""
    model_dir = request.getfixturevalue(model)
    prompts = _prompts()[:4]
    want = [w[:4] for w in expected(model_dir)[:4]]
    llm = LLM(model_dir, num_kv_blocks=32, attention_backend="triton", max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert MAX_TOKENS >= 4
