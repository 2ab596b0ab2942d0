"""Request and sequence state.

A `Request` is what a caller submitted: one prompt and its `SamplingParams`. It owns `n`
`Sequence`s (samples). A sequence is the unit the scheduler and the block manager work on:
its tokens (prompt + generated), how many of them have K/V in the cache, and its blocks.

Who sets what (one owner per fact):
  - scheduler: `status`, `num_computed_tokens` (advanced when a step is scheduled), `admit_order`
  - block manager: `block_table`, `block_hashes`, `num_hashed_blocks` (it alone decides what is
    committed to the prefix cache: `BlockManager.commit`), and `row`: the sequence's slot while it
    holds blocks, 0..max_num_seqs-1. The slot indexes every per-sequence array of the host side:
    its row of the block-table array, of the sampling table and of the engine's pending-token index.
  - engine (after a step): `token_ids` (appends; `num_pending` placeholders while a step is in
    flight, removed only by `drop_pending`), finish fields, logprobs, detokenizer, and the draft
    (`spec_token_ids`) the proposer made for the next step; after a verification it sets
    `num_computed_tokens` back to the tokens whose K/V is valid (the accepted ones)
"""

from __future__ import annotations

import enum
import itertools

from tilellm.engine.detokenizer import IncrementalDetokenizer
from tilellm.engine.outputs import Logprob, RequestMetrics
from tilellm.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue: no blocks (new, or preempted)
    RUNNING = "running"  # holds blocks, scheduled every step it fits the budget
    FINISHED = "finished"  # done (stop / length / abort), blocks released


_seq_counter = itertools.count()


class Sequence:
    """One sample: tokens, progress through them, and the KV blocks that hold them.

    NOTE: tokens `[0, num_computed_tokens)` have K/V in `block_table` (after the step that was
    scheduled for them runs); tokens `[num_computed_tokens, num_tokens)` are still to compute.
    A sequence samples a token in a step exactly when that step brings it to `num_tokens`.
    """

    __slots__ = (
        "seq_id",
        "request",
        "index",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_emitted_tokens",
        "num_emitted_chars",
        "status",
        "block_table",
        "block_hashes",
        "num_hashed_blocks",
        "cache_root",
        "row",
        "seed",
        "finish_reason",
        "stop_reason",
        "cumulative_logprob",
        "logprobs",
        "detokenizer",
        "text",
        "admit_order",
        "num_pending",
        "spec_token_ids",
        "spec_wait",
        "spec_misses",
        "matcher",
    )

    def __init__(self, request: Request, index: int, seed: int, cache_root: bytes | None):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit (tokens) at first admission
        # What delta outputs (`LLMEngine.output_deltas`) have already handed out.
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hash of each full block, computed lazily
        self.num_hashed_blocks = 0  # leading blocks whose hash is registered (or were cache hits)
        self.cache_root = cache_root  # None: never hashed (prefix caching off and n == 1)
        self.row = -1  # row in the block manager's block-table array while blocks are held
        self.seed = seed  # 64-bit seed of this sample's random stream
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob: float | None = 0.0 if request.params.logprobs is not None else None
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.text = ""  # final (or latest streamed) text; the detokenizer's text minus any stop string
        self.admit_order = -1  # when it last entered `running` (preemption takes the latest)
        self.num_pending = 0  # trailing placeholder tokens (-1) of launched steps not yet read back
        # Speculative decoding: the draft the next step verifies (not part of `token_ids`; -1s
        # are slots a model proposer fills on the device side), and the back-off of a sequence
        # whose drafts keep being rejected: it drafts again after `spec_wait` more steps.
        self.spec_token_ids: list[int] = []
        self.spec_wait = 0
        self.spec_misses = 0
        self.matcher = None  # structured outputs: the grammar matcher of this sample's output

    def drop_pending(self) -> None:
        """Remove the trailing placeholder tokens of launched steps (finish, abort)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_pending]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request.request_id!r}, index={self.index}, "
            f"status={self.status.value}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )


class Request:
    """One submitted prompt with its parameters and samples.

    Sample 0 is queued first; samples 1..n-1 are queued once sample 0 has prefilled the prompt,
    so that they find its full blocks in the cache and only compute the last partial block.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seeds: list[int],
        cache_root: bytes | None,
        arrival_time: float,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.seqs = [Sequence(self, i, seeds[i], cache_root) for i in range(params.n)]
        self.siblings_queued = params.n == 1
        # Prompt logprobs, filled in order by sample 0's prefill (None: not asked for).
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False  # delta outputs: handed out once, when complete

    @property
    def is_finished(self) -> bool:
        for s in self.seqs:  # (a loop, not all(genexpr): streaming asks this of every request each step)
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True
