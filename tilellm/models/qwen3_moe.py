"""Qwen3-MoE: Qwen3's attention, with sparse expert blocks in place of the MLP.

Layer i is an MoE block unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`
(then a dense MLP of `intermediate_size`). The router: softmax over the experts, the top
`num_experts_per_tok`, renormalised when `norm_topk_prob`; no shared experts.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

from tilellm.models.layers.moe import MoEBlock, RouterConfig
from tilellm.models.llama import DecoderFlags, LlamaMLP
from tilellm.models.qwen3 import Qwen3ForCausalLM


def _num_experts(config: Any) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; see `LlamaForCausalLM`."""

    def build_mlp(
        self,
        config: Any,
        flags: DecoderFlags,
        layer_idx: int,
        fused_ops: types.ModuleType,
        tp_rank: int,
        tp_size: int,
    ) -> nn.Module:
        num_experts = _num_experts(config)
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        sparse = (
            num_experts > 0
            and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer_idx + 1) % step == 0
        )
        if not sparse:
            return LlamaMLP(config, flags, fused_ops, tp_rank, tp_size)
        router = RouterConfig(
            num_experts=num_experts,
            top_k=int(config.num_experts_per_tok),
            scoring="softmax",
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )
        return MoEBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            router,
            self.moe_ops,
            fused_ops,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
