"""`StepInputs`: what `build_step_inputs` made must come out of the flat payload unchanged, for
eager steps (prefill, chunked/mixed, cascade decode) and padded graph steps; the header holds
every scalar and shape; the attention metadata is built from it alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tilellm.attention import BatchKind
from tilellm.distributed.group import CONTROL_WORDS, OP, OP_STEP, OP_STOP, stop_message
from tilellm.worker.step_inputs import (
    HEADER_WORDS,
    NUM_WORDS,
    STEP_ID,
    StepInputs,
    _layout,
    build_step_inputs,
)

ARRAYS = [f.name for f in dataclasses.fields(StepInputs) if "dtype" in f.metadata]
SCALARS = [f.name for f in dataclasses.fields(StepInputs) if f.metadata.get("scalar")]


def _inputs(starts: list[int], q_lens: list[int], samples: list[bool] | None = None, block_size: int = 4):
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
    return build_step_inputs(tokens, starts, q_lens, rows, samples, tables, block_size), tokens, tables, rows


def _sent(x: StepInputs, step_id: int = 0) -> StepInputs:
    header = x.header(step_id)
    return StepInputs.from_payload(header, torch.from_numpy(x.to_words(header)))


def _same(got: StepInputs, want: StepInputs) -> None:
    for name in SCALARS:
        assert getattr(got, name) == getattr(want, name), name
    for name in ARRAYS:
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == torch.from_numpy(np.asarray(w)).dtype, name
        assert g.tolist() == np.asarray(w).tolist(), name


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
    x, tokens, tables, rows = _inputs(starts, q_lens, samples)
    header = x.header(step_id=5)
    assert header.shape == (HEADER_WORDS,) and HEADER_WORDS <= CONTROL_WORDS
    assert header[OP] == OP_STEP and header[STEP_ID] == 5 and x.graph_size == 0
    words = x.to_words(header)
    assert words.dtype == np.int64 and words.shape == (header[NUM_WORDS],)
    assert all(offset % 2 == 0 for *_, offset in _layout(header)[0]), "an array is not 16-byte aligned"
    got = StepInputs.from_payload(header, torch.from_numpy(words))
    _same(got, x)
    # the builder's promises, read from what arrived
    leading = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    assert got.num_decodes == (leading if got.kind is BatchKind.MIXED else 0)
    assert got.num_reqs == len(q_lens) and got.max_seqlen_q == max(q_lens)
    assert got.max_seqlen_k == max(s + q for s, q in zip(starts, q_lens))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for i, (s, q, r) in enumerate(zip(starts, q_lens, rows)):
        pos = np.arange(s, s + q)
        assert got.positions[cu[i] : cu[i + 1]].tolist() == pos.tolist()
        assert got.input_ids[cu[i] : cu[i + 1]].tolist() == tokens[i][s : s + q]
        slots = tables[r, pos // 4].astype(np.int64) * 4 + pos % 4
        assert got.slot_mapping[cu[i] : cu[i + 1]].tolist() == slots.tolist()
    sampled = [cu[i + 1] - 1 for i, smp in enumerate(samples or [True] * len(q_lens)) if smp]
    assert got.logits_indices.tolist() == sampled
    meta = got.attention_metadata()
    assert meta.kind is got.kind and meta.plan is None
    assert meta.slot_mapping.data_ptr() == got.slot_mapping.data_ptr()  # views, not copies


def test_graph_step_is_padded_to_the_graph_size():
    x, *_ = _inputs([9, 30, 4], [1, 1, 1])
    padded = x.padded_to(8)
    got = _sent(padded)
    assert got.graph_size == 8 and got.num_reqs == 3
    assert got.input_ids.tolist() == x.input_ids.tolist() + [0] * 5
    assert got.slot_mapping.tolist() == x.slot_mapping.tolist() + [-1] * 5
    assert got.seq_lens.tolist() == x.seq_lens.tolist() + [1] * 5
    assert got.block_table.tolist() == x.block_table.tolist()
    _same(_sent(x.padded_to(3)), dataclasses.replace(x, graph_size=3))  # a full bucket: no padding
    with pytest.raises(ValueError, match="decode batch of at most 2"):
        x.padded_to(2)
    with pytest.raises(ValueError, match="decode batch"):
        _inputs([0, 0], [3, 1])[0].padded_to(8)


def test_cascade_prefix_travels_with_the_step():
    block_size = 16
    num = 8
    table = np.tile(np.arange(20, dtype=np.int32), (num, 1))  # the first 17 blocks shared by all
    table[:, 17:] = np.arange(num * 3, dtype=np.int32).reshape(num, 3) + 100
    seq_lens = [300 + i for i in range(num)]
    for r, n in enumerate(seq_lens):
        table[r, -(-n // block_size) :] = -1
    tokens = [[1] * n for n in seq_lens]
    x = build_step_inputs(
        tokens, [n - 1 for n in seq_lens], [1] * num, list(range(num)), [True] * num, table, block_size
    )
    assert x.kind is BatchKind.DECODE and x.cascade_prefix_len.tolist() == [272]
    got = _sent(x)
    assert got.cascade_prefix_len.tolist() == [272]
    assert got.attention_metadata().cascade_prefix_len.tolist() == [272]


def test_stop_message_and_short_payload():
    assert stop_message()[OP] == OP_STOP
    x, *_ = _inputs([0], [3])
    with pytest.raises(ValueError, match="int64"):
        StepInputs.from_payload(x.header(), torch.zeros(1, dtype=torch.int64))


def test_store_false_writes_nothing():
    x = build_step_inputs(
        None, [0, 5], [3, 1], [0, 1], [True, True], np.zeros((2, 4), np.int32), 4, store=False
    )
    assert x.slot_mapping.tolist() == [-1] * 4 and x.input_ids.tolist() == [0] * 4


def test_drafts_and_their_padded_verification_shape():
    """A draft rides after its request's known token, with logits at each of its rows; padded to
    k, every request has k + 1 rows, the padding stores nothing and only real rows are sampled."""
    import numpy as np

    from tilellm.worker.step_inputs import build_step_inputs

    tables = np.full((4, 8), -1, dtype=np.int32)
    tables[0, :2], tables[1, :1] = [5, 6], [7]
    tokens = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    drafts = [[21, 22], []]
    x = build_step_inputs(tokens, [9, 2], [3, 1], [0, 1], [True, True], tables, 8, draft_token_ids=drafts)
    assert x.input_ids.tolist() == [10, 21, 22, 13]
    assert x.positions.tolist() == [9, 10, 11, 2]
    assert x.logits_indices.tolist() == [0, 1, 2, 3]
    assert x.slot_mapping.tolist() == [6 * 8 + 1, 6 * 8 + 2, 6 * 8 + 3, 7 * 8 + 2]
    p = build_step_inputs(
        tokens, [9, 2], [3, 1], [0, 1], [True, True], tables, 8, draft_token_ids=drafts, pad_drafts_to=3
    )
    assert p.verify_width == 4 and p.cu_seqlens_q.tolist() == [0, 4, 8]
    assert p.input_ids.tolist() == [10, 21, 22, 0, 13, 0, 0, 0]
    assert p.slot_mapping.tolist()[3] == -1 and p.slot_mapping.tolist()[5:] == [-1, -1, -1]
    assert p.slot_mapping.tolist()[:3] == x.slot_mapping.tolist()[:3]
    assert p.seq_lens.tolist() == [13, 6]  # as if each draft had 3 tokens
    assert p.logits_indices.tolist() == [0, 1, 2, 4]
    assert (p.block_table >= 0).all()  # unallocated entries read block 0 (padding rows only)
    padded = p.padded_requests_to(4)
    assert padded.num_reqs == 4 and padded.input_ids.shape[0] == 16 and padded.seq_lens.tolist()[2:] == [4, 4]
