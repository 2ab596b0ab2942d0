"""Rotary position embedding (NeoX / HF "rotate_half" layout) with plain, linear and Llama 3 scaling.

The cos/sin table is computed once in fp32 on the CPU (even while the model is being built on
the meta device) and moved with the model: row p = [cos(p * f) | sin(p * f)] for the D/2
inverse frequencies f.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import nn

from tilellm.models.layers.layernorm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_config(config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a HF config, old style (`rope_theta` + `rope_scaling`)
    or transformers-5 style (`rope_parameters` holding both)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    return theta, {**scaling, "rope_type": rope_type}


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies f_i = theta^(-2i/D), rescaled per `scaling`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # -- llama3: keep high frequencies, divide low ones by `factor`, interpolate in between --
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """forward(positions [T], q [T, Hq, D], k [T, Hkv, D]) -> rotated (q, k), new tensors.

    q and k may be strided views into the packed qkv projection: the kernel reads them in place.
    """

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict | None, ops: types.ModuleType
    ):
        super().__init__()
        self.head_dim, self.max_position, self.ops = head_dim, max_position, ops
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_pos, D/2]
        # cos_sin_cache: [max_pos, D] fp32 = [cos | sin]; not in the checkpoint
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k); with `q_norm`/`k_norm` (Qwen3) the per-head RMSNorms run first, fused."""
        if q_norm is None:
            return self.ops.apply_rotary(q, k, positions, self.cos_sin_cache)
        return self.ops.apply_rotary(
            q,
            k,
            positions,
            self.cos_sin_cache,
            q_norm_weight=q_norm.weight,
            k_norm_weight=k_norm.weight,
            eps=q_norm.eps,
        )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"
