"""The engine: requests in, one scheduler step at a time, outputs out.

    engine = LLMEngine("path/to/model", max_num_seqs=64)
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.outputs[0].text)

`step()` reads as three parts: schedule (which sequences run, how many tokens each), launch
(metadata -> model -> sampler on the device), postprocess (tokens in, stop checks, text out).

Asynchronous scheduling (`engine.async_scheduling = True`; `LLM` sets it on CUDA): `step()`
schedules and launches step N+1 before it reads back step N, so that the host's work overlaps
the device's. A sequence sampled in step N then holds a placeholder token (-1) that step N+1 feeds
to the model straight from the device; a sequence that step N finishes has its step N+1 token
dropped. Outputs come one `step()` call later; nothing else changes.

Speculative decoding (`speculative_config`): before scheduling, a proposer drafts tokens for
decoding sequences (`tilellm.spec_decode`); the step computes each draft with its sequence's new
token (one multi-token row of the paged kernel, logits at every position), and postprocessing
accepts the draft up to its first token that differs from the sampled one, then rolls the K/V
of the rejected ones back (`_postprocess_verified`).
"""

from __future__ import annotations

import functools
import itertools
import json
import numbers
import pathlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tilellm.cache.block_manager import SHARED_ROOT, BlockManager, request_root
from tilellm.config import EngineConfig
from tilellm.engine.detokenizer import IncrementalDetokenizer, backend_decode
from tilellm.engine.generation_config import default_sampling_values
from tilellm.engine.metrics import Metric, engine_metrics
from tilellm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tilellm.engine.request import Request, Sequence, SequenceStatus
from tilellm.engine.sampling_params import RequestOutputKind, SamplingParams
from tilellm.engine.sampling_table import SamplingTable
from tilellm.engine.scheduler import Scheduler, SchedulerOutput
from tilellm.engine.stats import EngineStats, StepSnapshot, StepTimings
from tilellm.engine.structured_output import GrammarBackend
from tilellm.spec_decode import SpecDecodingStats, make_proposer
from tilellm.spec_decode.proposer import DeviceProposer
from tilellm.worker.draft_runner import DraftRequest
from tilellm.worker.model_runner import InputPatch, ModelRunner, StepHandle, StepResult, start_runner
from tilellm.worker.sampler import HostSampling
from tilellm.worker.step_inputs import StepInputs, build_step_inputs, concat_ranges

_MASK64 = (1 << 64) - 1


def _sample_seed(base: int, index: int) -> int:
    """Seed of sample `index` of a request (sample 0 keeps the request's own seed)."""
    return (base + index * 0x9E3779B97F4A7C15) & _MASK64


def find_stop_string(text: str, num_new: int, stops: list[str], longest: int) -> tuple[int, str] | None:
    """The earliest stop string that ends in the last `num_new` characters of `text`, as
    (start, stop string). Only a window of `num_new + longest - 1` characters is searched: a match
    that ends earlier was found by an earlier call."""
    begin = max(0, len(text) - num_new - longest + 1)
    window = text[begin:]
    found = [(i, s) for s in stops if (i := window.find(s)) != -1]
    if not found:
        return None
    i, s = min(found)
    return begin + i, s


def _eos_token_ids(model_dir: str, hf_config: Any, tokenizer: Any) -> list[int]:
    """EOS ids: the tokenizer's, config.json's and generation_config.json's (as HF generate uses)."""
    ids: list[int] = []

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(x for x in v if isinstance(x, int))

    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    add(getattr(hf_config, "eos_token_id", None))
    gen_path = pathlib.Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        try:
            add(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError):
            pass
    return list(dict.fromkeys(ids))


@dataclass
class _EarlyFinish:
    """A step finished by `_fill_bitmask` while the next one launched: its outputs and time."""

    emit_partial: bool
    outputs: list[RequestOutput] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _InFlight:
    """A launched step and what its postprocessing needs."""

    sched: SchedulerOutput
    inputs: StepInputs  # host arrays
    sampled: list[Sequence]
    sampling: HostSampling
    positions: np.ndarray  # [N] position of each sampled row's new token (its placeholder)
    handle: StepHandle
    # Speculative decoding: the draft each sampled sequence had verified ([N] counts and the
    # lists); None when no sequence of the step had one (one logits row per sampled sequence).
    num_drafts: np.ndarray | None = None
    drafts: list[list[int]] | None = None
    # Prompt logprobs: (request, first, end) whose positions [first, end) this step scores.
    prompt_rows: list[tuple[Request, int, int]] | None = None
    times: list[float] = field(default_factory=list)  # schedule, prepare+launch seconds


