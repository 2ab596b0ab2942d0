"""The step message: what `build_step_batch` made must come out of the flat payload unchanged,
for eager steps (prefill, chunked/mixed, cascade decode) and padded graph steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilellm.distributed.message import (
    GRAPH,
    HEADER_WORDS,
    NUM_WORDS,
    OP,
    OP_STEP,
    OP_STOP,
    decode_step,
    encode_step,
    payload_layout,
    stop_header,
)
from tilellm.engine.metadata import BatchKind, build_step_batch


def _batch(starts: list[int], q_lens: list[int], samples: list[bool] | None = None, block_size: int = 4):
    rng = np.random.default_rng(sum(starts) + len(q_lens))
    num = len(q_lens)
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    width = max(-(-n // block_size) for n in seq_lens) + 2
    tables = np.full((num + 2, width), -1, dtype=np.int32)
    rows = list(range(2, num + 2))
    perm = rng.permutation(1000).astype(np.int32)
    for r, n in zip(rows, seq_lens):
        nb = -(-n // block_size)
        tables[r, :nb] = perm[r * 50 : r * 50 + nb]
    tokens = [rng.integers(0, 300, n).tolist() for n in seq_lens]
    samples = samples if samples is not None else [True] * num
    return build_step_batch(tokens, starts, q_lens, rows, samples, tables, block_size)


@pytest.mark.parametrize(
    "starts, q_lens, samples",
    [
        ([0, 0, 0], [5, 1, 9], None),  # prefill, odd int32 counts
        ([7, 0, 12], [1, 6, 3], [True, False, True]),  # mixed: chunked prefill next to a decode
        ([7, 3, 12, 0], [1, 1, 3, 5], None),  # mixed with two leading decodes (num_decodes = 2)
        ([9, 30, 4, 17], [1, 1, 1, 1], None),  # decode
        ([0], [1], [False]),  # no sampled row
    ],
)
def test_eager_step_round_trip(starts, q_lens, samples):
    batch = _batch(starts, q_lens, samples)
    msg = encode_step(batch, None, step_id=5)
    assert msg.header.shape == (HEADER_WORDS,) and msg.header[OP] == OP_STEP and not msg.header[GRAPH]
    words = msg.to_words()
    assert words.dtype == np.int64 and words.shape == (msg.header[NUM_WORDS],)
    x = decode_step(msg.header, torch.from_numpy(words))
    a = batch.attn
    assert (x.kind, x.graph, x.num_reqs) == (a.kind, False, len(q_lens))
    assert (x.max_seqlen_q, x.max_seqlen_k) == (a.max_seqlen_q, a.max_seqlen_k)
    leading = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    assert x.num_decodes == a.num_decodes == (leading if a.kind is BatchKind.MIXED else 0)
    layout, _ = payload_layout(msg.header)
    assert all(offset % 2 == 0 for *_, offset in layout), "a payload section is not 16-byte aligned"
    pairs = [
        (x.input_ids, batch.input_ids),
        (x.positions, batch.positions),
        (x.slot_mapping, a.slot_mapping),
        (x.seq_lens, a.seq_lens),
        (x.block_table, a.block_table),
        (x.cu_seqlens_q, a.cu_seqlens_q),
        (x.logits_indices, batch.logits_indices),
    ]
    for got, want in pairs:
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert x.cascade_prefix_len is None


def test_graph_step_is_padded_to_the_graph_size():
    batch = _batch([9, 30, 4], [1, 1, 1])
    x = decode_step(*_sent(encode_step(batch, 8)))
    assert x.graph and x.num_reqs == 3 and x.cu_seqlens_q is None
    assert x.input_ids.tolist() == batch.input_ids.tolist() + [0] * 5
    assert x.slot_mapping.tolist() == batch.attn.slot_mapping.tolist() + [-1] * 5
    assert x.seq_lens.tolist() == batch.attn.seq_lens.tolist() + [1] * 5
    assert torch.equal(x.block_table, batch.attn.block_table)
    with pytest.raises(ValueError, match="decode batch of at most 2"):
        encode_step(batch, 2)
    with pytest.raises(ValueError, match="decode batch"):
        encode_step(_batch([0, 0], [3, 1]), 8)


def test_cascade_prefix_travels_with_the_step():
    block_size = 16
    num = 8
    table = np.tile(np.arange(20, dtype=np.int32), (num, 1))  # every request shares its blocks
    table[:, 17:] = np.arange(num * 3, dtype=np.int32).reshape(num, 3) + 100
    seq_lens = [300 + i for i in range(num)]
    for r, n in enumerate(seq_lens):
        table[r, -(-n // block_size) :] = -1
    tokens = [[1] * n for n in seq_lens]
    batch = build_step_batch(
        tokens, [n - 1 for n in seq_lens], [1] * num, list(range(num)), [True] * num, table, block_size
    )
    assert batch.attn.kind is BatchKind.DECODE and batch.attn.cascade_prefix_len is not None
    x = decode_step(*_sent(encode_step(batch)))
    assert torch.equal(x.cascade_prefix_len, batch.attn.cascade_prefix_len)


def test_stop_header_and_short_payload():
    assert stop_header()[OP] == OP_STOP
    msg = encode_step(_batch([0], [3]))
    with pytest.raises(ValueError, match="int64"):
        decode_step(msg.header, torch.zeros(1, dtype=torch.int64))


def _sent(msg) -> tuple[np.ndarray, torch.Tensor]:
    return msg.header, torch.from_numpy(msg.to_words())
