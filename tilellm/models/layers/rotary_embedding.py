"""Rotary position embedding (NeoX / HF "rotate_half" layout) with plain, linear, Llama 3 and YaRN scaling.

The cos/sin table is computed once in fp32 on the CPU (even while the model is being built on
the meta device) and moved with the model: row p = [cos(p * f) | sin(p * f)] for the D/2
inverse frequencies f, times YaRN's attention factor where the scaling has one.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import nn

from tilellm.models.layers.layernorm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    scaling = {**scaling, "rope_type": rope_type}
    if rope_type == "yarn":  # its factor may be implied by the two lengths (DeepSeek-V3)
        scaling.setdefault("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    return theta, scaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(scaling: dict) -> float:
    factor = scaling.get("factor")
    if factor is None:
        return float(scaling["max_position_embeddings"]) / float(scaling["original_max_position_embeddings"])
    return float(factor)


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other scaling)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = (
        yarn_factor(scaling),
        scaling.get("mscale"),
        scaling.get("mscale_all_dim"),
    )
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def yarn_softmax_scale(scaling: dict | None) -> float:
    """DeepSeek's extra softmax scale under YaRN, mscale(factor, mscale_all_dim) squared (1 otherwise)."""
    if scaling is None or scaling["rope_type"] == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(yarn_factor(scaling), float(scaling["mscale_all_dim"])) ** 2


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: extrapolate the high frequencies, interpolate (divide by factor) the low ones, with a
    linear ramp between the dims that turn `beta_fast` and `beta_slow` times over the original length."""
    factor = yarn_factor(scaling)
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies f_i = theta^(-2i/D), rescaled per `scaling`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
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
        attention_factor = rope_attention_factor(scaling)
        cos_sin = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        # cos_sin_cache: [max_pos, D] fp32 = [cos | sin]; not in the checkpoint
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        kv_store: dict[str, torch.Tensor | None] | None = None,
        *,
        interleaved: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k); with `q_norm`/`k_norm` (Qwen3) the per-head RMSNorms run first, fused.

        kv_store: `apply_rotary`'s cache arguments (v, k_cache, v_cache, slot_mapping, k_scale,
        v_scale): the rotated keys and v also go into the paged cache, in the same launch.
        interleaved: the dims come in rotated pairs (DeepSeek); the outputs are in the NeoX layout
        (`apply_rotary`'s `interleaved`).
        """
        kwargs = dict(kv_store or {})
        if q_norm is not None:
            kwargs |= {"q_norm_weight": q_norm.weight, "k_norm_weight": k_norm.weight, "eps": q_norm.eps}
        if interleaved:
            kwargs["interleaved"] = True
        return self.ops.apply_rotary(q, k, positions, self.cos_sin_cache, **kwargs)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"
