"""One engine loop in a background thread, feeding per-request asyncio queues.

Threads and who owns what:
  - The engine thread is the only caller of `LLMEngine` after `start()`. It sleeps on a condition
    while there is nothing to do; otherwise it applies queued commands (adds, aborts), runs one
    `step()`, turns the outputs into per-request deltas and hands them to the event loop with a
    single `loop.call_soon_threadsafe` per step. It never waits for a client.
  - The event loop (HTTP side) only appends commands to the inbox under a short lock and reads the
    stats snapshot the engine thread publishes after every step; it never calls the engine.

A request's updates go to the `asyncio.Queue` its HTTP handler passed in, tagged with the index
the handler chose (one HTTP request may hold several engine requests: a list of prompts). The
queue is unbounded: a slow client's updates pile up as small deltas and the handler coalesces
them when it catches up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tilellm.server")


class QueueFullError(Exception):
    """The waiting queue already holds `max_waiting` requests."""


@dataclass
class SeqDelta:
    """What one output sequence (index `index` of `n`) produced since the last update."""

    index: int
    text: str  # new text (a trailing incomplete UTF-8 character is held back until it completes)
    token_ids: list[int]  # new token ids
    logprobs: list[Any] | None  # the engine's logprob entries for the new tokens, if asked for
    finish_reason: str | None = None  # set once, on the sequence's last delta
    stop_reason: int | str | None = None
    final_text: str | None = None  # the engine's whole text, on the last delta


@dataclass
class RequestUpdate:
    tag: int  # the index the handler gave this engine request
    deltas: list[SeqDelta]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # the engine failed this request; the message is safe to show
    status: int = 500  # the HTTP status of `error`
    code: str | None = "engine_error"  # the OpenAI error code of `error`


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # tilellm.SamplingParams


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one live request."""

    queue: asyncio.Queue
    tag: int
    arrival: float
    sent_text: dict[int, int] = field(default_factory=dict)  # index -> characters already sent
    sent_tokens: dict[int, int] = field(default_factory=dict)  # index -> tokens already sent
    done: set[int] = field(default_factory=set)  # indices whose finish was sent
    first_token_time: float | None = None


@dataclass
class _AddBatch:
    requests: list[tuple[EngineRequest, int]]  # (request, tag)
    queue: asyncio.Queue
    accepted: asyncio.Future
    arrival: float


@dataclass
class _Call:
    fn: Callable[[Any], Any]  # run as fn(engine) on the engine thread
    future: asyncio.Future


