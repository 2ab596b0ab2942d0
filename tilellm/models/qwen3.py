"""Qwen3 (dense): the Llama decoder plus a per-head RMSNorm of q and k before RoPE."""

from __future__ import annotations

from typing import Any

from tilellm.models.llama import DecoderFlags, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; see `LlamaForCausalLM`."""

    @classmethod
    def decoder_flags(cls, config: Any) -> DecoderFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