class LLMEngine:
    """Continuous-batching engine over one model (see the module docstring).

    Thread safety: every public method holds one lock, so a server may call `add_request` /
    `abort_request` from another thread than the one calling `step`.
    """

    def __init__(self, model: str, **llm_kwargs: Any):
        self.config = EngineConfig(model=str(model), **llm_kwargs)
        cfg = self.config
        # What a request leaves unset (`LLM.generate` without sampling_params, the server).
        self.default_sampling = default_sampling_values(cfg.model, cfg.generation_config)
        self.runner = self._make_runner(cfg)
        self.model_config = self.runner.hf_config
        self.max_model_len: int = self.runner.max_model_len
        self.model_config.max_model_len = self.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.tokenizer = None
        if not cfg.skip_tokenizer_init:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
            except BaseException:
                self.shutdown()  # no worker processes left behind
                raise
        # the tokenizer's decode, or its Rust backend's where that gives the same text
        self._decode_ids = (
            None if self.tokenizer is None else backend_decode(self.tokenizer) or self.tokenizer.decode
        )
        self.eos_token_ids = _eos_token_ids(cfg.model, self.model_config, self.tokenizer)
        # [V] bool: whether a sampled token id is an end-of-sequence token (one table read a
        # token in each step's stop check, where np.isin cost about 10 us a step)
        eos_ids = [t for t in self.eos_token_ids if t >= 0]
        self._is_eos = np.zeros(max([self.vocab_size, *(t + 1 for t in eos_ids)]), dtype=bool)
        self._is_eos[np.asarray(eos_ids, dtype=np.int64)] = True
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            max_blocks_per_seq=self.runner.max_blocks_per_seq,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
        )
        self.sampling_table = SamplingTable(cfg.max_num_seqs, self.vocab_size)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(cfg.seed)  # seeds of requests that bring none
        self._lock = threading.RLock()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.timings = StepTimings()
        self.record_steps = False  # keep one StepTimings record per step (benchmarks)
        self._last_step_data: tuple | None = None
        # Asynchronous scheduling: step N+1 is scheduled and launched before step N's tokens are
        # read, so host work overlaps device work; outputs (and `last_step`) lag one call. Off by
        # default here (step-by-step callers see each step's own result); `LLM` turns it on on CUDA.
        self.async_scheduling = False
        # Delta outputs (the server's streaming): each RequestOutput's samples carry only what is
        # new since that request's previous output (token ids, text, logprobs), so a step costs
        # O(new tokens) per request instead of copying every output so far. Off: cumulative.
        self.output_deltas = False
        # Streamed outputs every `stream_interval` tokens (vLLM's and SGLang's --stream-interval).
        self.stream_interval = cfg.stream_interval
        self._inflight: _InFlight | None = None
        self._pending_src = np.zeros(cfg.max_num_seqs, dtype=np.int64)  # row -> index in its step
        self._last_step: StepSnapshot | None = None
        spec = cfg.speculative_config
        # Speculative decoding: drafts for decoding sequences, verified by the next step. Each step
        # then needs the last one's tokens to draft from, so it runs synchronously.
        self.proposer = make_proposer(spec) if spec is not None else None
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens if spec is not None else 0)
        self._spec_probe_gap = 1  # steps from one drafting try to the next (see `step`)
        self._spec_probe_in = 0  # steps until the next try
        self._spec_misses = 0  # tries in a row that found no draft
        self._collecting: set[str] = set()  # requests whose prompt logprobs are not complete yet
        self._grammar: GrammarBackend | None = None  # structured outputs (made on first use)
        self._constrained: set[int] = set()  # unfinished sequences with a grammar

    def _make_runner(self, config: EngineConfig) -> ModelRunner:
        """The model runner (tests substitute one that needs no model); see `start_runner`."""
        return start_runner(config)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (idempotent; also done at exit)."""
        runner = getattr(self, "runner", None)
        if runner is not None and hasattr(runner, "shutdown"):
            runner.shutdown()

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. ValueError (nothing allocated, the engine unaffected) when the prompt has
        token ids outside the vocabulary, the id is taken, or `SamplingParams.check_request` refuses
        it (an empty prompt, one not shorter than max_model_len, a stop token outside the vocabulary)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        with self._lock:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
            if request_id in self.requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            text, ids = self._tokenize(prompt)
            if params.bad_words:
                if self.tokenizer is None:
                    raise ValueError(
                        "SamplingParams.bad_words needs the tokenizer (skip_tokenizer_init=True)"
                    )
                params.update_from_tokenizer(self.tokenizer)
            # The rule the server applies too, before admission: one message for both.
            params.check_request(len(ids), self.max_model_len, self.vocab_size)
            base = self._rng.getrandbits(64) if params.seed is None else params.seed & _MASK64
            seeds = [_sample_seed(base, i) for i in range(params.n)]
            if self.config.enable_prefix_caching:
                root = SHARED_ROOT
            else:  # only the samples of this request share blocks
                root = request_root(request_id) if params.n > 1 else None
            req = Request(request_id, text, ids, params, seeds, root, time.perf_counter())
            if params.structured_outputs is not None:  # compiled now: a bad grammar allocates nothing
                backend = self._grammar_backend()
                for seq in req.seqs:
                    seq.matcher = backend.matcher(params.structured_outputs)
                self._constrained.update(seq.seq_id for seq in req.seqs)
            self.requests[request_id] = req
            if req.prompt_logprobs is not None:
                self._collecting.add(request_id)
            self.scheduler.add(req.seqs[0])
            self.prompt_tokens_total += len(ids)

    def _grammar_backend(self) -> GrammarBackend:
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the tokenizer (skip_tokenizer_init=True)")
            self._grammar = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "a text prompt needs the tokenizer (skip_tokenizer_init=True): pass token ids"
                )
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = list(prompt)  # the usual case: plain ints (not bool), one cheap pass
        else:
            try:
                items = list(prompt)
            except TypeError:
                raise ValueError(
                    f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
                ) from None
            # As the server's strict schema: 4.0 and True are not token ids.
            bad = next((t for t in items if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
            if bad is not None:
                raise ValueError(f"prompt token ids must be integers, got {bad!r}")
            ids = [int(t) for t in items]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return getattr(prompt, "text", None), ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now, freeing its blocks; False when it is unknown or already finished."""
        with self._lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            self._collecting.discard(request_id)
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    seq.drop_pending()
                    self._constrained.discard(seq.seq_id)
                    if self.proposer is not None:
                        self.proposer.forget(seq.seq_id)
                    self.scheduler.abort(seq)
            return True

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self.requests)

    # -- the step -------------------------------------------------------------------------------

    def step(self, *, emit_partial: bool = True) -> list[RequestOutput]:
        """One scheduler step; outputs of the requests that got new tokens or finished.

        Schedules and launches a step, then finishes the previous one (asynchronous scheduling)
        or this one (synchronous). With asynchronous scheduling the outputs are the tokens of the
        step launched by the previous call (the first call after an idle period returns []); keep
        calling while `has_unfinished_requests()`. `emit_partial=False` (offline `LLM.generate`):
        only finished requests are returned, and text is decoded once at the end unless stop
        strings need it.

        Speculative decoding: a step that drafts needs every token of the step before, so it runs
        synchronously (a step in flight is finished first). Drafting is tried every step while
        drafts are found; after `_SPEC_PATIENCE` tries in a row in which no sequence got one, the
        tries space out (2, 4, ... up to 64 steps apart), and the steps between run asynchronously."""
        with self._lock:
            t0 = time.perf_counter()
            drained: list[RequestOutput] = []
            speculate = self.proposer is not None and self._spec_probe_in <= 1
            if self.proposer is not None:
                self._spec_probe_in -= 1
            # (A grammar's mask follows the token drawn last: `_fill_bitmask` finishes the step in
            # flight once this step's forward is queued, into `early`.)
            early = _EarlyFinish(emit_partial)
            if speculate and self._inflight is not None:
                done, self._inflight = self._inflight, None  # its tokens are what this step follows
                drained = self._finish_step(done, emit_partial)
            if speculate:
                found = self._propose_drafts()
                if found is not None:  # None: no sequence was decoding, try again next step
                    self._spec_misses = 0 if found else self._spec_misses + 1
                    gap = 1 if self._spec_misses < self._SPEC_PATIENCE else 2 * self._spec_probe_gap
                    self._spec_probe_gap = min(gap, self._SPEC_MAX_PROBE_GAP)
                self._spec_probe_in = self._spec_probe_gap if found is not None else 1
            sched = self.scheduler.schedule()
            launched: _InFlight | None = None
            if not sched.is_empty:
                for seq in sched.admitted:
                    params = seq.request.params
                    self.sampling_table.set_row(
                        seq.row,
                        params,
                        seq.seed,
                        seq.num_prompt_tokens,
                        self.eos_token_ids,
                        self.max_model_len,
                    )
                    if params.has_penalties:  # the slot's token counts, from what it has so far
                        outputs = [t for t in seq.output_token_ids if t >= 0]
                        self.runner.reset_penalty_row(seq.row, seq.request.prompt_token_ids, outputs)
                    if params.bad_words:  # the slot's last output tokens, which the words' prefixes match
                        self.runner.reset_bad_words_row(seq.row, [t for t in seq.output_token_ids if t >= 0])
                if self.proposer is not None and self.proposer.needs_device and any(sched.num_drafts):
                    self._draft_on_device(sched)
                t1 = time.perf_counter()
                launched = self._launch(sched, early)
                t2 = time.perf_counter()
                launched.times = [t1 - t0, t2 - t1 - early.seconds]  # (the step before timed as its own)
            elif self._inflight is None:
                if self.scheduler.has_work():
                    raise RuntimeError("the scheduler made no progress with requests pending")
                return drained
            drained += early.outputs
            verifies = launched is not None and launched.num_drafts is not None
            if self.async_scheduling and not verifies:  # finish the last step meanwhile
                done, self._inflight = self._inflight, launched
            else:
                done, self._inflight = (self._inflight or launched), None
                if done is not launched and launched is not None:  # async was just switched off
                    self._inflight = launched
            if done is None:
                return drained
            return drained + self._finish_step(done, emit_partial)

    def _finish_step(self, done: _InFlight, emit_partial: bool) -> list[RequestOutput]:
        """Wait for a launched step, then its postprocessing; its outputs."""
        t3 = time.perf_counter()
        result = self.runner.wait(done.handle)
        t4 = time.perf_counter()
        outputs = self._postprocess(done, result, emit_partial)
        t5 = time.perf_counter()
        self._last_step_data = (done.sched, done.inputs)
        self._last_step = None
        self._record_timing(done, t4 - t3, t5 - t4, result.device_time_s)
        return outputs

    # Drafting tries in a row that may find no draft for any sequence before the tries space out
    # (2, 4, ... steps apart), and the widest gap between two tries.
    _SPEC_PATIENCE = 8
    _SPEC_MAX_PROBE_GAP = 64

    # Back-off of a sequence whose drafts are all rejected: it skips 1, 3, 7, 15 steps before
    # drafting again (a draft that is found but wrong costs a wider verification step).
    _SPEC_MAX_WAIT = 15

    def _propose_drafts(self) -> bool | None:
        """Give each decoding sequence the draft its next step verifies (see `tilellm.spec_decode`);
        True when any sequence got one, None when no sequence was decoding (nothing was tried).

        A draft never reaches past the sequence's output limit: the step emits up to d + 1 tokens."""
        proposer = self.proposer
        assert proposer is not None
        max_outputs = self.sampling_table.max_outputs
        running = SequenceStatus.RUNNING
        found: bool | None = None
        for seq in self.scheduler.running:
            if (
                seq.status is not running
                or seq.num_pending
                or seq.num_computed_tokens != len(seq.token_ids) - 1
            ):
                continue
            found = found or False
            if seq.spec_wait:
                seq.spec_wait -= 1
                continue
            params = seq.request.params
            if params.has_penalties or params.bad_words or seq.matcher is not None:
                continue  # each position's penalties, bad words or grammar mask need the tokens before it
            room = int(max_outputs[seq.row]) - seq.num_output_tokens - 1
            seq.spec_token_ids = proposer.propose(seq.seq_id, seq.token_ids, room) if room > 0 else []
            found = found or bool(seq.spec_token_ids)
        return found

    def _draft_on_device(self, sched: SchedulerOutput) -> None:
        """Fill the draft slots the scheduler kept for this step from the draft model."""
        proposer = self.proposer
        assert isinstance(proposer, DeviceProposer)
        table = self.sampling_table
        seqs, requests = [], []
        for seq, d in zip(sched.seqs, sched.num_drafts):
            if not d:
                continue
            row, known = seq.row, len(seq.token_ids)
            requests.append(
                DraftRequest(
                    token_ids=seq.token_ids,
                    num_computed=proposer.num_computed(seq.seq_id, seq.admit_order, known - 1),
                    num_drafts=d,
                    row=row,
                    greedy=bool(table.greedy[row]),
                    inv_temp=float(table.inv_temp[row]),
                    seed_key=int(table.seed_key[row]),
                    step=known - seq.num_prompt_tokens,
                )
            )
            seqs.append(seq)
        proposal = self.runner.propose_drafts(requests, self.block_manager.block_tables)
        for seq, tokens, n in zip(seqs, proposal.token_ids, proposal.num_computed):
            seq.spec_token_ids = tokens
            proposer.record(seq.seq_id, seq.admit_order, n)

    def _prompt_rows(
        self, sched: SchedulerOutput
    ) -> tuple[list[tuple[int, int] | None] | None, list[tuple[Request, int, int]] | None]:
        """Positions whose logits give prompt logprobs, per scheduled sequence (for
        `build_step_inputs`), and the same as (request, first, end) for the postprocessing.
        Position p predicts prompt token p + 1; the next one a request lacks is token
        len(request.prompt_logprobs)."""
        rows: list[tuple[int, int] | None] = []
        of: list[tuple[Request, int, int]] = []
        for seq, start, n in zip(sched.seqs, sched.starts, sched.num_new_tokens):
            req = seq.request
            r = None
            if seq.index == 0 and req.request_id in self._collecting:
                first = max(start, len(req.prompt_logprobs) - 1)
                end = min(start + n, seq.num_prompt_tokens - 1)
                if first < end:
                    r = (first, end)
                    of.append((req, first, end))
            rows.append(r)
        return (rows, of) if of else (None, None)

    def _add_prompt_logprobs(self, done: _InFlight, result: StepResult) -> None:
        """Append the step's prompt logprobs to their requests, in order (a row scored twice, by a
        step in flight when its sequence was preempted and recomputed, is appended once)."""
        res = result.prompt
        assert res is not None and done.prompt_rows is not None
        lps, ranks = res.token_logprobs.tolist(), res.ranks.tolist()
        top_lp, top_ids = res.top_logprobs.tolist(), res.top_token_ids.tolist()
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        row = 0
        for req, first, end in done.prompt_rows:
            entries = req.prompt_logprobs
            k = req.params.prompt_logprobs
            for p in range(first, end):
                if p + 1 == len(entries) and req.request_id in self._collecting:
                    token = req.prompt_token_ids[p + 1]
                    entry = {token: Logprob(lps[row], ranks[row])}
                    for rank, (tid, v) in enumerate(zip(top_ids[row][:k], top_lp[row][:k]), start=1):
                        if tid not in entry:
                            entry[tid] = Logprob(v, rank)
                    if decode is not None:
                        for tid, item in entry.items():
                            item.decoded_token = decode([tid])
                    entries.append(entry)
                row += 1
            if len(entries) == len(req.prompt_token_ids):
                self._collecting.discard(req.request_id)

    def _verification_pad(self, sched: SchedulerOutput) -> int:
        """k when this verification step is best padded to k draft tokens per request (the runner
        replays such steps from a CUDA graph: every request decodes, few enough of them, and k
        more positions fit each), else 0."""
        k, most = getattr(self.runner, "verify_pad", (0, 0))
        if not k or len(sched.seqs) > most:
            return 0
        if any(q != 1 + d for q, d in zip(sched.num_new_tokens, sched.num_drafts)):
            return 0  # a prompt chunk in the step: eager
        if max(sched.starts) + k + 1 > self.block_manager.max_blocks_per_seq * self.block_manager.block_size:
            return 0
        return k

    def _launch(self, sched: SchedulerOutput, early: _EarlyFinish) -> _InFlight:
        """Build the step's inputs (host arrays) and start it on the device.

        Sampled sequences get a placeholder token (-1) until the step's result arrives; a later
        step that already feeds it to the model reads it on the device (`InputPatch`).
        """
        seqs = sched.seqs
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs))
        drafts = None
        pad = 0
        prompt_rows, prompt_of = self._prompt_rows(sched) if self._collecting else (None, None)
        if self.proposer is not None and any(sched.num_drafts):
            drafts = [s.spec_token_ids if d else [] for s, d in zip(seqs, sched.num_drafts)]
            pad = self._verification_pad(sched)
        inputs = build_step_inputs(
            [s.token_ids for s in seqs],
            sched.starts,
            sched.num_new_tokens,
            rows,
            sched.samples,
            self.block_manager.block_tables,
            self.block_manager.block_size,
            draft_token_ids=drafts,
            pad_drafts_to=pad,
            prompt_rows=prompt_rows,
        )
        mask = np.asarray(sched.samples, dtype=bool)
        sampled = [s for s, smp in zip(seqs, sched.samples) if smp]
        # A sampled row ends its sequence's tokens: its seq_len is the new token's position.
        positions = (np.asarray(sched.starts, dtype=np.int64) + np.asarray(sched.num_new_tokens))[mask]
        sampled_rows = rows[mask]
        num_drafts = None
        if drafts is None:
            sampling = self.sampling_table.gather(sampled_rows, positions)
        else:  # one logits row per draft token and one after: row j samples position p + j
            num_drafts = np.asarray(sched.num_drafts, dtype=np.int64)[mask]
            positions -= num_drafts
            width = num_drafts + 1
            sampling = self.sampling_table.gather(
                np.repeat(sampled_rows, width), concat_ranges(positions, width)
            )
            drafts = [d for d, smp in zip(drafts, sched.samples) if smp]
        if prompt_of:
            sampling.max_num_prompt_logprobs = max(req.params.prompt_logprobs for req, _, _ in prompt_of)
        bitmask = None
        if self._constrained and any(s.matcher is not None for s in sampled):
            row_matchers: list = []
            widths = num_drafts.tolist() if num_drafts is not None else [0] * len(sampled)
            for s, d in zip(sampled, widths):
                row_matchers += [s.matcher] + [None] * d  # (constrained sequences never draft)
            bitmask = functools.partial(self._fill_bitmask, row_matchers, early)
        patch = None
        pending = np.flatnonzero(inputs.input_ids < 0)
        if len(pending):
            assert self._inflight is not None, "a placeholder token without a step in flight"
            cu = inputs.cu_seqlens_q
            req = np.searchsorted(cu, pending, side="right") - 1
            patch = InputPatch(pending, self._pending_src[rows[req]], self._inflight.handle)
        if drafts is None:
            handle = self.runner.launch(inputs, sampling, patch, bitmask=bitmask)
        else:  # the logits row checking each draft token, and the token
            assert num_drafts is not None
            rows = concat_ranges(np.cumsum(num_drafts + 1) - num_drafts - 1, num_drafts)
            ids = np.fromiter(itertools.chain.from_iterable(drafts), dtype=np.int64, count=len(rows))
            handle = self.runner.launch(inputs, sampling, patch, drafts=(rows, ids), bitmask=bitmask)
        for seq in sampled:
            if seq.status is SequenceStatus.FINISHED:  # by the step before, read back in `_fill_bitmask`
                continue
            seq.token_ids.append(-1)
            seq.num_pending += 1
        self._pending_src[sampled_rows] = np.arange(len(sampled))
        return _InFlight(
            sched, inputs, sampled, sampling, positions, handle, num_drafts=num_drafts, drafts=drafts,
            prompt_rows=prompt_of,
        )  # fmt: skip

    def _fill_bitmask(self, row_matchers: list, early: _EarlyFinish) -> Any:
        """Structured outputs' token bitmask of the step being launched; the runner calls it once
        the step's forward is queued. The step before (still in flight under asynchronous
        scheduling) is finished first, so every matcher has accepted its token; its outputs go to
        `early`, which this `step` call returns."""
        if self._inflight is not None:
            t0 = time.perf_counter()
            done, self._inflight = self._inflight, None
            early.outputs += self._finish_step(done, early.emit_partial)
            early.seconds += time.perf_counter() - t0
        assert self._grammar is not None
        return self._grammar.bitmasks(row_matchers, pin_memory=bool(getattr(self.runner, "is_cuda", False)))

    def _record_timing(self, done: _InFlight, wait_s: float, post_s: float, device_s: float | None) -> None:
        tm = self.timings
        tm.num_steps += 1
        kind = done.inputs.kind.value
        tm.num_decode_steps += kind == "decode"
        schedule_s, prepare_s = done.times
        tm.schedule_s += schedule_s
        tm.prepare_s += prepare_s
        tm.execute_s += wait_s
        tm.postprocess_s += post_s
        if device_s is not None:
            tm.device_s += device_s
        if self.record_steps:
            ntok = done.inputs.num_tokens
            tm.records.append(
                (kind, len(done.sched.seqs), ntok, schedule_s, prepare_s, wait_s, device_s, post_s)
            )

    # -- postprocess ----------------------------------------------------------------------------

    def _postprocess(self, done: _InFlight, result: StepResult, emit_partial: bool) -> list[RequestOutput]:
        if done.prompt_rows is not None:
            self._add_prompt_logprobs(done, result)
        if done.num_drafts is not None:
            return self._postprocess_verified(done, result, emit_partial)
        sampled, sampling = done.sampled, done.sampling
        tokens = result.token_ids.tolist()
        alive = np.ones(len(sampled), dtype=bool)
        for k, (seq, token, pos) in enumerate(zip(sampled, tokens, done.positions.tolist())):
            if seq.status is SequenceStatus.FINISHED:  # stopped or aborted while this step ran
                alive[k] = False
                continue
            seq.token_ids[pos] = token
            seq.num_pending -= 1
        bm = self.block_manager
        for seq in sampled:  # blocks completed by the tokens just read back
            if seq.status is not SequenceStatus.FINISHED:
                bm.commit(seq)
        self.generation_tokens_total += int(alive.sum())
        now = time.perf_counter()

        # Vectorised stop checks; only rows that stop or need more run Python code below.
        table = self.sampling_table
        rows = sampling.rows
        length_done = sampling.steps + 1 >= table.max_outputs[rows]
        eos_done = self._is_eos[result.token_ids] & table.eos_stops[rows]
        special = table.python_checks[rows] | (sampling.steps == 0)
        check = length_done | eos_done | special  # rows with Python work: stops, logprobs, n > 1
        if emit_partial:
            # Every live row gets an output; with a tokenizer each also extends its text.
            visit = np.flatnonzero(alive).tolist()
            if self.tokenizer is not None:
                check = alive
        else:
            visit = np.flatnonzero(check & alive).tolist()
        positions = done.positions
        touched: dict[str, Request] = {}
        for k in visit:
            seq = sampled[k]
            req = seq.request
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if not check[k]:  # a plain token of a streamed sequence: nothing to check
                continue
            self._check_stop(
                seq,
                tokens[k],
                int(positions[k]),
                k,
                bool(eos_done[k]),
                bool(length_done[k]),
                result,
                emit_partial,
            )
        return self._outputs(touched, emit_partial, now)

    def _outputs(self, touched: dict[str, Request], emit_partial: bool, now: float) -> list[RequestOutput]:
        """The step's outputs of the requests it touched: every one (emit_partial) but those
        asking for their final output only (`RequestOutputKind.FINAL_ONLY`: their text is still
        extended step by step, so that it is the text a stream of the same tokens shows) and,
        with `stream_interval` N > 1, those with fewer than N tokens not yet handed out (a
        request's first token goes out at once); or (offline) the finished ones."""
        if not emit_partial:
            return [self._make_output(req) for req in touched.values() if req.is_finished]
        final_only = RequestOutputKind.FINAL_ONLY
        interval = self.stream_interval
        outputs = []
        for req in touched.values():
            req.metrics.last_token_time = now
            if req.is_finished:
                outputs.append(self._make_output(req))
            elif req.params.output_kind is not final_only and (interval == 1 or _stream_due(req, interval)):
                outputs.append(self._make_output(req))
        return outputs

    def _postprocess_verified(
        self, done: _InFlight, result: StepResult, emit_partial: bool
    ) -> list[RequestOutput]:
        """`_postprocess` of a step that verified drafts: sequence k's rows are its draft's
        positions and one after. Its draft is accepted while each draft token equals the token
        sampled at that row (greedy: the argmax; sampled: a draw that the rejection sampler makes
        equal to the draft exactly with the acceptance probability); the tokens emitted are the
        sampled ones up to and including the first that differs (or the one after the draft).

        Each emitted token then goes through the same checks as a decode step's, in order: a stop
        inside the accepted run ends the sequence there. K/V is valid up to the last accepted
        draft token: `num_computed_tokens` goes back there and blocks holding only rejected
        tokens are released; only then are full blocks committed to the prefix cache."""
        sampled, sampling = done.sampled, done.sampling
        assert done.num_drafts is not None and done.drafts is not None
        tokens = result.token_ids.tolist()
        table = self.sampling_table
        rows = sampling.rows
        length_done = (sampling.steps + 1 >= table.max_outputs[rows]).tolist()
        eos_done = (self._is_eos[result.token_ids] & table.eos_stops[rows]).tolist()
        special = (table.python_checks[rows] | (sampling.steps == 0)).tolist()
        check_all = emit_partial and self.tokenizer is not None
        width = done.num_drafts + 1
        first_rows = (np.cumsum(width) - width).tolist()
        bm, stats = self.block_manager, self.spec_stats
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        for k, seq in enumerate(sampled):
            if seq.status is SequenceStatus.FINISHED:
                continue
            r0, draft = first_rows[k], done.drafts[k]
            accepted = 0
            while accepted < len(draft) and tokens[r0 + accepted] == draft[accepted]:
                accepted += 1
            if draft:
                stats.observe(len(draft), accepted)
                if accepted:
                    seq.spec_misses = 0
                else:
                    seq.spec_misses += 1
                    seq.spec_wait = min((1 << seq.spec_misses) - 1, self._SPEC_MAX_WAIT)
            seq.spec_token_ids = []
            req = seq.request
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            pos = int(done.positions[k])
            for j in range(accepted + 1):
                r, token = r0 + j, tokens[r0 + j]
                if j == 0:
                    seq.token_ids[pos] = token
                    seq.num_pending -= 1
                else:
                    seq.token_ids.append(token)
                self.generation_tokens_total += 1
                if check_all or length_done[r] or eos_done[r] or special[r]:
                    self._check_stop(
                        seq, token, pos + j, r, eos_done[r], length_done[r], result, emit_partial
                    )
                    if seq.status is SequenceStatus.FINISHED:
                        break
            if seq.status is not SequenceStatus.FINISHED:
                seq.num_computed_tokens = pos + accepted
                bm.trim(seq, len(seq.token_ids))
                bm.commit(seq)
        return self._outputs(touched, emit_partial, now)

    def _check_stop(
        self,
        seq: Sequence,
        token: int,
        pos: int,
        k: int,
        eos_done: bool,
        length_done: bool,
        result: StepResult,
        emit_partial: bool,
    ) -> None:
        """Logprobs, stop conditions, text and sibling samples of one sequence after its new token."""
        req = seq.request
        params = req.params
        if seq.logprobs is not None:
            self._append_logprobs(seq, k, token, result)
        reason: str | None = None
        stop_reason: int | str | None = None
        if seq.matcher is not None:
            # The mask let only this token through; a grammar that is complete ends the output
            # (at its stop token, even with ignore_eos: nothing may follow it).
            if not seq.matcher.accept_token(token) or seq.matcher.is_terminated():
                eos_done = True
        if eos_done:
            reason = "stop"
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif length_done:
            reason = "length"
        if params.stop or emit_partial:
            hit = self._detokenize(seq, token, pos, reason is not None)
            if hit is not None and reason != "stop":
                reason, stop_reason = "stop", hit
        if reason is not None:
            self._finish(seq, reason, stop_reason)
        if not req.siblings_queued and seq.index == 0:
            req.siblings_queued = True
            self.scheduler.add_front(req.seqs[1:])

    def _detokenize(self, seq: Sequence, token: int, pos: int, finishing: bool) -> str | None:
        """Extend `seq.text`; returns the stop string that ends it, if any (text cut before it)."""
        if self.tokenizer is None:
            return None
        params = seq.request.params
        detok = seq.detokenizer
        if detok is None:
            detok = seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                seq.token_ids[: seq.num_prompt_tokens],
                params.skip_special_tokens,
                self._decode_ids,
            )
            if pos > seq.num_prompt_tokens:  # tokens generated before streaming began
                detok.add(seq.token_ids[seq.num_prompt_tokens : pos])
        delta = detok.add([token])
        if finishing:
            delta += detok.flush()
        text = detok.text
        stops = params.stop
        if stops and delta and pos + 1 - seq.num_prompt_tokens >= params.min_tokens:
            hit = find_stop_string(text, len(delta), stops, params.longest_stop)
            if hit is not None:
                i, s = hit
                seq.text = text[:i]
                return s
        if stops and not finishing:  # hold back what could be the start of a stop string
            longest = params.longest_stop
            seq.text = text[: max(len(seq.text), len(text) - longest + 1)]
        else:
            seq.text = text
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.drop_pending()  # placeholders of a step still in flight: its tokens are dropped
        if seq.matcher is not None:
            self._constrained.discard(seq.seq_id)
            seq.matcher = None
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)
            seq.spec_token_ids = []
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)
        if seq.detokenizer is None and self.tokenizer is not None:
            skip = seq.request.params.skip_special_tokens
            seq.text = self._decode_ids(seq.output_token_ids, skip_special_tokens=skip)
        req = seq.request
        if req.is_finished:
            req.metrics.finished_time = time.perf_counter()
            self.requests.pop(req.request_id, None)
            self._collecting.discard(req.request_id)

    def _append_logprobs(self, seq: Sequence, k: int, token: int, result: StepResult) -> None:
        lp = float(result.sampled_logprobs[k])
        entry = {token: Logprob(lp, int(result.sampled_ranks[k]))}
        num = seq.request.params.logprobs or 0
        if num and result.top_token_ids is not None:
            ids = result.top_token_ids[k, :num].tolist()
            lps = result.top_logprobs[k, :num].tolist()
            for rank, (tid, v) in enumerate(zip(ids, lps), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(v, rank)
        if self.tokenizer is not None:
            for tid, item in entry.items():
                item.decoded_token = self._decode_ids([tid], skip_special_tokens=False)
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp

    def _make_output(self, req: Request) -> RequestOutput:
        deltas = self.output_deltas or req.params.output_kind is RequestOutputKind.DELTA
        sample = self._delta_output if deltas else self._cumulative_output
        seqs = req.seqs
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is not None and deltas:  # handed out once, complete
            if req.prompt_logprobs_sent or len(prompt_logprobs) < len(req.prompt_token_ids):
                prompt_logprobs = None
            else:
                req.prompt_logprobs_sent = True
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [sample(seqs[0])] if len(seqs) == 1 else [sample(s) for s in seqs],
            req.is_finished,
            seqs[0].num_cached_tokens,
            req.metrics,
            prompt_logprobs,
        )

    @staticmethod
    def _cumulative_output(s: Sequence) -> CompletionOutput:
        """Everything sequence `s` has produced so far."""
        # what this output hands out: `stream_interval` counts the tokens not handed out yet
        s.num_emitted_tokens = len(s.token_ids) - s.num_pending - s.num_prompt_tokens
        return CompletionOutput(
            index=s.index,
            text=s.text,
            token_ids=s.output_token_ids,
            cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    @staticmethod
    def _delta_output(s: Sequence) -> CompletionOutput:
        """What sequence `s` produced since its previous delta output. A trailing U+FFFD (an
        incomplete UTF-8 character) is held back until the sequence finishes."""
        first = s.num_emitted_tokens
        p = s.num_prompt_tokens
        end = len(s.token_ids) - s.num_pending - p
        token_ids = s.token_ids[p + first : p + end] if end > first else []
        if end > first:
            s.num_emitted_tokens = end
        text = s.text
        new_text = ""
        if text:  # (no tokenizer: no text at all)
            visible = len(text) if s.finish_reason is not None else len(text.rstrip("\ufffd"))
            if visible > s.num_emitted_chars:
                new_text = text[s.num_emitted_chars : visible]
                s.num_emitted_chars = visible
        logprobs = s.logprobs
        return CompletionOutput(
            s.index,
            new_text,
            token_ids,
            s.cumulative_logprob,
            logprobs[first : first + len(token_ids)] if logprobs is not None else None,
            s.finish_reason,
            s.stop_reason,
        )

    # -- introspection --------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        with self._lock:
            bm = self.block_manager
            sch = self.scheduler
            return EngineStats(
                num_running=sch.num_running,
                num_waiting=sch.num_waiting,
                num_kv_blocks_total=bm.num_blocks,
                num_kv_blocks_used=bm.num_used_blocks,
                prefix_cache_queries=bm.prefix_cache_queries,
                prefix_cache_hits=bm.prefix_cache_hits,
                num_preemptions=sch.num_preemptions,
                prompt_tokens_total=self.prompt_tokens_total,
                generation_tokens_total=self.generation_tokens_total,
                spec_decode_num_drafts=self.spec_stats.num_drafts,
                spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
                spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=list(self.spec_stats.num_accepted_tokens_per_pos),
                num_steps=self.timings.num_steps,
                step_schedule_s=self.timings.schedule_s,
                step_prepare_s=self.timings.prepare_s,
                step_execute_s=self.timings.execute_s,
                step_postprocess_s=self.timings.postprocess_s,
                step_device_s=self.timings.device_s,
            )

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics, vLLM-shaped (`tilellm.engine.metrics`)."""
        return engine_metrics(self.get_stats())

    @property
    def last_step(self) -> StepSnapshot | None:
        """The last step's batch (built on first access after each step)."""
        if self._last_step is None and self._last_step_data is not None:
            sched, inputs = self._last_step_data
            seq_lens = [s + q for s, q in zip(sched.starts, sched.num_new_tokens)]
            bs = self.block_manager.block_size
            table = inputs.block_table.tolist()
            self._last_step = StepSnapshot(
                request_ids=[s.request.request_id for s in sched.seqs],
                query_lens=list(sched.num_new_tokens),
                seq_lens=seq_lens,
                num_cached_tokens=[s.num_cached_tokens for s in sched.seqs],
                block_tables=[row[: -(-n // bs)] for row, n in zip(table, seq_lens)],
                block_size=bs,
                kind=inputs.kind.value,
                num_drafts=list(sched.num_drafts),
            )
        return self._last_step


def _stream_due(req: Request, interval: int) -> bool:
    """Whether a streamed request's next output is due: a sequence holds `interval` tokens not
    yet handed out, its first token, or its last (a sample of n that finished before the rest)."""
    for s in req.seqs:
        unsent = len(s.token_ids) - s.num_pending - s.num_prompt_tokens - s.num_emitted_tokens
        if unsent > 0 and (unsent >= interval or s.num_emitted_tokens == 0 or s.finish_reason is not None):
            return True
    return False