@dataclass
class StatsSnapshot:
    """The engine's stats plus the server's own counts; published by the engine thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class AsyncEngine:
    """Runs `engine` (an `LLMEngine`) in a background thread for an asyncio server.

    `observer` (optional) receives `on_first_token(ttft)`, `on_finished(e2e, tpot, finish_reason)`
    and `on_aborted()` from the engine thread, for metrics.

    The engine becomes this object's: it is switched to delta outputs (`output_deltas`), so it
    should not also be used for offline `generate`-style calls.
    """

    def __init__(self, engine: Any, *, max_waiting: int = 1024, observer: Any = None):
        self.engine = engine
        if hasattr(engine, "output_deltas"):  # an LLMEngine: outputs carry only what is new
            engine.output_deltas = True
        self.max_waiting = max_waiting
        self.observer = observer
        self._cv = threading.Condition()
        self._inbox: list[_AddBatch | _Call | list[str]] = []  # guarded by _cv; list[str]: ids to abort
        self._pending_adds = 0  # requests in the inbox, not yet handed to the engine (guarded by _cv)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self.stats = StatsSnapshot()
        self.error: str | None = None  # set if the loop itself died (health check fails)

    # ---- lifecycle (event loop side) ----

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="tilellm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and join the engine thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ---- requests (event loop side) ----

    async def add_requests(
        self, requests: list[EngineRequest], queue: Any, tags: list[int] | None = None
    ) -> None:
        """Queue `requests` (tags 0..k-1 unless given) for the engine; returns once the engine
        accepted all of them. `queue` is anything with `put_nowait(RequestUpdate)`.

        Raises `QueueFullError` when the waiting queue has no room for them, `ValueError` (the
        engine's message) when the engine rejects one; then none of them runs.
        """
        loop = asyncio.get_running_loop()
        tags = list(range(len(requests))) if tags is None else tags
        batch = _AddBatch(list(zip(requests, tags)), queue, loop.create_future(), time.monotonic())
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if self._pending_adds + self.stats.num_waiting + len(requests) > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            self._pending_adds += len(requests)
            self._inbox.append(batch)
            self._cv.notify()
        try:
            await batch.accepted
        except asyncio.CancelledError:
            self.abort([r.request_id for r in requests])
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (unknown or finished ids are ignored). Never blocks on the engine."""
        if not request_ids:
            return
        with self._cv:
            self._inbox.append(list(request_ids))
            self._cv.notify()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps (e.g. to inspect its state)."""
        fut = asyncio.get_running_loop().create_future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._inbox.append(_Call(fn, fut))
            self._cv.notify()
        return await fut

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while (
                        not self._inbox and not self._stopping and not self.engine.has_unfinished_requests()
                    ):
                        self._cv.wait()
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                self._apply(commands)
                if stopping:
                    self._abort_all("the server is shutting down")
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # the loop must not die silently: health turns red
            self.error = f"engine loop died: {type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
            self._fail_all("the engine stopped unexpectedly")

    def _apply(self, commands: list[_AddBatch | _Call | list[str]]) -> None:
        for cmd in commands:
            if isinstance(cmd, _AddBatch):
                self._add_batch(cmd)
            elif isinstance(cmd, _Call):
                try:
                    value, error = cmd.fn(self.engine), None
                except Exception as exc:
                    value, error = None, exc
                self._call_in_loop(_resolve, cmd.future, error, value)
            else:
                for rid in cmd:
                    if self._tracked.pop(rid, None) is not None:
                        self.engine.abort_request(rid)
                        if self.observer is not None:
                            self.observer.on_aborted()
        self._publish_stats()

    def _add_batch(self, batch: _AddBatch) -> None:
        added: list[str] = []
        error: BaseException | None = None
        for req, tag in batch.requests:
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
            except Exception as exc:  # ValueError from validation; anything else is reported too
                error = exc
                break
            added.append(req.request_id)
            self._tracked[req.request_id] = _Tracked(batch.queue, tag, batch.arrival)
        if error is not None:
            for rid in added:
                self._tracked.pop(rid, None)
                self.engine.abort_request(rid)
        with self._cv:
            self._pending_adds -= len(batch.requests)
        self._publish_stats()  # before accepting, so a 429 check right after sees them waiting
        self._call_in_loop(_resolve, batch.accepted, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all("the engine failed while running this request")
            self._publish_stats()
            return
        now = time.monotonic()
        routed: list[tuple[asyncio.Queue, RequestUpdate]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            update = self._make_update(tracked, out, now)
            if update.finished:
                del self._tracked[out.request_id]
            routed.append((tracked.queue, update))
        self._publish_stats()
        if routed:
            self._call_in_loop(_deliver, routed)

    def _make_update(self, tracked: _Tracked, out: Any, now: float) -> RequestUpdate:
        deltas = []
        max_tokens = 0
        # An engine with `output_deltas` hands out only what is new (and holds back incomplete
        # characters itself); otherwise outputs are cumulative and the new part is cut here.
        engine_deltas = bool(getattr(self.engine, "output_deltas", False))
        for comp in out.outputs:
            idx = comp.index
            if idx in tracked.done:
                continue
            n_sent = tracked.sent_tokens.get(idx, 0)
            finished = comp.finish_reason is not None or out.finished
            if engine_deltas:
                token_ids, new_text, text = comp.token_ids, comp.text, None
                logprobs = comp.logprobs
                max_tokens = max(max_tokens, n_sent + len(token_ids))
            else:
                token_ids = list(comp.token_ids[n_sent:])
                max_tokens = max(max_tokens, len(comp.token_ids))
                text = comp.text
                # Hold back a trailing replacement character: the next token may complete the UTF-8 sequence.
                visible = len(text) if finished else len(text.rstrip("\ufffd"))
                t_sent = tracked.sent_text.get(idx, 0)
                new_text = text[t_sent:visible] if visible > t_sent else ""
                tracked.sent_text[idx] = max(t_sent, visible)
                logprobs = None
                if comp.logprobs is not None:
                    logprobs = list(comp.logprobs[n_sent : n_sent + len(token_ids)])
            if not token_ids and not new_text and not finished:
                continue
            tracked.sent_tokens[idx] = n_sent + len(token_ids)
            delta = SeqDelta(idx, new_text, token_ids, logprobs)
            if finished:
                tracked.done.add(idx)
                delta.finish_reason = comp.finish_reason or "abort"
                delta.stop_reason = comp.stop_reason
                delta.final_text = text  # None with engine deltas: the handler joins the deltas
            deltas.append(delta)
        if tracked.first_token_time is None and max_tokens > 0:
            tracked.first_token_time = now
            if self.observer is not None:
                self.observer.on_first_token(now - tracked.arrival)
        if out.finished and self.observer is not None:
            first = tracked.first_token_time if tracked.first_token_time is not None else now
            tpot = (now - first) / (max_tokens - 1) if max_tokens > 1 else None
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.observer.on_finished(now - tracked.arrival, tpot, reason or "abort", max_tokens)
        return RequestUpdate(
            tracked.tag, deltas, bool(out.finished), getattr(out, "num_cached_tokens", 0) or 0
        )

    def _fail_all(self, message: str) -> None:
        routed = []
        for rid, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            if self.observer is not None:
                self.observer.on_aborted()
            routed.append((tracked.queue, RequestUpdate(tracked.tag, [], True, error=message)))
        self._tracked.clear()
        if routed:
            self._call_in_loop(_deliver, routed)

    def _abort_all(self, message: str) -> None:
        with self._cv:
            commands, self._inbox = self._inbox, []
        for cmd in commands:  # adds and calls that arrived after the stop request are refused
            if isinstance(cmd, _AddBatch):
                with self._cv:
                    self._pending_adds -= len(cmd.requests)
                self._call_in_loop(_resolve, cmd.accepted, RuntimeError(message))
            elif isinstance(cmd, _Call):
                self._call_in_loop(_resolve, cmd.future, RuntimeError(message))
        self._fail_all(message)
        self._publish_stats()

    def _publish_stats(self) -> None:
        s = self.engine.get_stats()
        self.stats = StatsSnapshot(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_kv_blocks_total=s.num_kv_blocks_total,
            num_kv_blocks_used=s.num_kv_blocks_used,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
        )

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _resolve(fut: asyncio.Future, error: BaseException | None, value: Any = None) -> None:
    if fut.done():  # the handler gave up (client gone); its requests were aborted
        return
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)


def _deliver(routed: list[tuple[asyncio.Queue, RequestUpdate]]) -> None:
    for queue, update in routed:
        queue.put_nowait(update)
