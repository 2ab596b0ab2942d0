"""Continuous batching with one token budget per step.

Each step spends at most `max_num_batched_tokens` tokens. Running sequences come first, in the
order they were admitted: a decoding sequence takes 1 token, a sequence still in its prompt takes
the next chunk of it (any prompt can be prefilled in chunks). What is left of the budget admits
waiting sequences first-come first-served (their cached prefix blocks cost nothing), up to
`max_num_seqs` running. Sequences computing a single token (decodes) are listed first in each
step's output, longest context first, the rest after them (see `_order_for_kernels`).

When the pool has no block for a running sequence, the most recently admitted running sequence
is preempted: its blocks are freed, its progress reset (recompute) and it goes back to the front
of the waiting queue, keeping the tokens it generated. No sequence is admitted in a step that
preempted. A sequence alone always fits (the engine caps `max_model_len` at the pool's size), so
every step makes progress and no request is lost.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from tilellm.cache.block_manager import BlockManager
from tilellm.engine.request import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's work: `seqs[i]` computes tokens `[starts[i], starts[i] + num_new_tokens[i])`.

    `samples[i]` is True when that reaches the end of the sequence's known tokens, so the step
    samples its next token. `admitted` lists the sequences that entered `running` in this step.
    `num_drafts[i]` (speculative decoding): the last that many of the sequence's new tokens are
    its draft (`seq.spec_token_ids`), verified in this step; its logits are needed at each.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Decides which sequences run in each step and how many tokens each computes."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self._admissions = itertools.count()
        self._running_dirty = False  # finished/aborted sequences still in `running`

    # -- queue management ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_front(self, seqs: list[Sequence]) -> None:
        """Queue `seqs` ahead of everything waiting (e.g. the other samples of a started request)."""
        self.waiting.extendleft(reversed(seqs))

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's blocks (it leaves `running` at the next schedule)."""
        if seq.status is SequenceStatus.WAITING:  # preempted while its last step was in flight
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        self._running_dirty = True

    def abort(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.finish(seq)  # also takes it out of `waiting` (or it is a sample not queued yet)

    @property
    def num_running(self) -> int:
        self._compact()
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        self._compact()
        return bool(self.running or self.waiting)

    def _compact(self) -> None:
        if self._running_dirty:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
            self._running_dirty = False

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids = []  # a draft is for the very next step only
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._compact()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        bs = bm.block_size
        running = self.running
        seqs, qlens, starts, samples = out.seqs, out.num_new_tokens, out.starts, out.samples
        drafts = out.num_drafts

        # Running sequences, oldest first: decodes (1 token, or 1 + its draft) and prompt chunks.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            total = len(seq.token_ids)
            num_drafts = 0
            if seq.spec_token_ids:
                if start == total - 1:  # decoding: the draft rides on its one new token
                    num_drafts = min(len(seq.spec_token_ids), budget - 1)
                if num_drafts < len(seq.spec_token_ids):
                    seq.spec_token_ids = seq.spec_token_ids[:num_drafts]
            n = min(total - start, budget) + num_drafts
            if start + n > len(seq.block_table) * bs:
                if num_drafts and not bm.allocate(seq, n):  # a draft never costs a preemption
                    n -= num_drafts
                    num_drafts = 0
                    seq.spec_token_ids = []
                while start + n > len(seq.block_table) * bs and not bm.allocate(seq, n):
                    victim = running.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    if not running and not seqs:
                        raise RuntimeError(f"KV pool of {bm.num_blocks} blocks cannot hold {seq!r} alone")
                    break
            seqs.append(seq)
            qlens.append(n)
            starts.append(start)
            samples.append(start + n >= total)
            drafts.append(num_drafts)
            seq.num_computed_tokens = start + n
            bm.commit(seq)
            budget -= n
            i += 1

        # Waiting sequences, first come first served, while the budget and the pool allow.
        if not out.preempted:
            now = time.perf_counter()
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                seq = waiting[0]
                # Prompt logprobs need logits at every prompt position: no cached prefix.
                wants_logits = seq.request.prompt_logprobs is not None and seq.index == 0
                hits = [] if wants_logits else bm.lookup_prefix(seq)
                num_cached = len(hits) * bs
                total = len(seq.token_ids)
                n = min(total - num_cached, budget)
                if not bm.allocate(seq, n, hits):
                    break
                waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                seq.admit_order = next(self._admissions)
                metrics = seq.request.metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = num_cached
                running.append(seq)
                out.admitted.append(seq)
                seqs.append(seq)
                qlens.append(n)
                starts.append(num_cached)
                samples.append(num_cached + n == total)
                drafts.append(0)
                seq.num_computed_tokens = num_cached + n
                bm.commit(seq)  # later admissions of this step can share these blocks
                budget -= n
        _order_for_kernels(out)
        return out


def _order_for_kernels(out: SchedulerOutput) -> None:
    """Reorder `out` for the attention kernels: sequences computing one token first, longest
    context first; the others after them, in their order.

    The attention layer runs the leading one-token run through the decode kernel (small tiles,
    one query each) and only the rest through the paged kernel's larger query tiles, where
    one-token rows would leave most of each tile's matrix work empty. The decode kernel's
    programs start in request order, so longest first is longest-processing-time-first
    scheduling: the grid's last wave holds short programs, not a long straggler (E1's decode
    step on an H200: 3767 -> 3935 GB/s). Ties keep their order (stable sort).
    """
    q = np.asarray(out.num_new_tokens, dtype=np.int64)
    if len(q) < 2:
        return
    ends = np.asarray(out.starts, dtype=np.int64) + q
    key = np.where(q == 1, -ends, np.iinfo(np.int64).max)
    order = np.argsort(key, kind="stable")
    if (order == np.arange(len(q))).all():
        return
    order = order.tolist()
    for name in ("seqs", "num_new_tokens", "starts", "samples", "num_drafts"):
        values = getattr(out, name)
        setattr(out, name, [values[i] for i in order])
