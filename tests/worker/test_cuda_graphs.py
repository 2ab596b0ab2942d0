"""Decode-graph capture (`DecodeGraphs.capture`): buckets largest first, and under tensor
parallelism every rank stops at the same bucket.

Capture itself runs only on CUDA; here the per-bucket capture is a stand-in (a subclass), and the
group a stand-in for `agree_min`, so the rule is checked on CPU: a bucket that fails on any rank
ends the loop on every rank at that bucket (a rank that went on alone would wait in the next
bucket's all-reduces for a peer that had left). Failures in the warm-up forward are reported.
"""

from __future__ import annotations

import pytest
import torch

from tilellm.distributed import WorkerError
from tilellm.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes

MAX_SEQS = 32
SIZES = graph_batch_sizes(MAX_SEQS)


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


class StandInCapture(DecodeGraphs):
    """Records the buckets it is asked to capture; fails at `fails_here`."""

    def __init__(self, group=None, fails_here=None, forward=None, verify_width=0):
        super().__init__(
            torch.device("cpu"), MAX_SEQS, 4, 64, forward=forward or (lambda x: None),
            decode_splits=lambda bs, n: 1, group=group, verify_width=verify_width,
        )  # fmt: skip
        self.attempted: list[int] = []
        self.fails_here = fails_here
        self.use_stand_in = forward is None

    def _capture_one(self, variant, bs, pool, max_seqlen_k, cascade, capture_mode, verify=False):
        if not self.use_stand_in:
            return super()._capture_one(variant, bs, pool, max_seqlen_k, cascade, capture_mode, verify)
        self.attempted.append(bs)
        if self.group is not None:
            self.group.bucket = bs
        if bs == self.fails_here:
            return None
        self.variants[variant][bs] = ("graph", "logits")
        return pool if pool is not None else "pool"


def test_buckets():
    assert SIZES == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(256)[-3:] == [240, 248, 256]


def test_all_buckets_captured_largest_first():
    graphs = StandInCapture()
    graphs.capture(lambda: None, enable_cascade=False)
    assert graphs.attempted == SIZES[::-1] and sorted(graphs.graphs_of("plain")) == SIZES
    assert graphs.bucket(3) == 4 and graphs.bucket(17) == 24 and graphs.bucket(MAX_SEQS + 1) is None


def test_verification_buckets_with_speculative_decoding():
    """With a verify width W (k + 1), every bucket up to VERIFY_GRAPH_MAX_BATCH gets a verify graph
    of W tokens per request; a uniform verification step finds the next one up."""
    from tilellm.worker.cuda_graphs import VERIFY_GRAPH_MAX_BATCH, graph_logits_rows

    graphs = StandInCapture(verify_width=5)
    graphs.capture(lambda: None, enable_cascade=False)
    want = [bs for bs in SIZES if bs <= VERIFY_GRAPH_MAX_BATCH]
    assert sorted(graphs.graphs_of("verify")) == want
    assert graphs.verify_bucket(3) == 4 and graphs.verify_bucket(want[-1] + 1) is None
    assert graphs.verify_static.input_ids.shape[0] == MAX_SEQS * 5
    assert graph_logits_rows(MAX_SEQS, False, 5) == graph_logits_rows(MAX_SEQS, False) + 5 * sum(want)
    assert not StandInCapture().graphs_of("verify")  # none without speculative decoding


def test_cascade_buckets_start_where_cascade_decode_may_run():
    graphs = StandInCapture()
    graphs.capture(lambda: None, enable_cascade=True)
    assert sorted(graphs.graphs_of("cascade")) == [8, 16, 24, 32]
    assert graphs.has_cascade(8) and not graphs.has_cascade(4)


@pytest.mark.parametrize("fails_at", [32, 8, 1])
def test_a_failure_on_the_other_rank_stops_this_rank_at_the_same_bucket(fails_at):
    group = OtherRank(fails_at)
    graphs = StandInCapture(group)
    with pytest.raises(RuntimeError, match=f"batch size {fails_at}"):
        graphs.capture(lambda: None, enable_cascade=False)
    assert graphs.attempted[-1] == fails_at  # no bucket after the failed one is warmed up or captured
    assert [bs for bs, _ in group.agreed] == graphs.attempted  # agreed after every bucket


def test_a_failure_here_is_reported_to_the_group():
    group = OtherRank(None)
    graphs = StandInCapture(group, fails_here=16)
    with pytest.raises(RuntimeError, match="batch size 16"):
        graphs.capture(lambda: None, enable_cascade=False)
    assert group.agreed[-1] == (16, 0) and graphs.attempted[-1] == 16


def test_a_bucket_that_fails_here_is_logged(caplog):
    def forward(x):
        raise RuntimeError("cannot capture")

    graphs = StandInCapture(forward=forward)
    with pytest.raises(RuntimeError, match="batch size 32"):
        graphs.capture(lambda: None, enable_cascade=False)
    assert not graphs and "decode graph capture failed at batch size 32" in caplog.text


def test_a_dead_worker_is_raised_not_taken_for_a_capture_failure():
    """WorkerError (a worker died; every rank already stopped) must end the engine's start, not
    fall back to eager decode: the fallback would wait on the dead rank's collectives."""

    def forward(x):
        raise WorkerError("rank 1: Traceback ...")

    with pytest.raises(WorkerError, match="rank 1"):
        StandInCapture(forward=forward).capture(lambda: None, enable_cascade=False)
