"""Decode-graph capture under tensor parallelism: every rank stops at the same bucket.

Capture runs only on CUDA; this drives `ModelRunner._capture_variant`'s loop with a stand-in for
the per-bucket capture and for the group's `agree_min`, so the rule is checked on CPU: a bucket
that fails on any rank ends the loop on every rank at that bucket (a rank that went on alone
would wait in the next bucket's all-reduces for a peer that had left).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tilellm.engine.runner import ModelRunner

SIZES = [1, 2, 4, 8, 16, 32]


class OtherRank:
    """`agree_min` of a two-rank group whose other rank fails at batch size `fails_at`."""

    def __init__(self, fails_at: int | None):
        self.fails_at = fails_at
        self.agreed: list[tuple[int, int]] = []
        self.bucket = None

    def agree_min(self, value: int) -> int:
        other = 0 if self.bucket == self.fails_at else 1
        self.agreed.append((self.bucket, value))
        return min(value, other)


def fake_runner(group, fails_here: int | None = None):
    attempted: list[int] = []

    def capture_one(graphs, bs, prefix_len, pool, max_seqlen_k, capture_mode):
        attempted.append(bs)
        if group is not None:
            group.bucket = bs
        if bs == fails_here:
            return None
        graphs[bs] = ("graph", "logits")
        return pool if pool is not None else "pool"

    return SimpleNamespace(group=group, _capture_one=capture_one), attempted


def test_all_buckets_captured_largest_first():
    runner, attempted = fake_runner(None)
    graphs: dict = {}
    assert ModelRunner._capture_variant(runner, graphs, SIZES, None, None) == "pool"
    assert attempted == SIZES[::-1] and sorted(graphs) == SIZES


@pytest.mark.parametrize("fails_at", [32, 8, 1])
def test_a_failure_on_the_other_rank_stops_this_rank_at_the_same_bucket(fails_at):
    group = OtherRank(fails_at)
    runner, attempted = fake_runner(group)
    with pytest.raises(RuntimeError, match=f"batch size {fails_at}"):
        ModelRunner._capture_variant(runner, {}, SIZES, None, None)
    assert attempted[-1] == fails_at  # no bucket after the failed one is warmed up or captured
    assert [bs for bs, _ in group.agreed] == attempted  # agreed after every bucket


def test_a_failure_here_is_reported_to_the_group():
    group = OtherRank(None)
    runner, attempted = fake_runner(group, fails_here=16)
    with pytest.raises(RuntimeError, match="batch size 16"):
        ModelRunner._capture_variant(runner, {}, SIZES, None, None)
    assert group.agreed[-1] == (16, 0) and attempted[-1] == 16


def capture_one_runner(error: BaseException):
    import torch

    def graph_body(bs):
        raise error

    n = 4
    return SimpleNamespace(
        g_cu=torch.arange(n + 1, dtype=torch.int32),
        g_seq_lens=torch.ones(n, dtype=torch.int32),
        g_block_table=torch.zeros((n, 2), dtype=torch.int32),
        g_slots=torch.full((n,), -1),
        max_model_len=32,
        _graph_body=graph_body,
        _sync=lambda: None,
    )


def test_a_bucket_that_fails_here_is_logged_and_reported_as_none(caplog):
    runner = capture_one_runner(RuntimeError("cannot capture"))
    graphs: dict = {}
    assert ModelRunner._capture_one(runner, graphs, 2, None, None, None, "global") is None
    assert graphs == {} and "decode graph capture failed at batch size 2" in caplog.text


def test_a_dead_worker_is_raised_not_taken_for_a_capture_failure():
    """WorkerError (a worker died; every rank already stopped) must end the engine's start, not
    fall back to eager decode: the fallback would wait on the dead rank's collectives."""
    from tilellm.distributed import WorkerError

    runner = capture_one_runner(WorkerError("rank 1: Traceback ..."))
    with pytest.raises(WorkerError, match="rank 1"):
        ModelRunner._capture_one(runner, {}, 2, None, None, None, "global")
