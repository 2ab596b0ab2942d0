"""One step's model inputs: the single form they take from the scheduler's output to the kernels.

    inputs = build_step_inputs(token_ids, starts, q_lens, rows, samples, block_tables, block_size)
    inputs = inputs.padded_to(bucket)              # a decode step replayed from a CUDA graph
    header = inputs.header(step_id)                # [HEADER_WORDS] int64: scalars and shapes
    inputs.write(words)                            # the arrays into any int64 buffer of header[NUM_WORDS]
    device = StepInputs.from_payload(header, payload)   # any rank: views into the payload tensor
    meta = device.attention_metadata()             # what the attention backend plans

`build_step_inputs` is a pure function of the scheduler's output (numpy arrays: the host's
form). The serialization is derived from the dataclass's fields: scalars (`_SCALAR`) go into the
header, arrays (`_array(dtype)`) into the payload, each starting on an even word (16-byte
aligned, so kernels see the same pointer alignment every step; int32 arrays hold two values per
word); the header alone fixes where every array lies, so a rank that has received it can
receive the payload straight into device memory and view its arrays in place (no host copy, no
sync). One device uses the same path as tensor parallelism: every rank runs the same code on the
same bytes. Adding an input is one field here and its use in the consumer.

Shapes: T packed tokens (the graph's batch size for graph steps), B requests, C block-table
columns, N sampled rows. A graph step of 256 decode requests of up to 2048 tokens (block 16, so
C = 128) is 4 x 256 words (tokens, positions, slots, logits rows) + 128 (seq_lens) + 129
(cu_seqlens_q) + 16,384 (the block table) words, about 138 KiB.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tilellm.attention import AttentionMetadata, BatchKind
from tilellm.distributed.group import CONTROL_WORDS, OP, OP_STEP

CASCADE_MIN_REQUESTS = 8  # below this the prefix is re-read by few requests: plain decode is as fast
CASCADE_MIN_PREFIX = 256  # keys; a short shared prefix saves less than the extra pass and merge cost

_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)
_TORCH = {_I64: torch.int64, _I32: torch.int32}
_KINDS = (BatchKind.PREFILL, BatchKind.DECODE, BatchKind.MIXED)
_SCALAR = {"scalar": True}


def _array(dtype: np.dtype, ndim: int = 1, optional: bool = False) -> Any:
    return field(default=None if optional else dataclasses.MISSING, metadata={"dtype": dtype, "ndim": ndim})


@dataclass
class StepInputs:
    """Everything the model and the attention layers need for one step (see the module docstring).

    Arrays are numpy on the host (from `build_step_inputs`) and torch views into one payload on
    the device (from `from_payload`).

      input_ids:      [T] int64, the new tokens of all scheduled requests, packed (-1: a token
                      the previous step samples, patched in on the device)
      positions:      [T] int64, each token's position inside its own request
      slot_mapping:   [T] int64, physical slot of each new token's K/V (-1: padding, not stored)
      seq_lens:       [T] int32 for graph steps (padding rows 1), else [B]: KV length after the step
      block_table:    [B, C] int32, logical block -> physical block
      cu_seqlens_q:   [B + 1] int32, request i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
      logits_indices: [N] int64, row of each sampled request's last new token (only these reach
                      the LM head), in batch order
      cascade_prefix_len: [1] int32, DECODE steps whose requests share their first blocks: the
                      shared key count (cascade attention reads it once for the batch), else None
      prompt_logits_indices: [M] int64, rows whose logits give prompt logprobs (each predicts the
                      prompt token in prompt_logits_targets [M] int64), or None
    num_decodes: MIXED steps, the leading requests with exactly one new token (the scheduler lists
      them first; the attention backend runs them through the decode kernel). 0 otherwise.
    graph_size: 0 for an eager forward, else the CUDA-graph batch size it replays.
    verify_width: 0, or W for a verification step whose every request has exactly W new tokens
      (its one token and a draft padded to W - 1: the shape a verification graph replays).
    """

    kind: BatchKind = field(metadata=_SCALAR)
    num_reqs: int = field(metadata=_SCALAR)
    max_seqlen_q: int = field(metadata=_SCALAR)
    max_seqlen_k: int = field(metadata=_SCALAR)
    num_decodes: int = field(metadata=_SCALAR)
    graph_size: int = field(metadata=_SCALAR)
    input_ids: Any = _array(_I64)
    positions: Any = _array(_I64)
    slot_mapping: Any = _array(_I64)
    seq_lens: Any = _array(_I32)
    block_table: Any = _array(_I32, ndim=2)
    cu_seqlens_q: Any = _array(_I32)
    logits_indices: Any = _array(_I64)
    cascade_prefix_len: Any = _array(_I32, optional=True)
    prompt_logits_indices: Any = _array(_I64, optional=True)
    prompt_logits_targets: Any = _array(_I64, optional=True)
    verify_width: int = field(default=0, metadata=_SCALAR)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def padded_to(self, graph_size: int) -> StepInputs:
        """This decode step (host arrays) padded to `graph_size` rows for the CUDA graph of that
        batch size (padding rows: token 0, position 0, slot -1, seq_len 1)."""
        if self.kind is not BatchKind.DECODE or graph_size < self.num_reqs:
            raise ValueError(f"a graph step needs a decode batch of at most {graph_size} requests")
        pad = graph_size - self.num_reqs
        return dataclasses.replace(
            self,
            graph_size=graph_size,
            input_ids=_pad_rows(self.input_ids, pad, 0),
            positions=_pad_rows(self.positions, pad, 0),
            slot_mapping=_pad_rows(self.slot_mapping, pad, -1),
            seq_lens=_pad_rows(self.seq_lens, pad, 1),
        )

    def padded_requests_to(self, graph_size: int) -> StepInputs:
        """This uniform verification step (host arrays, `verify_width` W) padded with requests
        of W tokens that store nothing and attend to W keys of block 0, for the verification
        graph of `graph_size` requests."""
        w = self.verify_width
        if not w or graph_size < self.num_reqs:
            raise ValueError(
                f"a verification graph step needs a uniform batch of at most {graph_size} requests"
            )
        pad = graph_size - self.num_reqs
        return dataclasses.replace(
            self,
            num_reqs=graph_size,
            graph_size=graph_size,
            input_ids=_pad_rows(self.input_ids, pad * w, 0),
            positions=_pad_rows(self.positions, pad * w, 0),
            slot_mapping=_pad_rows(self.slot_mapping, pad * w, -1),
            seq_lens=_pad_rows(self.seq_lens, pad, w),
            block_table=_pad_rows(self.block_table, pad, 0),
            cu_seqlens_q=np.arange(graph_size + 1, dtype=np.int32) * w,
        )

    # -- serialization ----------------------------------------------------------------------

    def header(self, step_id: int = 0) -> np.ndarray:
        """[HEADER_WORDS] int64: op, step id, payload words, the scalars, every array's shape."""
        # (built as a list, then one array: every step builds one, and per-element numpy writes
        # cost more than the list)
        words = [0] * _SCALAR_BASE
        words[OP], words[STEP_ID] = OP_STEP, step_id
        for f in _SCALARS:
            value = getattr(self, f.name)
            words.append(_KINDS.index(value) if f.name == "kind" else int(value))
        shapes = []
        for f in _ARRAYS:
            a = getattr(self, f.name)
            if a is None:
                shapes += (-1, -1)
            else:
                shape = a.shape
                shapes += (int(shape[0]), int(shape[1]) if len(shape) > 1 else 0)
        words[NUM_WORDS] = _layout_of(tuple(shapes))[1]
        words += shapes
        header = np.zeros(HEADER_WORDS, dtype=np.int64)
        header[: len(words)] = words
        return header

    def write(self, out: np.ndarray, header: np.ndarray) -> None:
        """Pack the arrays into `out` ([header[NUM_WORDS]] int64), where `header` says."""
        out32 = out.view(np.int32)  # (int32 arrays start on a whole word: at 2 * offset here)
        for name, dtype, shape, offset in _layout(header)[0]:
            count = math.prod(shape)
            a = getattr(self, name)
            if dtype == _I64:
                out[offset : offset + count] = a.reshape(-1)
            else:
                out32[2 * offset : 2 * offset + count] = a.reshape(-1)
                if count % 2:
                    out32[2 * offset + count] = 0  # the last word's unused half

    def to_words(self, header: np.ndarray) -> np.ndarray:
        out = np.empty(int(header[NUM_WORDS]), dtype=np.int64)
        self.write(out, header)
        return out

    @classmethod
    def from_payload(cls, header: np.ndarray, payload: torch.Tensor) -> StepInputs:
        """The step's inputs as views into `payload` ([header[NUM_WORDS]] int64, on any device)."""
        layout, num_words = _layout(header)
        if payload.dtype != torch.int64 or payload.dim() != 1 or payload.shape[0] < num_words:
            raise ValueError(f"payload must be a 1-D int64 tensor of at least {num_words} words")
        values: dict[str, Any] = {}
        scalars = header[_SCALAR_BASE : _SCALAR_BASE + len(_SCALARS)].tolist()
        for f, v in zip(_SCALARS, scalars):
            values[f.name] = _KINDS[v] if f.name == "kind" else v
        payload32 = None  # (one int32 view for every int32 array: each view op costs host time)
        for name, dtype, shape, offset in layout:
            count = math.prod(shape)
            if dtype == _I64:
                t = payload[offset : offset + count]
            else:
                if payload32 is None:
                    payload32 = payload.view(torch.int32)
                t = payload32[2 * offset : 2 * offset + count]
            values[name] = t if len(shape) == 1 else t.view(shape)
        return cls(**values)

    # -- what the attention layers read -----------------------------------------------------

    def attention_metadata(self) -> AttentionMetadata:
        """The step's attention metadata (device views of this step's arrays), before planning."""
        return AttentionMetadata(
            kind=self.kind,
            cu_seqlens_q=self.cu_seqlens_q,
            seq_lens=self.seq_lens,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            cascade_prefix_len=self.cascade_prefix_len,
            num_decodes=self.num_decodes,
        )


