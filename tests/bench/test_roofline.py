"""The workload roofline (`tilellm.bench.roofline`): E1's documented anchor, and the MoE terms."""

from __future__ import annotations

import pytest

from tilellm.bench.roofline import model_cost, workload_roofline_s
from tilellm.bench.throughput import e1
from tilellm.testing import DEEPSEEK_V2_LITE_CONFIG, QWEN3_0_6B_CONFIG, QWEN3_30B_A3B_CONFIG


def test_e1_roofline_is_the_documented_anchor():
    """docs/workloads.md: E1 on Qwen3-0.6B at 4250 GB/s and 687 TFLOP/s is about 35,000 tok/s."""
    w = e1()
    seconds = workload_roofline_s(QWEN3_0_6B_CONFIG, [len(p) for p in w.prompts], w.max_tokens, 4250, 687)
    assert sum(w.max_tokens) / seconds == pytest.approx(35_000, rel=0.02)


def test_parameter_counts_match_the_released_models():
    dense = model_cost(QWEN3_0_6B_CONFIG)
    assert dense.active_params() == pytest.approx(0.596e9, rel=0.01)  # with the tied embedding once
    lite = model_cost(DEEPSEEK_V2_LITE_CONFIG)
    total = lite.dense_params + lite.num_moe_layers * lite.num_experts * lite.expert_params
    assert total == pytest.approx(15.7e9, rel=0.02)  # DeepSeek-V2-Lite: 15.7 B, 2.4 B active
    assert lite.active_params() == pytest.approx(2.4e9, rel=0.05)
    moe = model_cost(QWEN3_30B_A3B_CONFIG)
    assert moe.dense_params + moe.num_moe_layers * moe.num_experts * moe.expert_params == pytest.approx(
        30.5e9, rel=0.02
    )


def test_mla_cache_is_a_fraction_of_mha():
    """One 576-value row per layer and token: 27 x 576 x 2 bytes, against 16 heads of K (192) and
    V (128) for the same model without the latent."""
    lite = model_cost(DEEPSEEK_V2_LITE_CONFIG)
    assert lite.kv_bytes_per_token == 27 * 576 * 2
    assert lite.kv_bytes_per_token * 8 < 27 * 16 * (192 + 128) * 2


def test_experts_hit_grow_with_the_batch():
    moe = model_cost(QWEN3_30B_A3B_CONFIG)
    one = moe.decode_bytes(1, 0) - moe.dense_params * 2
    assert one == pytest.approx(moe.num_moe_layers * 8 * moe.expert_params * 2)
    full = moe.decode_bytes(4096, 0) - moe.dense_params * 2
    assert full == pytest.approx(moe.num_moe_layers * 128 * moe.expert_params * 2, rel=1e-3)
