"""The attention layer: this step's K/V into the paged cache, then the step's planned kernels.

The layer holds no per-step state and makes no choice: where tokens go and which kernels run
come from the `AttentionMetadata` the runner installs (`tilellm.attention.metadata`), carrying
the plan its backend made once for the step (`tilellm.attention.backends`).
"""

from __future__ import annotations

import torch
from torch import nn

from tilellm.attention import AttentionBackend, AttentionSpec, get_attention_metadata


class Attention(nn.Module):
    """Paged multi-head attention over packed tokens (MHA, GQA or MQA).

    forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # [num_blocks, block_size, Hkv, D]; bound by the runner once the pool is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        """This layer's shape, for planning (block size 16 until a cache is bound)."""
        block_size = int(self.k_cache.shape[1]) if self.k_cache.dim() == 4 else 16
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, dtype, block_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(self, q, k, v, get_attention_metadata())