def _pad_rows(a: np.ndarray, pad: int, value: int) -> np.ndarray:
    """`a` with `pad` rows of `value` appended (`a` itself for none). Every decode step of a
    graph pads its arrays: `np.pad` costs about 8 us a call on the host, this about 1."""
    if pad == 0:
        return a
    out = np.empty((a.shape[0] + pad, *a.shape[1:]), dtype=a.dtype)
    out[: a.shape[0]] = a
    out[a.shape[0] :] = value
    return out


_SCALARS = [f for f in dataclasses.fields(StepInputs) if f.metadata.get("scalar")]
_ARRAYS = [f for f in dataclasses.fields(StepInputs) if "dtype" in f.metadata]

# -- header: HEADER_WORDS int64, the tensor-parallel control message's payload -------------------
STEP_ID, NUM_WORDS = 1, 2  # word OP (0) is the control message's op
_SCALAR_BASE = 3
_SHAPE_BASE = _SCALAR_BASE + len(_SCALARS)
HEADER_WORDS = _SHAPE_BASE + 2 * len(_ARRAYS)
assert HEADER_WORDS <= CONTROL_WORDS


def _layout(header: np.ndarray) -> tuple[tuple[tuple[str, np.dtype, tuple[int, ...], int], ...], int]:
    """((name, dtype, shape, word offset), ...) of the arrays present, and the payload's length in
    words. Read once per step by each of header / write / from_payload: cached by the shapes."""
    return _layout_of(tuple(header[_SHAPE_BASE:HEADER_WORDS].tolist()))


