"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and mixture-of-experts layers.

Attention (per token, H heads of Dn "nope" + Dr rotary query dims, Dv value dims):

    q        = q_proj(x)  or  q_b_proj(norm(q_a_proj(x)))        [H, Dn + Dr] -> q_nope, q_pe
    kv_a     = kv_a_proj_with_mqa(x)                              [L + Dr]     -> latent, k_pe
    latent   = kv_a_layernorm(latent)                             [L]  (kv_lora_rank; 512 in DeepSeek)
    q_pe, k_pe = RoPE(q_pe, k_pe)                                  k_pe shared by every head

With q_lora_rank, q_a_proj and kv_a_proj_with_mqa read the same x: they run as one GEMM,
`fused_qkv_a_proj` = [q_a_proj | kv_a_proj_with_mqa] (vLLM's name), loaded from the two checkpoint
matrices (`packed_modules_mapping`); an FP8 one then quantizes x once, in the input norm's launch
where nothing else reads x (`input_linear`).

Only the row [latent | k_pe] is cached (576 values for DeepSeek: about a tenth of a GQA model's
K and V of the same width). Keys and values are the latent expanded by `kv_b_proj` per head
(k_nope = W_UK latent, v = W_UV latent); `MLAAttention` and its backend decide whether to expand
(new prompts) or to absorb the expansion into q and o (decode, verification, cached prefixes).

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; the rotary kernel reads them as
the NeoX halves [evens | odds] and writes them so (`apply_rotary(..., interleaved=True)`: the
queries' and keys' rotary dims permuted alike, so scores are unchanged), without a gather.
YaRN scaling with DeepSeek's mscale: cos/sin scaled by the attention factor, the softmax scale by
mscale_all_dim^2.

MLP: layer i is an MoE block (routed + shared experts) when the config has routed experts,
i >= first_k_dense_replace and i % moe_layer_freq == 0; else a dense gated MLP. Routers:
DeepSeek-V2 softmax (group-limited by each group's best expert with `group_limited_greedy`),
DeepSeek-V3 sigmoid with `e_score_correction_bias` and groups ranked by their two best experts.
"""

from __future__ import annotations

import types
from typing import Any, ClassVar

import torch
from torch import nn

from tilellm.attention import AttentionBackend, get_attention_backend
from tilellm.models.layers.attention import MLAAttention
from tilellm.models.layers.layernorm import RMSNorm
from tilellm.models.layers.linear import (
    ColumnParallelLinear,
    LayerInput,
    MergedColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tilellm.models.layers.mlp import GatedMLP
from tilellm.models.layers.moe import MoEBlock, RouterConfig
from tilellm.models.layers.ops import resolve_fused_ops, resolve_moe_ops
from tilellm.models.layers.rotary_embedding import RotaryEmbedding, rope_config, yarn_softmax_scale
from tilellm.models.llama import PreNormDecoderLayer
from tilellm.models.parallel import divide
from tilellm.models.quantization import dequantize_linear_

# DeepSeek's q_a_layernorm / kv_a_layernorm use RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _num_routed_experts(config: Any) -> int:
    for name in ("n_routed_experts", "num_experts", "num_local_experts"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 0


class DeepseekV2Attention(nn.Module):
    """The projections around `MLAAttention`: x [T, hidden] -> [T, hidden] (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        attn_backend: AttentionBackend,
        fused_ops: types.ModuleType,
        rope_interleave: bool,
        tp_rank: int,
        tp_size: int,
    ):
        super().__init__()
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(total_heads, tp_size, "num_attention_heads")
        self.qk_nope_head_dim = int(config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.kv_a_size = kv_a_size = self.kv_lora_rank + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head_dim, False, **tp)
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, kv_a_size, bias)
        else:
            # [q_a_proj | kv_a_proj_with_mqa] in one GEMM; whole on every rank (tp_size 1), as
            # each of the two is
            self.fused_qkv_a_proj = MergedColumnParallelLinear(hidden, [self.q_lora_rank, kv_a_size], bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, fused_ops)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head_dim, False, **tp)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, fused_ops)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim), False, **tp
        )
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias, **tp)
        self.rotary_emb = rotary
        r = self.qk_rope_head_dim
        # DeepSeek's interleaved pairs: the rotary kernel reads them as [evens | odds] halves
        self.rope_interleave = rope_interleave
        _, scaling = rope_config(config)
        scale = qk_head_dim**-0.5 * yarn_softmax_scale(scaling)
        self.attn = MLAAttention(
            self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, r, self.v_head_dim, scale, attn_backend
        )

    @property
    def input_linear(self) -> MergedColumnParallelLinear | None:
        """The one layer that reads this block's input, where there is one (the norm before may
        quantize for it): `fused_qkv_a_proj`. Without q_lora_rank two layers read it."""
        return getattr(self, "fused_qkv_a_proj", None)

    def project_latents(self, hidden: LayerInput) -> tuple[LayerInput | None, torch.Tensor]:
        """hidden [T, hidden] -> (the q latent q_a_layernorm(q_a_proj(x)) [T, Lq] (FP8-quantized
        for an FP8 q_b_proj where it asks: `input_group_quant`), or None without q_lora_rank;
        kv_a [T, L + Dr], before kv_a_layernorm)."""
        if self.q_lora_rank is None:
            return None, self.kv_a_proj_with_mqa(hidden)
        q_a, kv_a = self.fused_qkv_a_proj(hidden).split([self.q_lora_rank, self.kv_a_size], dim=-1)
        return self.q_a_layernorm(q_a, quant_for=self.q_latent_linear), kv_a

    @property
    def q_latent_linear(self) -> ColumnParallelLinear | None:
        """The one layer that reads the q latent, q_b_proj (q_a_layernorm may quantize for it);
        None where the latent has several readers."""
        return getattr(self, "q_b_proj", None)

    def project(
        self,
        positions: torch.Tensor,
        hidden: LayerInput,
        latents: tuple[LayerInput | None, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> (q_nope [T, H, Dn], q_pe [T, H, Dr], latent [T, L], k_pe [T, Dr]),
        rope applied. `latents`: `project_latents(hidden)` when the caller already has them
        (DeepSeek-V3.2's indexer reads the q latent too)."""
        t = hidden.shape[0]
        q_latent, kv_a = latents if latents is not None else self.project_latents(hidden)
        q = self.q_proj(hidden) if q_latent is None else self.q_b_proj(q_latent)
        q = q.view(t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (the norm reads the row-strided view in place)
        k_pe = k_pe.unsqueeze(1)  # [T, 1, Dr]: one rotary key for every head
        # rotated into the NeoX layout [evens | odds] (the same for q and k: scores unchanged)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe, interleaved=self.rope_interleave)
        return q_nope, q_pe, latent, k_pe.squeeze(1)

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        """MLA reads `kv_b_proj.weight` raw (expanding the latent, or absorbed into q and o) and
        never applies it as a layer: an FP8 one is dequantized to `dtype` once, after loading
        (as vLLM does), so the attention sees the weight the checkpoint describes."""
        dequantize_linear_(self.kv_b_proj, dtype)

    def forward(self, positions: torch.Tensor, hidden: LayerInput) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe = self.project(positions, hidden)
        o = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight)  # [T, H, Dv]
        return self.o_proj(o.reshape(hidden.shape[0], self.num_heads * self.v_head_dim))


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """DeepSeek's block: MLA attention and a dense or MoE MLP, pre-norm (see `PreNormDecoderLayer`)."""

    def __init__(self, self_attn: DeepseekV2Attention, mlp: nn.Module, hidden: int, eps: float, fused_ops):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, fused_ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, fused_ops)


class DeepseekV2Model(nn.Module):
    def __init__(
        self, config: Any, layers: list[DeepseekV2DecoderLayer], fused_ops, tp_rank: int, tp_size: int
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 (and, with its router, V3) for packed-token inference.

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden_size]
    compute_logits(hidden [N, hidden_size]) -> logits [N, vocab_size] in the model's dtype
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    attention_class: ClassVar[type[DeepseekV2Attention]] = DeepseekV2Attention

    @classmethod
    def rope_interleave(cls, config: Any) -> bool:
        """Whether the rotary dims come in interleaved pairs (DeepSeek's layout; V3's
        `rope_interleave: false` checkpoints use NeoX halves)."""
        return bool(getattr(config, "rope_interleave", True))

    @classmethod
    def router_config(cls, config: Any) -> RouterConfig:
        """DeepSeek-V2: softmax scores; `group_limited_greedy` keeps the `topk_group` groups with
        the best single expert. As DeepSeek's own gate: the weights are renormalised when
        `norm_topk_prob` (and top-k > 1), otherwise scaled by `routed_scaling_factor`."""
        method = getattr(config, "topk_method", "greedy") or "greedy"
        grouped = method == "group_limited_greedy"
        top_k = int(config.num_experts_per_tok)
        renormalize = bool(getattr(config, "norm_topk_prob", False)) and top_k > 1
        scaling = 1.0 if renormalize else float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        return RouterConfig(
            num_experts=_num_routed_experts(config),
            top_k=top_k,
            scoring=getattr(config, "scoring_func", "softmax") or "softmax",
            num_groups=int(config.n_group or 1) if grouped else 1,
            topk_groups=int(config.topk_group or 1) if grouped else 1,
            group_score="max",
            renormalize=renormalize,
            scaling_factor=scaling,
            fp32_gate=True,
        )

    def __init__(
        self,
        config: Any,
        *,
        attention_backend: str = "auto",
        fused_ops_backend: str | None = None,
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        self.config = config
        attn_backend = get_attention_backend(attention_backend, device)
        fused_ops = resolve_fused_ops(fused_ops_backend or attention_backend, device)
        moe_ops = resolve_moe_ops(fused_ops_backend or attention_backend, device)
        theta, scaling = rope_config(config)
        rotary = RotaryEmbedding(
            int(config.qk_rope_head_dim), config.max_position_embeddings, theta, scaling, fused_ops
        )
        interleave = self.rope_interleave(config)
        router = self.router_config(config) if _num_routed_experts(config) else None
        first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(config, "moe_layer_freq", 1) or 1)
        layer_types = getattr(config, "mlp_layer_types", None)  # DeepSeek-V3.2's explicit list, if any
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        shared = int(getattr(config, "n_shared_experts", 0) or 0) * int(config.moe_intermediate_size or 0)
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        layers = []
        for i in range(config.num_hidden_layers):
            attn = self.attention_class(config, rotary, attn_backend, fused_ops, interleave, tp_rank, tp_size)
            sparse = layer_types[i] == "sparse" if layer_types else i >= first_dense and i % freq == 0
            if router is not None and sparse:
                mlp: nn.Module = MoEBlock(
                    config.hidden_size, config.moe_intermediate_size, router, moe_ops, fused_ops,
                    shared_intermediate_size=shared, mlp_bias=mlp_bias, **tp,
                )  # fmt: skip
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_bias, fused_ops, **tp)
            layers.append(
                DeepseekV2DecoderLayer(attn, mlp, config.hidden_size, config.rms_norm_eps, fused_ops)
            )
        if getattr(config, "q_lora_rank", None):  # the two down-projections load into one layer
            self.packed_modules_mapping = {
                **type(self).packed_modules_mapping,
                "q_a_proj": ("fused_qkv_a_proj", 0),
                "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
            }
        self.model = DeepseekV2Model(config, layers, fused_ops, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: V2's attention (rotary pairs interleaved unless `rope_interleave` is false)
    with the sigmoid router: the choice adds `e_score_correction_bias`, groups compete by the sum
    of their two best experts, the weights (without the bias) are renormalised and scaled."""

    @classmethod
    def router_config(cls, config: Any) -> RouterConfig:
        return RouterConfig(
            num_experts=_num_routed_experts(config),
            top_k=int(config.num_experts_per_tok),
            scoring="sigmoid",
            num_groups=int(getattr(config, "n_group", 1) or 1),
            topk_groups=int(getattr(config, "topk_group", 1) or 1),
            group_score="top2_sum",
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            correction_bias=True,
            fp32_gate=True,
        )
