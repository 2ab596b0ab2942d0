"""The MoE routers (`tilellm.models.layers.moe.select_experts`) against transformers' gates on
random hidden states: the same experts and weights for DeepSeek-V2 (softmax, group-limited),
DeepSeek-V3 (sigmoid, correction bias, groups by their two best) and Qwen3-MoE."""

from __future__ import annotations

import pytest
import torch

from tilellm.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tilellm.models.layers.moe import RouterConfig, select_experts


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def _check(ours: RouterConfig, gate, bias=None, hidden=64, tokens=50):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden)
    with torch.no_grad():
        gate.weight.normal_(0, 0.5)
        _, want_w, want_ids = gate(x)
        logits = torch.nn.functional.linear(x.float(), gate.weight.float())
        got_w, got_ids = select_experts(logits, ours, bias)
    got_w, got_ids = _sorted(got_w, got_ids)
    want_w, want_ids = _sorted(want_w.float(), want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router_matches_transformers(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(
        hidden_size=64, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method=method, routed_scaling_factor=1.5, norm_topk_prob=False,
    )  # fmt: skip
    _check(DeepseekV2ForCausalLM.router_config(cfg), DeepseekV2TopkRouter(cfg))


def test_deepseek_v3_router_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    gate = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        gate.e_score_correction_bias.normal_(0, 0.3)
    _check(DeepseekV3ForCausalLM.router_config(cfg), gate, gate.e_score_correction_bias)


def test_qwen3_moe_router_matches_transformers():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    _check(RouterConfig(num_experts=16, top_k=4, renormalize=True), Qwen3MoeTopKRouter(cfg))


def test_deepseek_v2_renormalises_or_scales():
    """DeepSeek's own V2 gate: renormalised weights when norm_topk_prob (top-k > 1), else scaled."""
    from transformers import DeepseekV2Config

    on = DeepseekV2ForCausalLM.router_config(
        DeepseekV2Config(
            n_routed_experts=8, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=3.0
        )
    )
    off = DeepseekV2ForCausalLM.router_config(
        DeepseekV2Config(
            n_routed_experts=8, num_experts_per_tok=2, norm_topk_prob=False, routed_scaling_factor=3.0
        )
    )
    assert (on.renormalize, on.scaling_factor) == (True, 1.0)
    assert (off.renormalize, off.scaling_factor) == (False, 3.0)
    weights, _ = select_experts(torch.randn(5, 8), on)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))


def test_router_config_errors():
    with pytest.raises(ValueError, match="scoring"):
        RouterConfig(num_experts=8, top_k=2, scoring="relu")
    with pytest.raises(ValueError, match="n_group"):
        RouterConfig(num_experts=8, top_k=2, num_groups=3)
    with pytest.raises(ValueError, match="more than the experts of topk_group"):
        RouterConfig(num_experts=8, top_k=5, num_groups=4, topk_groups=2)
