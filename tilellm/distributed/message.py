"""A step's model inputs as one flat int64 payload plus a small header: what rank 0 broadcasts.

    msg = encode_step(batch, graph_size)        # host: header [HEADER_WORDS] + arrays
    msg.write(words)                             # into any int64 buffer of msg.num_words
    inputs = decode_step(msg.header, payload)    # any rank: views into the payload tensor

The header alone fixes where every array lies in the payload, so a rank that has received the
header can receive the payload straight into device memory and view its arrays in place (no
host copy, no sync). The runner uses the same layout with one rank too: every rank runs the same
code on the same bytes.

Payload sections, in order; each starts on an even word (16-byte aligned, so that kernels see
the same pointer alignment every step), int32 arrays hold two values per word.
T packed tokens (the graph's batch size for graph steps), B requests, C block-table columns,
N sampled rows:
  input_ids           [T] int64
  positions           [T] int64
  slot_mapping        [T] int64    (-1: not stored)
  seq_lens            [B] int32    ([T] for graph steps: padding rows 1)
  block_table         [B, C] int32
  cu_seqlens_q        [B + 1] int32  eager steps only (a graph's rows are one token each)
  logits_indices      [N] int64
  cascade_prefix_len  [1] int32    only when the step shares a prefix (cascade decode)

Size of a graph step of 256 decode requests of up to 2048 tokens (block 16, so C = 128):
4 x 256 words (tokens, positions, slots, logits rows) + 128 (seq_lens) + 16,384 (the block
table) = 17,536 words, 137 KiB, and the 104-byte header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tilellm.engine.metadata import BatchKind, StepBatch

# -- header: HEADER_WORDS int64 ------------------------------------------------------------------
HEADER_WORDS = 13
OP, KIND, NUM_TOKENS, NUM_REQS, TABLE_COLS, NUM_LOGITS, MAX_SEQLEN_Q, MAX_SEQLEN_K, GRAPH, CASCADE = range(10)
NUM_WORDS, STEP_ID, NUM_DECODES = 10, 11, 12
OP_STEP, OP_STOP = 1, 2

_KINDS = (BatchKind.PREFILL, BatchKind.DECODE, BatchKind.MIXED)
_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)


@dataclass
class StepInputs:
    """One step's model inputs as tensors (views into a payload), on the payload's device.

    `graph`: replay the decode graph of batch size `input_ids.shape[0]`; rows past `num_reqs`
    are padding. Otherwise an eager forward of `num_reqs` requests.
    """

    kind: BatchKind
    graph: bool
    num_reqs: int
    max_seqlen_q: int
    max_seqlen_k: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    logits_indices: torch.Tensor
    cascade_prefix_len: torch.Tensor | None
    num_decodes: int = 0  # MIXED steps: leading one-token requests (see AttentionMetadata)


def payload_layout(header: np.ndarray) -> tuple[list[tuple[str, np.dtype, tuple[int, ...], int]], int]:
    """[(name, dtype, shape, word offset)] of the payload sections, and its length in words."""
    t, b, c, n = (int(header[i]) for i in (NUM_TOKENS, NUM_REQS, TABLE_COLS, NUM_LOGITS))
    graph = bool(header[GRAPH])
    sections = [
        ("input_ids", _I64, (t,)),
        ("positions", _I64, (t,)),
        ("slot_mapping", _I64, (t,)),
        ("seq_lens", _I32, (t if graph else b,)),
        ("block_table", _I32, (b, c)),
    ]
    if not graph:
        sections.append(("cu_seqlens_q", _I32, (b + 1,)))
    sections.append(("logits_indices", _I64, (n,)))
    if header[CASCADE]:
        sections.append(("cascade_prefix_len", _I32, (1,)))
    layout, offset = [], 0
    for name, dtype, shape in sections:
        offset += offset % 2  # every section 16-byte aligned, whatever the counts before it
        layout.append((name, dtype, shape, offset))
        count = math.prod(shape)
        offset += count if dtype == _I64 else (count + 1) // 2
    return layout, offset


@dataclass
class StepMessage:
    """A step ready to send: `header` and the arrays that `write` packs into the payload."""

    header: np.ndarray  # [HEADER_WORDS] int64
    arrays: dict[str, np.ndarray]

    @property
    def num_words(self) -> int:
        return int(self.header[NUM_WORDS])

    def write(self, out: np.ndarray) -> None:
        """Pack the arrays into `out` ([num_words] int64)."""
        layout, _ = payload_layout(self.header)
        for name, dtype, shape, offset in layout:
            count = math.prod(shape)
            if dtype == _I64:
                out[offset : offset + count] = self.arrays[name].reshape(-1)
            else:
                words = out[offset : offset + (count + 1) // 2].view(np.int32)
                words[:count] = self.arrays[name].reshape(-1)
                words[count:] = 0

    def to_words(self) -> np.ndarray:
        out = np.empty(self.num_words, dtype=np.int64)
        self.write(out)
        return out


def encode_step(batch: StepBatch, graph_size: int | None = None, step_id: int = 0) -> StepMessage:
    """The message of `batch` (CPU tensors); `graph_size`: pad a decode batch to that many rows
    for the CUDA graph of that batch size (padding rows: token 0, position 0, slot -1, seq_len 1)."""
    attn = batch.attn
    num_reqs = int(attn.seq_lens.shape[0])
    ids, pos = batch.input_ids.numpy(), batch.positions.numpy()
    slots, seq_lens = attn.slot_mapping.numpy(), attn.seq_lens.numpy()
    if graph_size is not None:
        if attn.kind is not BatchKind.DECODE or graph_size < num_reqs:
            raise ValueError(f"a graph step needs a decode batch of at most {graph_size} requests")
        pad = graph_size - num_reqs
        ids, pos = np.pad(ids, (0, pad)), np.pad(pos, (0, pad))
        slots = np.pad(slots, (0, pad), constant_values=-1)
        seq_lens = np.pad(seq_lens, (0, pad), constant_values=1)
    arrays = {
        "input_ids": ids,
        "positions": pos,
        "slot_mapping": slots,
        "seq_lens": seq_lens,
        "block_table": attn.block_table.numpy(),
        "logits_indices": batch.logits_indices.numpy(),
    }
    if graph_size is None:
        arrays["cu_seqlens_q"] = attn.cu_seqlens_q.numpy()
    cascade = attn.cascade_prefix_len
    if cascade is not None:
        arrays["cascade_prefix_len"] = cascade.numpy()
    header = np.zeros(HEADER_WORDS, dtype=np.int64)
    header[OP] = OP_STEP
    header[KIND] = _KINDS.index(attn.kind)
    header[NUM_TOKENS] = ids.shape[0]
    header[NUM_REQS] = num_reqs
    header[TABLE_COLS] = arrays["block_table"].shape[1]
    header[NUM_LOGITS] = arrays["logits_indices"].shape[0]
    header[MAX_SEQLEN_Q] = attn.max_seqlen_q
    header[MAX_SEQLEN_K] = attn.max_seqlen_k
    header[GRAPH] = graph_size is not None
    header[CASCADE] = cascade is not None
    header[STEP_ID] = step_id
    header[NUM_DECODES] = attn.num_decodes
    header[NUM_WORDS] = payload_layout(header)[1]
    return StepMessage(header, arrays)


_TORCH = {_I64: torch.int64, _I32: torch.int32}


def decode_step(header: np.ndarray, payload: torch.Tensor) -> StepInputs:
    """The step's inputs as views into `payload` ([NUM_WORDS] int64, on any device)."""
    layout, num_words = payload_layout(header)
    if payload.dtype != torch.int64 or payload.dim() != 1 or payload.shape[0] < num_words:
        raise ValueError(f"payload must be a 1-D int64 tensor of at least {num_words} words")
    views: dict[str, torch.Tensor] = {}
    for name, dtype, shape, offset in layout:
        count = math.prod(shape)
        if dtype == _I64:
            views[name] = payload[offset : offset + count].view(shape)
        else:
            words = payload[offset : offset + (count + 1) // 2]
            views[name] = words.view(torch.int32)[:count].view(shape)
    return StepInputs(
        kind=_KINDS[int(header[KIND])],
        graph=bool(header[GRAPH]),
        num_reqs=int(header[NUM_REQS]),
        max_seqlen_q=int(header[MAX_SEQLEN_Q]),
        max_seqlen_k=int(header[MAX_SEQLEN_K]),
        input_ids=views["input_ids"],
        positions=views["positions"],
        slot_mapping=views["slot_mapping"],
        seq_lens=views["seq_lens"],
        block_table=views["block_table"],
        cu_seqlens_q=views.get("cu_seqlens_q"),
        logits_indices=views["logits_indices"],
        cascade_prefix_len=views.get("cascade_prefix_len"),
        num_decodes=int(header[NUM_DECODES]),
    )


def stop_header() -> np.ndarray:
    header = np.zeros(HEADER_WORDS, dtype=np.int64)
    header[OP] = OP_STOP
    return header
