"""Per-step metadata handed from the model runner to every attention layer.

The runner builds one `StepBatch` per engine step (a pure function of the scheduler's output)
and installs its `AttentionMetadata` with `attention_context(...)` around the model's forward.
Attention layers read it with `get_attention_metadata()`. The context manager always resets,
so a failed forward never leaks a stale batch into the next step.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass

import torch


class BatchKind(enum.Enum):
    """Which attention kernel a step can use (chosen by the runner, not guessed from None fields)."""

    PREFILL = "prefill"  # every request starts at position 0: K/V of this step are the whole context
    DECODE = "decode"  # every request has exactly one new token
    MIXED = "mixed"  # anything else: cached prefixes, chunked prefill, verification, decode together


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each packed token's K/V go and what each request attends to. Device tensors.

    Shapes (B requests, T packed new tokens of this step):
      cu_seqlens_q:  [B+1] int32, request i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
      seq_lens:      [B] int32, KV length of each request after this step (prefix + new)
      block_table:   [B, max_blocks_per_seq] int32, logical block -> physical block (-1 unused)
      slot_mapping:  [T] int64, physical slot of each new token's K/V; -1 = padding, not stored
    """

    kind: BatchKind
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass(frozen=True)
class StepBatch:
    """Everything the model needs for one step.

      input_ids:      [T] int64, the new tokens of all scheduled requests, packed
      positions:      [T] int64, each token's position inside its own request
      logits_indices: [B] int64, row of each request's last new token (only these reach the LM head)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor


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
