"""The roofline of an offline workload: the least time any engine could take on this card.

Prefill runs at the matmul rate (2 FLOPs per active parameter per prompt token, plus causal
attention); each decode step reads the weights it touches and every live request's KV cache at
the copy rate (or, if larger, does its FLOPs at the matmul rate). A mixture-of-experts layer's
decode step touches the experts its tokens pick: with uniform routing, of E experts a batch of B
tokens choosing K each hits E (1 - (1 - K/E)^B) on average. Every request is admitted at once
(the workloads fit `max_num_seqs`), so decode step t carries the requests that want >= t tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


@dataclass(frozen=True)
class ModelCost:
    """Parameter and cache counts of one model (from its config)."""

    dense_params: int  # read by every decode step: attention, dense MLPs, shared experts, routers, LM head
    expert_params: int  # one routed expert of one MoE layer (gate + up + down)
    num_moe_layers: int
    num_experts: int
    top_k: int
    kv_bytes_per_token: int  # over every layer
    attn_flops_per_key: int  # per query token per key, over every layer (QK^T and PV), decode
    prefill_attn_flops_per_key: int  # the same in prefill (MLA expands the latents: 192 + 128 wide)

    def active_params(self) -> int:
        return self.dense_params + self.num_moe_layers * self.top_k * self.expert_params

    def decode_bytes(self, batch: int, live_tokens: int, itemsize: int = 2) -> float:
        hit = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch) if self.num_experts else 0
        weights = self.dense_params + self.num_moe_layers * hit * self.expert_params
        return weights * itemsize + live_tokens * self.kv_bytes_per_token


def model_cost(config: Any, itemsize: int = 2) -> ModelCost:
    h, layers, vocab = (
        _get(config, "hidden_size"),
        _get(config, "num_hidden_layers"),
        _get(config, "vocab_size"),
    )
    hq = _get(config, "num_attention_heads")
    if _get(config, "kv_lora_rank"):  # MLA
        rank, dr = _get(config, "kv_lora_rank"), _get(config, "qk_rope_head_dim")
        dn, dv, q_rank = (
            _get(config, "qk_nope_head_dim"),
            _get(config, "v_head_dim"),
            _get(config, "q_lora_rank"),
        )
        q = h * hq * (dn + dr) if not q_rank else h * q_rank + q_rank * hq * (dn + dr)
        attn = q + h * (rank + dr) + rank * hq * (dn + dv) + hq * dv * h
        kv_per_layer = (rank + dr) * itemsize
        # absorbed decode: each head scores 576-dim rows and sums 512-dim latents; prefill runs on
        # the expanded heads (qk dn + dr, v dv)
        flops_per_key = 2 * hq * ((rank + dr) + rank)
        prefill_flops_per_key = 2 * hq * (dn + dr + dv)
    else:
        d = _get(config, "head_dim") or h // hq
        hkv = _get(config, "num_key_value_heads") or hq
        attn = h * (hq + 2 * hkv) * d + hq * d * h
        kv_per_layer = 2 * hkv * d * itemsize
        flops_per_key = prefill_flops_per_key = 4 * hq * d
    num_experts = int(_get(config, "n_routed_experts") or _get(config, "num_experts") or 0)
    moe_inter = _get(config, "moe_intermediate_size") or 0
    if num_experts:
        if _get(config, "kv_lora_rank"):
            first = int(_get(config, "first_k_dense_replace", 0) or 0)
            freq = int(_get(config, "moe_layer_freq", 1) or 1)
            moe_layers = sum(1 for i in range(layers) if i >= first and i % freq == 0)
        else:
            step = int(_get(config, "decoder_sparse_step", 1) or 1)
            only = _get(config, "mlp_only_layers") or []
            moe_layers = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    else:
        moe_layers = 0
    shared = int(_get(config, "n_shared_experts", 0) or 0) * moe_inter
    dense_mlp = 3 * h * _get(config, "intermediate_size")
    per_moe_layer = h * num_experts + 3 * h * shared
    dense = layers * attn + (layers - moe_layers) * dense_mlp + moe_layers * per_moe_layer + vocab * h
    return ModelCost(
        dense_params=dense,
        expert_params=3 * h * moe_inter,
        num_moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=int(_get(config, "num_experts_per_tok", 0) or 0),
        kv_bytes_per_token=layers * kv_per_layer,
        attn_flops_per_key=layers * flops_per_key,
        prefill_attn_flops_per_key=layers * prefill_flops_per_key,
    )


def workload_roofline_s(
    config: Any, prompt_lens: list[int], max_tokens: list[int], copy_gbps: float, matmul_tflops: float
) -> float:
    """Seconds of the roofline (see the module docstring) for requests of `prompt_lens` tokens
    each generating `max_tokens` tokens."""
    cost = model_cost(config)
    rate = matmul_tflops * 1e12
    prefill = sum(
        2 * cost.active_params() * n + cost.prefill_attn_flops_per_key * n * (n + 1) / 2 for n in prompt_lens
    )
    seconds = prefill / rate
    # decode step t (t = 1 .. max - 1: the first output token comes with the prefill)
    for t in range(1, max(max_tokens)):
        live = [p + t for p, m in zip(prompt_lens, max_tokens) if m > t]
        if not live:
            break
        batch, tokens = len(live), sum(live)
        read = cost.decode_bytes(batch, tokens) / (copy_gbps * 1e9)
        flops = (2 * cost.active_params() * batch + cost.attn_flops_per_key * tokens) / rate
        seconds += max(read, flops)
    return seconds
