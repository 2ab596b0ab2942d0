"""graph_replay_us: every call captured once and replayed; a positive time per call."""

from __future__ import annotations

import pytest
import torch

from tilellm.bench.timing import graph_replay_us


@pytest.mark.gpu
def test_graph_replay_runs_each_call_per_replay():
    counters = [torch.zeros(1, device="cuda") for _ in range(3)]
    us = graph_replay_us([lambda c=c: c.add_(1) for c in counters], warmup=1, rep=1)
    torch.cuda.synchronize()
    counts = [int(c.item()) for c in counters]
    assert us > 0
    # the side-stream warm-up once, then one or more replays, each applying every call once
    assert len(set(counts)) == 1 and counts[0] >= 2