@functools.lru_cache(maxsize=512)
def _layout_of(shapes: tuple[int, ...]) -> tuple[tuple[tuple[str, np.dtype, tuple[int, ...], int], ...], int]:
    layout, offset = [], 0
    for i, f in enumerate(_ARRAYS):
        d0, d1 = shapes[2 * i], shapes[2 * i + 1]
        if d0 < 0:
            continue  # an optional array this step does not have
        shape = (d0, d1) if f.metadata["ndim"] == 2 else (d0,)
        dtype = f.metadata["dtype"]
        offset += offset % 2  # every array 16-byte aligned, whatever the counts before it
        layout.append((f.name, dtype, shape, offset))
        count = math.prod(shape)
        offset += count if dtype == _I64 else (count + 1) // 2
    return tuple(layout), offset


# -- the builder ---------------------------------------------------------------------------------


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


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[sum(lengths)] int64: range(starts[0], starts[0] + lengths[0]), then the next range, ...
    (the rows of every request's run, without a Python loop)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64), lengths) + offsets


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


def build_step_inputs(
    token_ids: list[list[int]] | None,
    starts: list[int],
    q_lens: list[int],
    rows: list[int] | np.ndarray,
    samples: list[bool],
    block_tables: np.ndarray,
    block_size: int,
    *,
    store: bool = True,
    cascade: bool = True,
    draft_token_ids: list[list[int]] | None = None,
    pad_drafts_to: int = 0,
    prompt_rows: list[tuple[int, int] | None] | None = None,
) -> StepInputs:
    """The `StepInputs` (host arrays) of one scheduled step; a pure function of its arguments.

    Request `i` computes tokens `token_ids[i][starts[i] : starts[i] + q_lens[i]]` (None: zeros,
    for warm-up steps); its blocks are `block_tables[rows[i]]`, which holds exactly the
    `ceil((starts[i] + q_lens[i]) / block_size)` blocks covering its tokens, then -1 (as the
    block manager keeps it). `logits_indices` holds the last row of each request with
    `samples[i]`, in batch order. `store=False`: every slot -1 (nothing is written: profiling and
    warm-up passes). `cascade=False`: never plan a shared prefix. Vectorised with numpy: no
    Python work per token, one list lookup per request.

    Speculative decoding: `draft_token_ids[i]` (d tokens, may be empty) are the last d of request
    i's `q_lens[i]` new tokens, after its known ones; a sampled request then has logits at each
    of its last d + 1 rows (the draft's verification), listed in order in `logits_indices`.
    `prompt_rows[i]` (first, end): request i needs the logits at its positions [first, end) for
    prompt logprobs (`prompt_logits_indices`, each predicting the token after it).
    `pad_drafts_to` k (every request then decodes, with at most k draft tokens): each draft is
    padded to k tokens that store nothing (slot -1), so that every request has k + 1 rows
    (`verify_width`), the shape a verification CUDA graph replays. A padding row's position is
    its request's last real one and its keys run on past its sequence through block 0 (the
    table's unallocated entries): it reads finite values, and only padding rows read them.
    """
    if pad_drafts_to:
        assert draft_token_ids is not None
        return _padded_verification(
            token_ids, starts, q_lens, rows, samples, block_tables, block_size, draft_token_ids, pad_drafts_to
        )
    num_reqs = len(q_lens)
    q = np.asarray(q_lens, dtype=np.int64)
    start = np.asarray(starts, dtype=np.int64)
    seq_lens = start + q
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    num_tokens = int(cu[-1])

    # -- input ids: only the tokens not computed yet --
    num_drafts = None
    if draft_token_ids is not None:
        num_drafts = np.fromiter((len(d) for d in draft_token_ids), dtype=np.int64, count=num_reqs)
    if token_ids is None:
        ids = np.zeros(num_tokens, dtype=np.int64)
    elif num_drafts is not None and num_drafts.any():
        ids = np.fromiter(
            itertools.chain.from_iterable(
                itertools.chain(t[s : s + n - len(d)], d)
                for t, s, n, d in zip(token_ids, starts, q_lens, draft_token_ids)  # type: ignore[arg-type]
            ),
            dtype=np.int64,
            count=num_tokens,
        )
    elif num_tokens == num_reqs:  # decode-like: one token per request
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
    if store:
        block_of_token = table[req_of_token, positions // block_size].astype(np.int64)
        slots = block_of_token * block_size + positions % block_size
    else:
        slots = np.full(num_tokens, -1, dtype=np.int64)

    sampled = np.asarray(samples, dtype=bool)
    logits_indices = cu[1:][sampled] - 1
    if num_drafts is not None and num_drafts[sampled].any():
        width = num_drafts[sampled] + 1  # logits rows of each sampled request
        logits_indices = concat_ranges(logits_indices - width + 1, width)
    kind = choose_batch_kind(start, q)
    prefix = shared_prefix_len(table, seq_lens, block_size) if cascade and kind is BatchKind.DECODE else 0
    prompt_idx = prompt_tgt = None
    if prompt_rows is not None and any(r is not None for r in prompt_rows):
        assert token_ids is not None
        idx, tgt = [], []
        for i, r in enumerate(prompt_rows):
            if r is not None:
                first, end = r
                idx.extend(range(int(cu[i]) + first - starts[i], int(cu[i]) + end - starts[i]))
                tgt.extend(token_ids[i][first + 1 : end + 1])
        prompt_idx, prompt_tgt = np.asarray(idx, dtype=np.int64), np.asarray(tgt, dtype=np.int64)
    return StepInputs(
        kind=kind,
        num_reqs=num_reqs,
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(seq_lens.max()),
        num_decodes=num_leading_decodes(q.tolist()) if kind is BatchKind.MIXED else 0,
        graph_size=0,
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        seq_lens=seq_lens.astype(np.int32),
        block_table=np.ascontiguousarray(table, dtype=np.int32),
        cu_seqlens_q=cu.astype(np.int32),
        logits_indices=logits_indices,
        cascade_prefix_len=np.array([prefix], dtype=np.int32) if prefix else None,
        prompt_logits_indices=prompt_idx,
        prompt_logits_targets=prompt_tgt,
    )


def _padded_verification(
    token_ids, starts, q_lens, rows, samples, block_tables, block_size, draft_token_ids, k
) -> StepInputs:
    """`build_step_inputs(..., pad_drafts_to=k)`: see there."""
    num_reqs = len(q_lens)
    w = k + 1
    d = np.fromiter((len(x) for x in draft_token_ids), dtype=np.int64, count=num_reqs)
    start = np.asarray(starts, dtype=np.int64)
    assert (np.asarray(q_lens) == d + 1).all() and (d <= k).all(), (
        "every request must decode, with <= k drafts"
    )
    ids = np.zeros((num_reqs, w), dtype=np.int64)
    for i, (t, s, x) in enumerate(zip(token_ids, starts, draft_token_ids)):
        ids[i, 0] = t[s]
        ids[i, 1 : 1 + len(x)] = x
    col = np.arange(w)[None, :]
    real = col <= d[:, None]  # [B, W] rows holding a real token
    positions = start[:, None] + np.minimum(col, d[:, None])
    seq_lens = start + w  # as if every draft had k tokens
    num_blocks = int(((seq_lens + block_size - 1) // block_size).max())
    table = block_tables[np.asarray(rows, dtype=np.int64), :num_blocks]
    table = np.maximum(table, 0)  # entries past a sequence's blocks: block 0 (padding rows only)
    req = np.repeat(np.arange(num_reqs), w)
    flat_pos = positions.reshape(-1)
    slots = table[req, flat_pos // block_size].astype(np.int64) * block_size + flat_pos % block_size
    slots = np.where(real.reshape(-1), slots, -1)
    sampled = np.asarray(samples, dtype=bool)
    logits_indices = concat_ranges(np.flatnonzero(sampled) * w, d[sampled] + 1)
    return StepInputs(
        kind=BatchKind.MIXED,
        num_reqs=num_reqs,
        max_seqlen_q=w,
        max_seqlen_k=int(seq_lens.max()),
        num_decodes=0,
        graph_size=0,
        input_ids=ids.reshape(-1),
        positions=flat_pos,
        slot_mapping=slots,
        seq_lens=seq_lens.astype(np.int32),
        block_table=np.ascontiguousarray(table, dtype=np.int32),
        cu_seqlens_q=(np.arange(num_reqs + 1) * w).astype(np.int32),
        logits_indices=logits_indices,
        cascade_prefix_len=None,
        verify_width=w,
    )
