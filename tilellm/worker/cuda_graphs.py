"""CUDA graphs of decode steps: captured per batch-size bucket, replayed with the step's inputs.

Decode steps (one new token per request) replay a graph captured at the next bucketed batch size
(1, 2, 4, 8, 16, 24, 32, ... up to `max_num_seqs`); padding rows store nothing (slot -1) and
attend to one key. A graph is captured from static input buffers that are themselves a
`StepInputs`, planned by the attention backend like any step, so it fixes that plan: its split-KV
segments are planned for `max_model_len`-long contexts. Where contexts shorter than
MIN_CONTEXT_TO_SPLIT get another plan, a second "short" graph is captured for the bucket with that
plan (no split-KV for large batches, short segments for small ones) and replayed while the batch's
longest context is that short, which saves the merge kernel and most partial outputs on most
steps. With prefix caching, a third "cascade" variant per bucket (from the
smallest batch that cascade decode ever serves) reads a shared prefix once for the batch.

With speculative decoding, a "verify" variant per bucket up to VERIFY_GRAPH_MAX_BATCH replays
verification steps: every request with W = k + 1 new tokens (its draft padded to k,
`build_step_inputs(pad_drafts_to=k)`), through the paged kernel, logits at every row.

Under tensor parallelism every rank captures the same buckets and variants, agreeing after each
bucket, so no rank waits in a collective for a peer that stopped capturing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tilellm.attention import BatchKind
from tilellm.distributed.driver import WorkerError
from tilellm.kernels.schedule import MIN_CONTEXT_TO_SPLIT
from tilellm.worker.step_inputs import CASCADE_MIN_REQUESTS, StepInputs

if TYPE_CHECKING:
    from tilellm.distributed import TPGroup

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a decode graph: 1, 2, 4, 8, then every multiple of 8 up to the max."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


# Verification graphs keep [bucket * W, V] logits each: only batches up to this size get one
# (speculation pays most at small batches, where a step is launch-bound).
VERIFY_GRAPH_MAX_BATCH = 64


def verify_batch_sizes(max_num_seqs: int) -> list[int]:
    return [bs for bs in graph_batch_sizes(max_num_seqs) if bs <= VERIFY_GRAPH_MAX_BATCH]


def graph_logits_rows(max_num_seqs: int, enable_prefix_caching: bool, verify_width: int = 0) -> int:
    """Rows of logits the captured graphs keep alive (each graph's output, [bucket, V]): the plain
    and the no-split graph of every bucket at most, the cascade graph of every bucket from
    CASCADE_MIN_REQUESTS when prefix caching is on, and with speculative decoding the verify
    graphs' [bucket * verify_width, V]. The KV pool's sizing reserves them."""
    sizes = graph_batch_sizes(max_num_seqs)
    rows = 2 * sum(sizes)
    if enable_prefix_caching:
        rows += sum(bs for bs in sizes if bs >= CASCADE_MIN_REQUESTS)
    rows += verify_width * sum(verify_batch_sizes(max_num_seqs))
    return rows


class DecodeGraphs:
    """The captured decode graphs of one runner and their static inputs (see the module docstring).

    `forward(inputs)` runs the model on device `StepInputs` and returns the logits of every row
    (the runner plans and installs the attention metadata); `decode_splits(bs, max_seqlen_k)` is
    the backend's split count for a decode batch.
    """

    def __init__(
        self,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        forward: Callable[[StepInputs], torch.Tensor],
        decode_splits: Callable[[int, int], int],
        group: TPGroup | None = None,
        verify_width: int = 0,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.forward = forward
        self.decode_splits = decode_splits
        self.group = group
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = max_num_seqs
        self.static = StepInputs(
            kind=BatchKind.DECODE,
            num_reqs=n,
            max_seqlen_q=1,
            max_seqlen_k=max_model_len,
            num_decodes=0,
            graph_size=n,
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device),
            block_table=torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
            logits_indices=torch.arange(n, dtype=torch.int64, device=device),
            cascade_prefix_len=torch.zeros(1, dtype=torch.int32, device=device),
        )
        self.verify_width = w = verify_width
        if w:  # verification steps: W tokens per request
            self.verify_static = StepInputs(
                kind=BatchKind.MIXED,
                num_reqs=n,
                max_seqlen_q=w,
                max_seqlen_k=max_model_len,
                num_decodes=0,
                graph_size=n,
                input_ids=torch.zeros(n * w, dtype=torch.int64, device=device),
                positions=torch.zeros(n * w, dtype=torch.int64, device=device),
                slot_mapping=torch.full((n * w,), -1, dtype=torch.int64, device=device),
                seq_lens=torch.full((n,), w, dtype=torch.int32, device=device),
                block_table=torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device),
                cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device) * w,
                logits_indices=torch.arange(n * w, dtype=torch.int64, device=device),
                verify_width=w,
            )
        # bucket -> (graph, its logits output [bucket, V]; [bucket * W, V] for "verify"), by variant
        self.variants: dict[str, dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {
            "plain": {},
            "short": {},
            "cascade": {},
            "verify": {},
        }
        # steps by graph variant ("piecewise": prefill and mixed steps, counted by the runner)
        self.replays = {"plain": 0, "short": 0, "cascade": 0, "verify": 0, "piecewise": 0}
        self.pool = None  # the memory pool the graphs share, once captured
        # bucket -> the static input_ids, positions, slot_mapping and seq_lens of its rows
        self._bucket_views: dict[int, tuple[torch.Tensor, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.variants["plain"])

    def clear(self, variant: str | None = None) -> None:
        for name in [variant] if variant else list(self.variants):
            self.variants[name] = {}

    # -- capture --------------------------------------------------------------------------------

    def capture(self, sync: Callable[[], None], enable_cascade: bool) -> None:
        """Capture every bucket's plain graph, the short variant where short contexts plan otherwise, and
        the cascade variant when `enable_cascade`. A failure of the plain graphs raises; a failed
        cascade capture only drops that variant."""
        t0 = time.perf_counter()
        self._sync = sync
        pool = self.pool = self._capture_variant("plain", self.sizes, None)
        short, longest = MIN_CONTEXT_TO_SPLIT - 1, self.max_model_len
        splitting = [
            bs
            for bs in self.sizes
            if longest > short and self.decode_splits(bs, longest) != self.decode_splits(bs, short)
        ]
        if splitting:
            self._capture_variant("short", splitting, pool, max_seqlen_k=MIN_CONTEXT_TO_SPLIT - 1)
        if enable_cascade:
            sizes = [bs for bs in self.sizes if bs >= CASCADE_MIN_REQUESTS]
            try:
                self._capture_variant("cascade", sizes, pool, cascade=True)
            except WorkerError:  # a worker died: every rank is already stopped
                raise
            except Exception:  # keep the plain graphs: cascade steps then run eagerly
                logger.exception("cascade graph capture failed: cascade decode steps run eagerly")
                self.clear("cascade")
                torch.cuda.synchronize()
        if self.verify_width:
            try:
                self._capture_variant("verify", verify_batch_sizes(self.max_num_seqs), pool, verify=True)
            except WorkerError:
                raise
            except Exception:  # verification steps then run eagerly
                logger.exception("verification graph capture failed: verification steps run eagerly")
                self.clear("verify")
                torch.cuda.synchronize()
        sync()
        logger.info(
            "captured %d decode graphs (+%d without split-KV, +%d cascade, +%d verify) in %.1f s",
            len(self.variants["plain"]),
            len(self.variants["short"]),
            len(self.variants["cascade"]),
            len(self.variants["verify"]),
            time.perf_counter() - t0,
        )

    def _capture_variant(
        self, variant: str, sizes: list[int], pool, *, max_seqlen_k=None, cascade=False, verify=False
    ):
        """Capture one graph per batch size; returns the memory pool the graphs share."""
        # Under tensor parallelism NCCL's watchdog thread queries events while this thread
        # captures: only this thread's own calls need to be capture-safe.
        capture_mode = "thread_local" if self.group is not None else "global"
        for bs in reversed(sizes):
            new_pool = self._capture_one(variant, bs, pool, max_seqlen_k, cascade, capture_mode, verify)
            captured = new_pool is not None
            if self.group is not None:
                # Every rank stops at the same bucket: a rank that went on alone would wait in the
                # next bucket's warm-up all-reduces for a peer that has left the loop.
                captured = bool(self.group.agree_min(int(captured)))
            if not captured:
                raise RuntimeError(f"decode graph capture failed at batch size {bs} (this rank or another)")
            pool = new_pool
        return pool

    def _inputs(self, bs: int, max_seqlen_k: int | None, cascade: bool, verify: bool = False) -> StepInputs:
        """The static inputs of bucket `bs`, as the step the graph replays."""
        if verify:
            v, w = self.verify_static, self.verify_width
            return StepInputs(
                kind=BatchKind.MIXED,
                num_reqs=bs,
                max_seqlen_q=w,
                max_seqlen_k=self.max_model_len,
                num_decodes=0,
                graph_size=bs,
                input_ids=v.input_ids[: bs * w],
                positions=v.positions[: bs * w],
                slot_mapping=v.slot_mapping[: bs * w],
                seq_lens=v.seq_lens[:bs],
                block_table=v.block_table[:bs],
                cu_seqlens_q=v.cu_seqlens_q[: bs + 1],
                logits_indices=v.logits_indices[: bs * w],
                verify_width=w,
            )
        s = self.static
        return StepInputs(
            kind=BatchKind.DECODE,
            num_reqs=bs,
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k or self.max_model_len,
            num_decodes=0,
            graph_size=bs,
            input_ids=s.input_ids[:bs],
            positions=s.positions[:bs],
            slot_mapping=s.slot_mapping[:bs],
            seq_lens=s.seq_lens[:bs],
            block_table=s.block_table[:bs],
            cu_seqlens_q=s.cu_seqlens_q[: bs + 1],
            logits_indices=s.logits_indices[:bs],
            cascade_prefix_len=s.cascade_prefix_len if cascade else None,
        )

    def _capture_one(self, variant, bs, pool, max_seqlen_k, cascade, capture_mode, verify=False):
        """Warm up and capture the graph of `bs` requests. Returns the memory pool the graphs
        share, or None (logged) when this rank failed."""
        inputs = self._inputs(bs, max_seqlen_k, cascade, verify)
        try:
            self.forward(inputs)  # warm-up: compiles the kernels outside the capture
            self._sync()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_mode):
                logits = self.forward(inputs)
        except WorkerError:
            raise
        except Exception:
            logger.exception("decode graph capture failed at batch size %d", bs)
            return None
        self.variants[variant][bs] = (graph, logits)
        return pool if pool is not None else graph.pool()

    # -- replay ---------------------------------------------------------------------------------

    def bucket(self, num_reqs: int) -> int | None:
        """The batch size whose graph replays a decode step of `num_reqs` requests, or None."""
        if not self or num_reqs > self.max_num_seqs:
            return None
        for bs in self.sizes:
            if bs >= num_reqs:
                return bs
        return None

    def graphs_of(self, variant: str) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        """bucket -> (graph, logits) of one variant ("plain", "short", "cascade")."""
        return self.variants[variant]

    def has_cascade(self, bucket: int | None) -> bool:
        return bucket in self.variants["cascade"]

    def verify_bucket(self, num_reqs: int) -> int | None:
        """The batch size whose verification graph replays a uniform verification step, or None."""
        graphs = self.variants["verify"]
        return next((bs for bs in sorted(graphs) if bs >= num_reqs), None)

    def _replay_verify(self, x: StepInputs) -> torch.Tensor:
        bucket, v, w = x.graph_size, self.verify_static, self.verify_width
        nb = x.block_table.shape[1]
        v.input_ids[: bucket * w].copy_(x.input_ids)
        v.positions[: bucket * w].copy_(x.positions)
        v.slot_mapping[: bucket * w].copy_(x.slot_mapping)
        v.seq_lens[:bucket].copy_(x.seq_lens)
        v.block_table[:bucket, :nb].copy_(x.block_table)
        self.replays["verify"] += 1
        graph, logits = self.variants["verify"][bucket]
        graph.replay()
        return logits[x.logits_indices]

    def replay(self, x: StepInputs) -> torch.Tensor:
        """Copy the step's device inputs into the static buffers, replay, return the logits of
        its sampled rows."""
        if x.verify_width:
            return self._replay_verify(x)
        bucket, s = x.graph_size, self.static
        nb = x.block_table.shape[1]
        views = self._bucket_views.get(bucket)
        if views is None:  # (made once a bucket: each slice is host work on every step)
            views = self._bucket_views[bucket] = tuple(
                t[:bucket] for t in (s.input_ids, s.positions, s.slot_mapping, s.seq_lens)
            )
        for static, step in zip(views, (x.input_ids, x.positions, x.slot_mapping, x.seq_lens)):
            static.copy_(step)
        s.block_table[: x.num_reqs, :nb].copy_(x.block_table)
        if x.cascade_prefix_len is not None:
            s.cascade_prefix_len.copy_(x.cascade_prefix_len)
            variant = "cascade"
        elif x.max_seqlen_k < MIN_CONTEXT_TO_SPLIT and bucket in self.variants["short"]:
            variant = "short"
        else:
            variant = "plain"
        self.replays[variant] += 1
        graph, logits = self.variants[variant][bucket]
        graph.replay()
        # Usually every request samples, in order: a view, not a gather.
        if x.logits_indices.shape[0] == x.num_reqs:
            return logits[: x.num_reqs]
        return logits[x.logits_indices]
