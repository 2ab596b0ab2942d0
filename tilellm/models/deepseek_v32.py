"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (DSA).

Each layer's MLA attends, per query token, only to the `index_topk` keys (2048) that a small
"lightning indexer" scores highest. The indexer has its own projections:

    index_q  = wq_b(q_resid)                    [Hi, Di]   (q_resid = q_a_layernorm(q_a_proj(x)))
    index_k  = k_norm(wk(x))                    [Di]       LayerNorm; cached per token
    weights  = weights_proj(x) * Hi^-0.5        [Hi]
    RoPE (NeoX halves, unlike MLA's interleaved pairs) on the first qk_rope_head_dim dims of both
    score(t, s) = sum_h weights_h(t) * relu(Di^-0.5 * index_q_h(t) . index_k(s)),   s <= t

(64 heads of 128 in DeepSeek-V3.2). The indexer is replicated on every tensor-parallel rank, so
that all ranks select the same keys. The selection and the sparse attention run in the backend
(`AttentionBackend.forward_sparse_mla`); the MoE layers and the rest are DeepSeek-V3's.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tilellm.attention import AttentionBackend
from tilellm.models.deepseek_v2 import DeepseekV2Attention, DeepseekV3ForCausalLM
from tilellm.models.layers.attention import SparseMLAAttention
from tilellm.models.layers.layernorm import LayerNorm
from tilellm.models.layers.linear import ReplicatedLinear
from tilellm.models.layers.rotary_embedding import RotaryEmbedding

INDEX_NORM_EPS = 1e-6


class DeepseekV32Indexer(nn.Module):
    """The indexer's projections (checkpoint names `self_attn.indexer.*`)."""

    def __init__(self, config: Any):
        super().__init__()
        self.num_heads, self.head_dim = int(config.index_n_heads), int(config.index_head_dim)
        self.wq_b = ReplicatedLinear(int(config.q_lora_rank), self.num_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, INDEX_NORM_EPS)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads)
        self.weights_proj.weight.keep_fp32 = True  # type: ignore[attr-defined]  # as transformers keeps it

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden], q_resid [T, q_lora_rank] -> (index_q [T, Hi, Di], weights [T, Hi] fp32,
        index_k [T, Di])."""
        t, r = x.shape[0], rotary.head_dim
        q = self.wq_b(q_resid).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(1)  # [T, 1, Di]
        q_rot, k_rot = rotary(positions, q[..., :r], k[..., :r])
        q = torch.cat((q_rot, q[..., r:]), dim=-1)
        k = torch.cat((k_rot, k[..., r:]), dim=-1).squeeze(1)
        weights = F.linear(x.float(), self.weights_proj.weight) * self.num_heads**-0.5
        return q, weights, k


class DeepseekV32Attention(DeepseekV2Attention):
    """DeepSeek-V3's MLA projections with the indexer beside them, over `SparseMLAAttention`."""

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
        if not getattr(config, "q_lora_rank", None):
            raise ValueError("DeepseekV32ForCausalLM needs q_lora_rank (the indexer reads the q latent)")
        super().__init__(config, rotary, attn_backend, fused_ops, rope_interleave, tp_rank, tp_size)
        dense = self.attn
        self.attn = SparseMLAAttention(
            dense.num_heads, dense.kv_lora_rank, dense.qk_nope_head_dim, dense.qk_rope_head_dim,
            dense.v_head_dim, dense.scale, attn_backend,
            index_topk=int(config.index_topk), index_head_dim=int(config.index_head_dim),
        )  # fmt: skip
        self.indexer = DeepseekV32Indexer(config)

    @property
    def input_linear(self) -> None:
        """None: the indexer's wk and weights_proj read the block's input too."""
        return None

    @property
    def q_latent_linear(self) -> None:
        """None: the indexer's wq_b reads the q latent too."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        latents = self.project_latents(hidden)
        q_resid = latents[0]  # the q latent: read by both the MLA and the indexer
        q_nope, q_pe, latent, k_pe = self.project(positions, hidden, latents)
        index_q, index_weights, index_k = self.indexer(positions, hidden, q_resid, self.rotary_emb)
        o = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, index_q, index_weights, index_k)
        return self.o_proj(o.reshape(hidden.shape[0], self.num_heads * self.v_head_dim))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 for packed-token inference: DeepSeek-V3 with sparse attention in every layer.

    forward(input_ids [T], positions [T]) -> hidden [T, H]; see `DeepseekV2ForCausalLM`.
    """

    attention_class = DeepseekV32Attention

    @classmethod
    def rope_interleave(cls, config: Any) -> bool:
        return True  # V3.2's MLA always rotates interleaved pairs (its indexer NeoX halves)
