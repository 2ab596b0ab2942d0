"""The split-KV scratch of `tilellm.kernels.split_scratch`: one workspace per stream, reused by
every eager split call, grown to the largest call; a capture's own buffers."""

from __future__ import annotations

import torch

from tilellm.kernels import split_scratch


def _fresh(device: str) -> split_scratch.StreamWorkspace:
    workspace = split_scratch.stream_workspace(torch.device(device))
    workspace.clear()
    return workspace


def test_counters_grow(device):
    """More tiles than the stream's buffer holds: a larger buffer, zero."""
    dev = torch.device(device)
    _fresh(device)
    small = split_scratch.split_counters(dev, 10)
    assert small.numel() == split_scratch.SPLIT_COUNTERS_MIN and small.dtype == torch.int32
    assert split_scratch.split_counters(dev, split_scratch.SPLIT_COUNTERS_MIN) is small
    large = split_scratch.split_counters(dev, split_scratch.SPLIT_COUNTERS_MIN + 1)
    assert large.numel() == 2 * split_scratch.SPLIT_COUNTERS_MIN and int(large.count_nonzero()) == 0
    assert split_scratch.stream_workspace(dev).counters is large


def test_partials_come_from_the_stream_and_grow(device):
    """Two calls share the stream's partials; a larger call grows them to a power of two, a
    smaller one after it keeps the larger buffers."""
    dev = torch.device(device)
    workspace = _fresh(device)
    o1, lse1, counters = split_scratch.split_parts(4, 3, 8, 64, dev)
    assert counters is None and o1.dtype == lse1.dtype == torch.float32
    assert o1.numel() == 8192 and lse1.numel() == 128  # next powers of two of 6144 and 96
    o2, lse2, _ = split_scratch.split_parts(2, 3, 8, 64, dev)
    assert o2 is o1 and lse2 is lse1
    o3, lse3, counters = split_scratch.split_parts(8, 3, 8, 64, dev, counter_slots=5)
    assert o3.numel() == 16384 and lse3.numel() == 256 and workspace.o_parts is o3
    assert counters is workspace.counters and int(counters.count_nonzero()) == 0
    assert split_scratch.split_parts(2, 3, 8, 64, dev)[0] is o3


def test_a_fresh_workspace_hands_out_tensors_for_empty_calls(device):
    """No tokens, no counters asked for: tensors all the same (empty partials, the minimum of
    counters), never None, on a fresh workspace as on a used one."""
    dev = torch.device(device)
    _fresh(device)
    o, lse, counters = split_scratch.split_parts(2, 0, 8, 64, dev)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor) and counters is None
    assert split_scratch.split_counters(dev, 0).numel() == split_scratch.SPLIT_COUNTERS_MIN


def test_a_capture_gets_its_own_buffers(device):
    """`capturing=True` (a CUDA-graph capture) never hands out the stream's buffers."""
    dev = torch.device(device)
    workspace = _fresh(device)
    shared = split_scratch.split_parts(2, 4, 4, 32, dev, counter_slots=3)
    own = split_scratch.split_parts(2, 4, 4, 32, dev, counter_slots=3, capturing=True)
    assert all(a is not b for a, b in zip(own, shared))
    assert own[0].numel() == 2 * 4 * 4 * 32 and own[2].numel() == 3 and int(own[2].count_nonzero()) == 0
    assert workspace.o_parts is shared[0]


def test_reset_zeroes_every_stream_counters(device):
    dev = torch.device(device)
    _fresh(device)
    counters = split_scratch.split_counters(dev, 4)
    counters[1] = 7
    split_scratch.reset_split_counters()
    assert int(counters.count_nonzero()) == 0
