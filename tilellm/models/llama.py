"""The Llama-family decoder shared by Llama, Qwen2 and Qwen3 (they differ only in flags).

A step's tokens are packed along dim 0 with no batch dim: `model(input_ids [T], positions [T])`
returns hidden states [T, hidden]; `compute_logits(hidden [N, hidden])` gives logits [N, vocab]
in the model's dtype (the sampler widens them to float32 only where it needs to). Attention
reads the step's `AttentionMetadata` from the context installed by the runner (see
`tilellm.attention.metadata`); the runner binds each layer's KV cache through `attention_layers()`.

Checkpoint q/k/v and gate/up matrices are loaded into one `qkv_proj` and one `gate_up_proj`
per layer (`packed_modules_mapping`, used by `tilellm.models.loader`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tilellm.attention import AttentionBackend, get_attention_backend
from tilellm.models.layers.attention import Attention
from tilellm.models.layers.layernorm import RMSNorm
from tilellm.models.layers.linear import (
    LayerInput,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tilellm.models.layers.mlp import GatedMLP
from tilellm.models.layers.ops import resolve_fused_ops, resolve_moe_ops
from tilellm.models.layers.rotary_embedding import RotaryEmbedding, rope_config


def config_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class DecoderFlags:
    """Per-architecture switches, read from the config by each model class."""

    qkv_bias: bool  # biases on q_proj, k_proj, v_proj
    o_bias: bool  # bias on o_proj
    mlp_bias: bool  # biases on gate_proj, up_proj, down_proj
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE


class LlamaAttention(nn.Module):
    """qkv_proj -> (Qwen3: per-head RMSNorm of q and k) -> RoPE -> paged attention -> o_proj."""

    def __init__(
        self,
        config: Any,
        flags: DecoderFlags,
        rotary: RotaryEmbedding,
        attn_backend: AttentionBackend,
        fused_ops: types.ModuleType,
        tp_rank: int,
        tp_size: int,
    ):
        super().__init__()
        head_dim = config_head_dim(config)
        hidden = config.hidden_size
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, config.num_attention_heads, config.num_key_value_heads, flags.qkv_bias, **tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden, flags.o_bias, **tp)
        if flags.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, fused_ops)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, fused_ops)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary  # (the attention layer applies it; kept under vLLM's name)
        # q and k are rotated (after Qwen3's norms) inside the attention layer, in the launch that
        # also stores K/V into the paged cache
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, attn_backend,
            rotary=rotary, q_norm=self.q_norm, k_norm=self.k_norm,
        )  # fmt: skip

    @property
    def input_linear(self) -> QKVParallelLinear:
        """The one layer that reads this block's input (the norm before may quantize for it)."""
        return self.qkv_proj

    def forward(self, positions: torch.Tensor, hidden: LayerInput) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, positions)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(GatedMLP):
    """down_proj(silu(gate_proj x) * up_proj x), with gate and up in one matmul."""

    def __init__(
        self, config: Any, flags: DecoderFlags, fused_ops: types.ModuleType, tp_rank: int, tp_size: int
    ):
        super().__init__(
            config.hidden_size, config.intermediate_size, flags.mlp_bias, fused_ops, tp_rank, tp_size
        )


class PreNormDecoderLayer(nn.Module):
    """Pre-norm block. The residual stream is carried separately so that each residual add is
    fused into the next RMSNorm: (hidden, residual) -> (hidden, residual). Subclasses build
    `self_attn`, `mlp`, `input_layernorm` and `post_attention_layernorm` (the checkpoints' names)."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A sublayer whose input one linear layer reads names it (`input_linear`): an FP8 layer's
        # input is then quantized in the norm's launch (`RMSNorm.forward`'s quant_for).
        attn_in = getattr(self.self_attn, "input_linear", None)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, quant_for=attn_in)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quant_for=attn_in)
        hidden = self.self_attn(positions, hidden)
        mlp_in = getattr(self.mlp, "input_linear", None)
        hidden, residual = self.post_attention_layernorm(hidden, residual, quant_for=mlp_in)
        return self.mlp(hidden), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Llama's block: `LlamaAttention` and the gated MLP (or an MoE block)."""

    def __init__(
        self,
        config: Any,
        flags: DecoderFlags,
        rotary: RotaryEmbedding,
        attn_backend,
        fused_ops,
        tp_rank,
        tp_size,
        make_mlp: Callable[[], nn.Module],
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, flags, rotary, attn_backend, fused_ops, tp_rank, tp_size)
        self.mlp = make_mlp()  # LlamaMLP, or an MoE block (Qwen3-MoE); built after attention
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm. `make_mlp(layer_idx)` builds each layer's MLP."""

    def __init__(
        self,
        config: Any,
        flags: DecoderFlags,
        attn_backend,
        fused_ops,
        tp_rank: int,
        tp_size: int,
        make_mlp: Callable[[int], nn.Module],
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        theta, scaling = rope_config(config)
        # one table shared by every layer
        rotary = RotaryEmbedding(
            config_head_dim(config), config.max_position_embeddings, theta, scaling, fused_ops
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                flags,
                rotary,
                attn_backend,
                fused_ops,
                tp_rank,
                tp_size,
                functools.partial(make_mlp, i),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 (and, through the flags, Qwen2 and Qwen3) for packed-token inference.

    forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden_size]
    compute_logits(hidden [N, hidden_size]) -> logits [N, vocab_size] in the model's dtype
    """

    # checkpoint sub-name -> (parameter sub-name, shard id) for the merged projections
    packed_modules_mapping: ClassVar[dict[str, tuple[str, Any]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def decoder_flags(cls, config: Any) -> DecoderFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderFlags(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=False
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
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"{type(self).__name__}: sliding-window attention (use_sliding_window) is not supported"
            )
        self.config = config
        attn_backend = get_attention_backend(attention_backend, device)
        fused_ops = resolve_fused_ops(fused_ops_backend or attention_backend, device)
        self.moe_ops = resolve_moe_ops(fused_ops_backend or attention_backend, device)
        flags = self.decoder_flags(config)

        def make_mlp(layer_idx: int) -> nn.Module:
            return self.build_mlp(config, flags, layer_idx, fused_ops, tp_rank, tp_size)

        self.model = LlamaModel(config, flags, attn_backend, fused_ops, tp_rank, tp_size, make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_mlp(
        self,
        config: Any,
        flags: DecoderFlags,
        layer_idx: int,
        fused_ops: types.ModuleType,
        tp_rank: int,
        tp_size: int,
    ) -> nn.Module:
        """Layer `layer_idx`'s MLP (subclasses with experts override this; they run `self.moe_ops`)."""
        return LlamaMLP(config, flags, fused_ops, tp_rank, tp_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with biases on q, k and v (not on o)."""

    @classmethod
    def decoder_flags(cls, config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
