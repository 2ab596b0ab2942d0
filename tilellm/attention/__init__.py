"""Attention as the model sees it: the step's metadata, and the backends that run it.

`metadata.py`: what one step's attention layers read (`AttentionMetadata`, installed around the
forward with `attention_context`). `backends/`: one object per implementation (portable Triton,
Hopper Gluon, PyTorch reference) with FlashInfer's split: `plan(...)` once per step (which
kernel, the split-KV plan: host work, reused by every layer and by CUDA-graph capture) and
`forward(...)` per layer (no planning).
"""

from tilellm.attention.backends import AttentionBackend, AttentionPlan, AttentionSpec, get_attention_backend
from tilellm.attention.metadata import AttentionMetadata, BatchKind, attention_context, get_attention_metadata

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPlan",
    "AttentionSpec",
    "BatchKind",
    "attention_context",
    "get_attention_backend",
    "get_attention_metadata",
]
