"""Per-step metadata handed from the model runner to every attention layer.

The runner builds one `StepBatch` per engine step (a pure function of the scheduler's output)
and installs its `AttentionMetadata` with `attention_context(...)` around the model's forward.
Attention layers read it with `get_attention_metadata()`. The context manager always resets,
so a failed forward never leaks a stale batch into the next step.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
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
    # DECODE steps whose requests share their first blocks: the shared key count, [1] int32
    # (cascade attention reads those keys once for the whole batch). None: plain decode.
    cascade_prefix_len: torch.Tensor | None = None
    # MIXED steps: the leading requests with exactly one new token (the scheduler lists them
    # first). The attention layer runs them through the decode kernel and the others through
    # the paged kernel, whose query tiles would be mostly empty rows for one-token requests.
    num_decodes: int = 0
    # cu_seqlens_q of the requests after the decodes, counted from their first token: [B - num_decodes + 1]
    # (made once per step by the runner; derived from cu_seqlens_q when absent).
    rest_cu_seqlens_q: torch.Tensor | None = None

    def split_decodes(self) -> tuple[int, torch.Tensor]:
        """(num_decodes, cu_seqlens_q of the other requests relative to their first token)."""
        nd = self.num_decodes
        rest = self.rest_cu_seqlens_q
        if rest is None:
            rest = self.cu_seqlens_q[nd:] - nd
        return nd, rest


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


CASCADE_MIN_REQUESTS = 8  # below this the prefix is re-read by few requests: plain decode is as fast
CASCADE_MIN_PREFIX = 256  # keys; a short shared prefix saves less than the extra pass and merge cost


def shared_prefix_len(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """Keys shared by every request of a decode batch: the leading block-table columns equal in
    all rows (the prefix cache hands out the same physical blocks), strictly before each
    request's last key. 0 when the batch is too small or the prefix too short to pay."""
    num_reqs = block_table.shape[0]
    if num_reqs < CASCADE_MIN_REQUESTS:
        return 0
    max_blocks = int((seq_lens.min() - 1) // block_size)
    if max_blocks * block_size < CASCADE_MIN_PREFIX:
        return 0
    same = (block_table[:, :max_blocks] == block_table[:1, :max_blocks]).all(axis=0)
    blocks = max_blocks if same.all() else int(np.argmin(same))
    prefix = blocks * block_size
    return prefix if prefix >= CASCADE_MIN_PREFIX else 0


def num_leading_decodes(q_lens) -> int:
    """How many requests at the front of a batch compute exactly one token (`q_lens`: [B] ints)."""
    for i, n in enumerate(q_lens):
        if n != 1:
            return i
    return len(q_lens)


def choose_batch_kind(starts: np.ndarray, q_lens: np.ndarray) -> BatchKind:
    """PREFILL when every request starts at position 0 (no cached prefix), DECODE when every
    request has exactly one new token, MIXED otherwise."""
    if not starts.any():
        return BatchKind.PREFILL
    if (q_lens == 1).all():
        return BatchKind.DECODE
    return BatchKind.MIXED


def build_step_batch(
    token_ids: list[list[int]],
    starts: list[int],
    q_lens: list[int],
    rows: list[int],
    samples: list[bool],
    block_tables: np.ndarray,
    block_size: int,
) -> StepBatch:
    """The `StepBatch` (CPU tensors) of one scheduled step; a pure function of its arguments.

    Request `i` computes tokens `token_ids[i][starts[i] : starts[i] + q_lens[i]]`; its blocks are
    `block_tables[rows[i]]`, which holds exactly the `ceil((starts[i] + q_lens[i]) / block_size)`
    blocks covering its tokens, then -1 (as the block manager keeps it). `logits_indices` holds
    the last row of each request with `samples[i]` (only those reach the LM head), in batch order.
    Vectorised with numpy: no Python work per token, one list lookup per request.
    """
    num_reqs = len(q_lens)
    q = np.asarray(q_lens, dtype=np.int64)
    start = np.asarray(starts, dtype=np.int64)
    seq_lens = start + q
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    num_tokens = int(cu[-1])

    # -- input ids: only the tokens not computed yet --
    if num_tokens == num_reqs:  # decode-like: one token per request
        ids = np.fromiter((t[s] for t, s in zip(token_ids, starts)), dtype=np.int64, count=num_reqs)
    else:
        ids = np.fromiter(
            itertools.chain.from_iterable(t[s : s + n] for t, s, n in zip(token_ids, starts, q_lens)),
            dtype=np.int64,
            count=num_tokens,
        )

    # -- positions and slots: token k of request i sits at position starts[i] + k --
    req_of_token = np.repeat(np.arange(num_reqs), q)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(start - cu[:-1], q)
    num_blocks = (seq_lens + block_size - 1) // block_size
    table = block_tables[np.asarray(rows, dtype=np.int64), : int(num_blocks.max())]
    block_of_token = table[req_of_token, positions // block_size].astype(np.int64)
    slots = block_of_token * block_size + positions % block_size

    logits_indices = cu[1:][np.asarray(samples, dtype=bool)] - 1
    kind = choose_batch_kind(start, q)
    prefix = shared_prefix_len(table, seq_lens, block_size) if kind is BatchKind.DECODE else 0
    num_decodes = num_leading_decodes(q.tolist())
    attn = AttentionMetadata(
        kind=kind,
        cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(seq_lens.max()),
        block_table=torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32)),
        slot_mapping=torch.from_numpy(slots),
        cascade_prefix_len=torch.tensor([prefix], dtype=torch.int32) if prefix else None,
        num_decodes=num_decodes if kind is BatchKind.MIXED else 0,
    )
    return StepBatch(
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(positions),
        attn=attn,
        logits_indices=torch.from_numpy(logits_indices),
    )
