"""The attention layer: store this step's K/V in the paged cache, then run the right kernel.

The layer holds no per-step state: which kernel to call and where tokens go come from the
`AttentionMetadata` installed by the runner (see `tilellm.engine.metadata`).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from tilellm.engine.metadata import BatchKind, get_attention_metadata


def resolve_attention_ops(backend: str, device: torch.device | str) -> types.ModuleType:
    """Module implementing SPEC section 2 for `backend` ("triton" | "reference" | "auto").

    "auto" is Triton on CUDA and the PyTorch reference on CPU. "triton" on CPU works only when
    TRITON_INTERPRET=1 was set before triton was imported.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"attention_backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "reference"
    if backend == "triton":
        import tilellm.kernels as ops
    else:
        import tilellm.kernels.reference as ops
    return ops


class Attention(nn.Module):
    """Paged multi-head attention over packed tokens (MHA, GQA or MQA).

    forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops: types.ModuleType):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.ops = ops
        # [num_blocks, block_size, Hkv, D]; bound by the runner once the pool is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        ops = self.ops
        if self.k_cache.numel() == 0:
            # Profiling pass before the pool exists: plain causal prefill over this step's K/V.
            if meta.kind is not BatchKind.PREFILL:
                raise RuntimeError("KV cache not bound: only PREFILL steps can run without it")
            return ops.prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale=self.scale)
        ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.kind is BatchKind.PREFILL:
            return ops.prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale=self.scale)
        if meta.kind is BatchKind.DECODE and meta.cascade_prefix_len is not None:
            # Requests share their first blocks: read the shared keys once for the whole batch.
            return ops.cascade_decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_table,
                meta.seq_lens,
                meta.cascade_prefix_len,
                scale=self.scale,
            )
        if meta.kind is BatchKind.DECODE:
            return ops.decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_table,
                meta.seq_lens,
                scale=self.scale,
                max_seqlen_k=meta.max_seqlen_k,  # lets the split-KV plan skip reading seq_lens
            )
        if meta.num_decodes == 0:
            return ops.paged_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_table,
                meta.cu_seqlens_q,
                meta.seq_lens,
                meta.max_seqlen_q,
                scale=self.scale,
                max_seqlen_k=meta.max_seqlen_k,
            )
        # A mixed step: its leading one-token requests through the decode kernel (a query tile of
        # one token's heads), the others (prompt chunks, verification) through the paged kernel.
        nd, rest_cu = meta.split_decodes()
        out = torch.empty_like(q)
        ops.decode_attention(
            q[:nd],
            self.k_cache,
            self.v_cache,
            meta.block_table[:nd],
            meta.seq_lens[:nd],
            scale=self.scale,
            max_seqlen_k=meta.max_seqlen_k,
            out=out[:nd],
        )
        if nd < meta.seq_lens.shape[0]:
            ops.paged_attention(
                q[nd:],
                self.k_cache,
                self.v_cache,
                meta.block_table[nd:],
                rest_cu,
                meta.seq_lens[nd:],
                meta.max_seqlen_q,
                scale=self.scale,
                max_seqlen_k=meta.max_seqlen_k,
                out=out[nd:],
            )
        return out
