"""The attention layer: this step's K/V into the paged cache, then the step's planned kernels.

The layer holds no per-step state and makes no choice: where tokens go and which kernels run
come from the `AttentionMetadata` the runner installs (`tilellm.attention.metadata`), carrying
the plan its backend made once for the step (`tilellm.attention.backends`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tilellm.attention import AttentionBackend, AttentionSpec, get_attention_metadata
from tilellm.attention.graph_break import attention_call
from tilellm.models.layers.layernorm import RMSNorm
from tilellm.models.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    """Paged multi-head attention over packed tokens (MHA, GQA or MQA).

    forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], positions [T] | None) -> o [T, Hq, D]

    Built with `rotary` (and Qwen3's per-head `q_norm` / `k_norm`), the layer takes q and k
    before their rotation with the tokens' `positions`: the backend then rotates them in the
    launch that stores K/V into the cache (`apply_rotary` with the cache arguments).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        *,
        rotary: RotaryEmbedding | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.rotary, self.q_norm, self.k_norm = rotary, q_norm, k_norm
        # [num_blocks, block_size, Hkv, D]; bound by the runner once the pool is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # FP8 caches: [1] float32 dequantization scales of K and V (device memory, so graphs
        # replay with their values); None for 16/32-bit caches.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # Set by the runner for the one step that measures the scales (`ModelRunner._forward`).
        self.calibrate_kv_scales = False
        # {"k": scale, "v": scale} when the checkpoint ships them (the loader fills it)
        self.checkpoint_kv_scales: dict[str, float] = {}

    def bind_kv_cache(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.k_scale, self.v_scale = k_scale, v_scale

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        """This layer's shape, for planning (block size 16 until a cache is bound)."""
        block_size = int(self.k_cache.shape[1]) if self.k_cache.dim() == 4 else 16
        cache_dtype = self.k_cache.dtype if self.k_cache.numel() else dtype
        return AttentionSpec(
            self.num_heads, self.num_kv_heads, self.head_dim, dtype, block_size, cache_dtype=cache_dtype
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        if (positions is None) != (self.rotary is None):
            raise ValueError(
                "Attention: pass positions exactly when the layer was built with a rotary embedding"
            )
        tensors = (q, k, v) if positions is None else (q, k, v, positions)
        return attention_call(self._attend, *tensors)  # a piecewise CUDA graph breaks here

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.backend.forward(self, q, k, v, get_attention_metadata(), positions=positions)

    def rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        kv_store: dict[str, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated (after Qwen3's norms); with `kv_store`, also stored (`RotaryEmbedding`)."""
        assert self.rotary is not None
        return self.rotary(positions, q, k, self.q_norm, self.k_norm, kv_store)


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention over a paged cache of latent rows.

    forward(q_nope [T, H, Dn], q_pe [T, H, Dr], latent [T, L], k_pe [T, Dr], kv_b_weight) -> o [T, H, Dv]

    Each token caches ONE row `[latent | k_pe]` of L + Dr values (576 for DeepSeek), shared by every
    query head: `kv_cache [num_blocks, block_size, 1, L + Dr]`. `kv_b_weight` [H (Dn + Dv), L] is
    this rank's `kv_b_proj` weight, whose per-head blocks W_UK [Dn, L] and W_UV [Dv, L] expand a
    latent into the head's key and value. The backend either expands the step's latents and runs
    ordinary prefill (new prompts), or absorbs W_UK into the queries and W_UV into the output so
    that attention reads the latent rows directly (decode, verification, cached prefixes).
    """

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        backend: AttentionBackend,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = 1
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.head_dim = kv_lora_rank + qk_rope_head_dim  # of a cached row and an absorbed query
        self.scale = scale
        self.backend = backend
        self.kv_cache = torch.empty(0)  # bound by the runner once the pool is allocated
        self.kv_scale: torch.Tensor | None = None  # an FP8 cache's [1] float32 scale
        self.calibrate_kv_scales = False
        # {"k": scale} (vLLM's MLA checkpoints name the latent cache's scale k_scale; a v_scale
        # they ship is unused) when the checkpoint has them
        self.checkpoint_kv_scales: dict[str, float] = {}

    def bind_kv_cache(self, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        self.kv_cache, self.kv_scale = kv_cache, kv_scale

    def spec(self, dtype: torch.dtype) -> AttentionSpec:
        block_size = int(self.kv_cache.shape[1]) if self.kv_cache.dim() == 4 else 16
        cache_dtype = self.kv_cache.dtype if self.kv_cache.numel() else dtype
        return AttentionSpec(
            self.num_heads, 1, self.head_dim, dtype, block_size, kv_lora_rank=self.kv_lora_rank,
            cache_dtype=cache_dtype,
        )  # fmt: skip

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        attend = functools.partial(self._attend, kv_b_weight=kv_b_weight)
        return attention_call(attend, q_nope, q_pe, latent, k_pe)  # a piecewise CUDA graph breaks here

    def _attend(self, q_nope, q_pe, latent, k_pe, *, kv_b_weight) -> torch.Tensor:
        return self.backend.forward_mla(
            self, q_nope, q_pe, latent, k_pe, kv_b_weight, get_attention_metadata()
        )


class SparseMLAAttention(MLAAttention):
    """DeepSeek-V3.2's sparse MLA (DSA): each query token attends only to the `index_topk` keys
    its lightning indexer scores highest (all of them when it has fewer).

    forward(q_nope, q_pe, latent, k_pe, kv_b_weight, index_q [T, Hi, Di], index_weights [T, Hi],
    index_k [T, Di]) -> o [T, H, Dv]

    Besides the latent rows, each token caches its indexer key in `index_cache [num_blocks,
    block_size, 1, Di]`, on the same block ids (so the prefix cache keeps and frees both together);
    with an FP8 KV cache in e4m3, with a scale per key in `index_scales [num_blocks, block_size]`.
    """

    def __init__(self, *args, index_topk: int, index_head_dim: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.index_topk = index_topk
        self.index_head_dim = index_head_dim
        self.index_scale = index_head_dim**-0.5
        self.index_cache = torch.empty(0)  # bound by the runner with the latent cache
        self.index_scales: torch.Tensor | None = None  # e4m3 keys: [num_blocks, block_size] fp32
        # [T, index_topk] the last eager step's selection, kept when `record_selection` (the runner
        # sets it on the first layer; `tilellm inspect` reads it; graph replays clear it)
        self.record_selection = False
        self.last_topk_indices: torch.Tensor | None = None

    def bind_index_cache(self, index_cache: torch.Tensor, index_scales: torch.Tensor | None = None) -> None:
        self.index_cache, self.index_scales = index_cache, index_scales

    def forward(  # type: ignore[override]
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        index_k: torch.Tensor,
    ) -> torch.Tensor:
        attend = functools.partial(self._attend_sparse, kv_b_weight=kv_b_weight)
        return attention_call(attend, q_nope, q_pe, latent, k_pe, index_q, index_weights, index_k)

    def _attend_sparse(
        self, q_nope, q_pe, latent, k_pe, index_q, index_weights, index_k, *, kv_b_weight
    ) -> torch.Tensor:
        return self.backend.forward_sparse_mla(
            self, q_nope, q_pe, latent, k_pe, kv_b_weight, index_q, index_weights, index_k,
            get_attention_metadata(),
        )  # fmt: skip
