"""Per-step attention metadata handed from the model runner to every attention layer.

The runner plans each step once (`AttentionBackend.plan`, which returns this object) and
installs it with `attention_context(...)` around the model's forward; attention layers read it
with `get_attention_metadata()`. The context manager always resets, so a failed forward never
leaks a stale batch into the next step.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tilellm.attention.backends.base import AttentionPlan


class BatchKind(enum.Enum):
    """The shape of a step's batch (set where the step's inputs are built, not guessed from None fields)."""

    PREFILL = "prefill"  # every request starts at position 0: K/V of this step are the whole context
    DECODE = "decode"  # every request has exactly one new token
    MIXED = "mixed"  # anything else: cached prefixes, chunked prefill, verification, decode together


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each packed token's K/V go, what each request attends to, and the step's plan.

    Device tensors (B requests, T packed new tokens of this step):
      cu_seqlens_q:  [B+1] int32, request i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
      seq_lens:      [B] int32, KV length of each request after this step (prefix + new)
      block_table:   [B, max_blocks_per_seq] int32, logical block -> physical block
      slot_mapping:  [T] int64, physical slot of each new token's K/V; -1 = padding, not stored
      cascade_prefix_len: [1] int32 keys shared by every request of a DECODE step (cascade
        decode reads them once for the batch), or None
    num_decodes: MIXED steps only, the leading requests with exactly one new token (the step's
      builder puts them first; `plan.num_decodes` is what the backend runs as decode).
    plan: the backend's plan of this step (None only inside `AttentionBackend.plan`).
    """

    kind: BatchKind
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    cascade_prefix_len: torch.Tensor | None = None
    num_decodes: int = 0
    plan: AttentionPlan | None = None


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def attention_context(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Install `metadata` for the attention layers for the duration of one forward pass."""
    global _current
    previous, _current = _current, metadata
    try:
        yield metadata
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    """The metadata of the forward pass in progress; an error outside `attention_context`."""
    if _current is None:
        raise RuntimeError("attention layer called outside attention_context(): no step metadata installed")
    return _current
