"""The engine's loop and the server's client of it: one implementation, two transports.

Two halves, which talk only through message tuples:
  - `EngineLoop` (the engine side) is the only caller of `LLMEngine` once started. It sleeps on a
    condition while there is nothing to do; otherwise it applies queued commands (adds, aborts,
    calls), runs one `step()`, turns the outputs into per-request deltas and emits them as one
    message per step, with the step's stats.
  - `EngineClient` (the server side, on the event loop) keeps, per HTTP request, its asyncio queue
    and the engine request ids that feed it, sends commands, and turns the loop's messages into
    queue items on the event loop (one `call_soon_threadsafe` per message). It never calls the
    engine and never waits for it, except in `stop`.

Transports: `AsyncEngine` runs the loop in a thread of this process and hands messages across
by function call; `EngineProcess` (engine_process.py) runs it in its own process and pickles
them through a pipe.

Commands, client -> loop: ("add", [(EngineRequest, tag)], qid, fid, arrival), ("abort",
[request_id]), ("call", fn, fid), ("stop",). Loop -> client: ("updates", [(qid, RequestUpdate)],
StatsSnapshot) once per step that produced updates, ("stats", StatsSnapshot) otherwise, ("resolve",
fid, error, value), ("exit", error or None) last. A queue id (qid) names one HTTP request's queue,
a future id (fid) one pending add or call.

A request's updates go to the queue its HTTP handler passed in, tagged with the index the handler
chose (one HTTP request may hold several engine requests: a list of prompts). The queue is
unbounded: a slow client's updates pile up as small deltas and the handler coalesces them when it
catches up. Every message from the loop also counts as a heartbeat (`last_heard`): a loop with
work steps and emits continuously, so silence while work is pending means a stalled engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tilellm.engine.stats import EngineStats

logger = logging.getLogger("tilellm.server")

SHUTTING_DOWN = "the server is shutting down"


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
    prompt_logprobs: list[Any] | None = (
        None  # once, when the engine has them (SamplingParams.prompt_logprobs)
    )
    error: str | None = None  # the engine failed this request; the message is safe to show
    status: int = 500  # the HTTP status of `error`
    code: str | None = "engine_error"  # the OpenAI error code of `error`


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # tilellm.SamplingParams


# The engine's counts as the loop last published them: the engine's own record.
StatsSnapshot = EngineStats


# -- the engine side -----------------------------------------------------------------------------


@dataclass
class _Tracked:
    """The loop's bookkeeping of one live engine request."""

    qid: int
    tag: int
    arrival: float
    sent_text: dict[int, int] = field(default_factory=dict)  # index -> characters already sent
    sent_tokens: dict[int, int] = field(default_factory=dict)  # index -> tokens already sent
    done: set[int] = field(default_factory=set)  # indices whose finish was sent
    first_token_time: float | None = None


@dataclass
class _AddBatch:
    requests: list[tuple[EngineRequest, int]]  # (request, tag)
    qid: int
    fid: int
    arrival: float


@dataclass
class _Call:
    fn: Callable[[Any], Any]  # run as fn(engine) between two steps
    fid: int


class EngineLoop:
    """Runs `engine` (an `LLMEngine`, or a stand-in with its interface): commands in through
    `put`, messages out through `emit` (called from the loop's thread, never under its lock).

    `observer` (optional) receives `on_first_token(ttft)`, `on_finished(e2e, tpot, finish_reason,
    num_tokens)` and `on_aborted()`, for metrics. The engine becomes this loop's: it is switched
    to delta outputs (`output_deltas`), so it should not also be used for offline calls.
    """

    def __init__(self, engine: Any, emit: Callable[[tuple], None], observer: Any = None):
        self.engine = engine
        if hasattr(engine, "output_deltas"):  # an LLMEngine: outputs carry only what is new
            engine.output_deltas = True
        self.emit = emit
        self.observer = observer
        self._cv = threading.Condition()
        self._inbox: list[_AddBatch | _Call | list[str]] = []  # guarded by _cv; list[str]: ids to abort
        self._stopping = False
        self._tracked: dict[str, _Tracked] = {}  # loop thread only
        self.stats = StatsSnapshot()
        self.error: str | None = None  # set if the loop itself died
        # Time with requests to run (`EngineStats.busy_s`): closed periods, and the open one's start.
        self._busy_s = 0.0
        self._busy_since: float | None = None

    def put(self, message: tuple) -> None:
        """Queue one command (any thread)."""
        kind = message[0]
        with self._cv:
            if kind == "add":
                _, requests, qid, fid, arrival = message
                self._inbox.append(_AddBatch(requests, qid, fid, arrival))
            elif kind == "abort":
                self._inbox.append(list(message[1]))
            elif kind == "call":
                self._inbox.append(_Call(message[1], message[2]))
            else:
                self._stopping = True
            self._cv.notify()

    def run(self) -> None:
        """The loop, until a ("stop",) command; emits ("exit", error) last."""
        self._publish_stats()
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
                    self._abort_all()
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._close_busy_period()
        except BaseException as exc:  # the loop must not die silently: health turns red
            self.error = f"engine loop died: {type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
            self._fail_all("the engine stopped unexpectedly", 503, "engine_dead")
        self.emit(("exit", self.error))

    def _apply(self, commands: list[_AddBatch | _Call | list[str]]) -> None:
        for cmd in commands:
            if isinstance(cmd, _AddBatch):
                self._add_batch(cmd)
            elif isinstance(cmd, _Call):
                try:
                    value, error = cmd.fn(self.engine), None
                except Exception as exc:
                    value, error = None, exc
                self.emit(("resolve", cmd.fid, error, value))
            else:
                for rid in cmd:
                    tracked = self._tracked.pop(rid, None)
                    if tracked is not None:
                        self._first_token_before_abort(rid, tracked)
                        self.engine.abort_request(rid)
                        if self.observer is not None:
                            self.observer.on_aborted()
        if commands:
            self._publish_stats()

    def _first_token_before_abort(self, rid: str, tracked: _Tracked) -> None:
        """A request aborted after its first token but before any update (`FINAL_ONLY`: its
        first update would have been its last) still counts in the TTFT metric."""
        if tracked.first_token_time is not None or self.observer is None:
            return
        req = getattr(self.engine, "requests", {}).get(rid)
        stamped = getattr(getattr(req, "metrics", None), "first_token_time", None)
        if stamped is not None:  # the engine's clock (perf_counter) in `arrival`'s (monotonic)
            first = stamped + (time.monotonic() - time.perf_counter())
            self.observer.on_first_token(max(0.0, first - tracked.arrival))

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
            self._tracked[req.request_id] = _Tracked(batch.qid, tag, batch.arrival)
            if self._busy_since is None:
                self._busy_since = time.monotonic()
        if error is not None:
            for rid in added:
                self._tracked.pop(rid, None)
                self.engine.abort_request(rid)
        self._publish_stats()  # before accepting, so a 429 check right after sees them waiting
        self.emit(("resolve", batch.fid, error, None))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all("the engine failed while running this request")
            self._publish_stats()
            return
        now = time.monotonic()
        # The engine stamps its milestones with time.perf_counter: this turns them into `now`'s clock.
        clock_offset = now - time.perf_counter()
        routed: list[tuple[int, RequestUpdate]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            update = self._make_update(tracked, out, now, clock_offset)
            if update.finished:
                del self._tracked[out.request_id]
            routed.append((tracked.qid, update))
        self.stats = self._read_stats()
        # One message per step: its updates carry its stats (a step with none still reports them).
        self.emit(("updates", routed, self.stats) if routed else ("stats", self.stats))

    def _make_update(self, tracked: _Tracked, out: Any, now: float, clock_offset: float) -> RequestUpdate:
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
            # When the engine read the first token: a FINAL_ONLY request's first update is its last.
            stamped = getattr(getattr(out, "metrics", None), "first_token_time", None)
            first = now if stamped is None else min(now, max(tracked.arrival, stamped + clock_offset))
            tracked.first_token_time = first
            if self.observer is not None:
                self.observer.on_first_token(first - tracked.arrival)
        if out.finished and self.observer is not None:
            first = tracked.first_token_time if tracked.first_token_time is not None else now
            tpot = (now - first) / (max_tokens - 1) if max_tokens > 1 else None
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.observer.on_finished(now - tracked.arrival, tpot, reason or "abort", max_tokens)
        return RequestUpdate(
            tracked.tag,
            deltas,
            bool(out.finished),
            getattr(out, "num_cached_tokens", 0) or 0,
            getattr(out, "prompt_logprobs", None),
        )

    def _fail_all(self, message: str, status: int = 500, code: str = "engine_error") -> None:
        routed = []
        for rid, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            if self.observer is not None:
                self.observer.on_aborted()
            update = RequestUpdate(tracked.tag, [], True, error=message, status=status, code=code)
            routed.append((tracked.qid, update))
        self._tracked.clear()
        if routed:
            self.emit(("updates", routed, self.stats))

    def _abort_all(self) -> None:
        with self._cv:
            commands, self._inbox = self._inbox, []
        for cmd in commands:  # adds and calls that arrived after the stop request are refused
            if isinstance(cmd, (_AddBatch, _Call)):
                self.emit(("resolve", cmd.fid, RuntimeError(SHUTTING_DOWN), None))
        self._fail_all(SHUTTING_DOWN, 503, "shutting_down")
        self._publish_stats()

    def _close_busy_period(self) -> None:
        """Once the engine has nothing left to run, its busy period ends (`EngineStats.busy_s`)."""
        if self._busy_since is not None and not self.engine.has_unfinished_requests():
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None
            self._publish_stats()  # (the idle engine's last stats: its busy time is final)

    def _read_stats(self) -> StatsSnapshot:
        # A copy (the engine may keep updating the record it returns), with the loop's busy time.
        busy = self._busy_s
        if self._busy_since is not None:
            busy += time.monotonic() - self._busy_since
        return dataclasses.replace(self.engine.get_stats(), busy_s=busy)

    def _publish_stats(self) -> None:
        self.stats = self._read_stats()
        self.emit(("stats", self.stats))


# -- the server side -----------------------------------------------------------------------------


class EngineClient:
    """The server's side of an `EngineLoop`, whatever carries the messages: a subclass provides
    `_send(message)` (RuntimeError when it cannot go), `start`, `stop` and `_transport_alive`, and
    hands every message of the loop to `_receive` (from any thread but the event loop's)."""

    def __init__(self, *, max_waiting: int = 1024, observer: Any = None):
        self.max_waiting = max_waiting
        self.observer = observer
        self.stats = StatsSnapshot()
        self.error: str | None = None  # why the engine is gone (health check fails)
        self.last_heard = time.monotonic()  # when the loop's last message arrived
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._next_id = 0
        self._queues: dict[int, tuple[Any, dict[int, str]]] = {}  # qid -> (queue, tag -> request id)
        self._qid_of: dict[str, int] = {}  # engine request id -> qid
        self._futures: dict[int, tuple[asyncio.Future, int, int | None]] = {}  # fid -> (future, adds, qid)
        self._stopping = False

    def configure(self, *, max_waiting: int, observer: Any) -> None:
        """The server's queue bound and metrics observer (`create_app` calls this)."""
        self.max_waiting = max_waiting
        self.observer = observer

    @property
    def is_alive(self) -> bool:
        return self._transport_alive() and self.error is None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _transport_alive(self) -> bool:
        raise NotImplementedError

    def _send(self, message: tuple) -> None:
        raise NotImplementedError

    # ---- requests (event loop side) ----

    async def add_requests(
        self, requests: list[EngineRequest], queue: Any, tags: list[int] | None = None
    ) -> None:
        """Queue `requests` (tags 0..k-1 unless given) for the engine; returns once the engine
        accepted all of them. `queue` is anything with `put_nowait(RequestUpdate)`.

        Raises `QueueFullError` when the waiting queue has no room for them, `ValueError` (the
        engine's message) when the engine rejects one, RuntimeError when the engine is gone or
        stopping; then none of them runs.
        """
        tags = list(range(len(requests))) if tags is None else tags
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopping or self.error is not None:
                raise RuntimeError(SHUTTING_DOWN if self._stopping else self.error)
            if self._pending_adds + self.stats.num_waiting + len(requests) > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            qid, fid = self._new_id(), self._new_id()
            self._pending_adds += len(requests)
            self._queues[qid] = (queue, {tag: r.request_id for tag, r in zip(tags, requests)})
            for r in requests:
                self._qid_of[r.request_id] = qid
            self._futures[fid] = (fut, len(requests), qid)
        try:
            self._send(("add", list(zip(requests, tags)), qid, fid, time.monotonic()))
        except RuntimeError:
            with self._lock:  # never reached the engine: undo the bookkeeping
                self._futures.pop(fid, None)
                self._pending_adds -= len(requests)
                for r in requests:
                    self._forget(r.request_id)
            raise
        try:
            await fut
        except asyncio.CancelledError:
            self.abort([r.request_id for r in requests])
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests (unknown or finished ids are ignored); never blocks on the engine
        and never raises (with the engine gone there is nothing to abort)."""
        if not request_ids:
            return
        with self._lock:
            for rid in request_ids:
                self._forget(rid)
        try:
            self._send(("abort", list(request_ids)))
        except RuntimeError:
            pass

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` between two steps (e.g. to inspect its state)."""
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopping:
                raise RuntimeError(SHUTTING_DOWN)
            fid = self._new_id()
            self._futures[fid] = (fut, 0, None)
        try:
            self._send(("call", fn, fid))
        except RuntimeError:
            with self._lock:
                self._futures.pop(fid, None)
            raise
        return await fut

    # ---- the loop's messages (transport thread) ----

    def _receive(self, message: tuple) -> None:
        self.last_heard = time.monotonic()
        kind = message[0]
        if kind == "updates":
            self.stats = message[2]
            self._route(message[1])
        elif kind == "stats":
            self.stats = message[1]
        elif kind == "resolve":
            self._resolved(*message[1:])
        elif kind == "exit" and message[1] is not None:
            self._engine_gone(message[1])

    def _engine_gone(self, error: str) -> None:
        """The engine died: every request in flight gets a 503 `engine_dead`."""
        self.error = error
        self._fail_all(error)

    def _route(self, updates: list[tuple[int, RequestUpdate]]) -> None:
        routed = []
        with self._lock:
            for qid, update in updates:
                entry = self._queues.get(qid)
                if entry is None:  # aborted here meanwhile
                    continue
                if update.finished:
                    rid = entry[1].get(update.tag)
                    if rid is not None:
                        self._forget(rid)
                routed.append((entry[0], update))
        if routed:
            self._call_in_loop(_deliver, routed)

    def _resolved(self, fid: int, error: BaseException | None, value: Any) -> None:
        with self._lock:
            fut, adds, qid = self._futures.pop(fid, (None, 0, None))
            self._pending_adds -= adds
            if error is not None and qid is not None:  # rejected: none of its requests runs
                for rid in list(self._queues.get(qid, (None, {}))[1].values()):
                    self._forget(rid)
        if fut is not None:
            self._call_in_loop(_resolve, fut, error, value)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            queues, self._queues, self._qid_of = self._queues, {}, {}
            futures, self._futures = self._futures, {}
            self._pending_adds = 0
        routed = [
            (queue, RequestUpdate(tag, [], True, error=message, status=503, code="engine_dead"))
            for queue, tags in queues.values()
            for tag in tags
        ]
        if routed:
            self._call_in_loop(_deliver, routed)
        for fut, _, _ in futures.values():
            self._call_in_loop(_resolve, fut, RuntimeError(message))

    # ---- internals ----

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _forget(self, rid: str) -> None:
        """Drop an engine request from the routing tables (caller holds the lock)."""
        qid = self._qid_of.pop(rid, None)
        if qid is None:
            return
        _, tags = self._queues[qid]
        for tag, r in list(tags.items()):
            if r == rid:
                del tags[tag]
        if not tags:
            del self._queues[qid]

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class AsyncEngine(EngineClient):
    """`engine` (an `LLMEngine`) run by an `EngineLoop` in a background thread of this process;
    messages cross by function call. `observer` is called from the engine thread."""

    def __init__(self, engine: Any, *, max_waiting: int = 1024, observer: Any = None):
        super().__init__(max_waiting=max_waiting, observer=observer)
        self.engine = engine
        self._engine_loop = EngineLoop(engine, self._receive, _Observer(self))
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._engine_loop.run, name="tilellm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and join the engine thread."""
        with self._lock:
            self._stopping = True
        self._engine_loop.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    def _transport_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _send(self, message: tuple) -> None:
        if not self._transport_alive() and self._thread is not None:
            raise RuntimeError(self.error or "the engine loop is not running")
        self._engine_loop.put(message)


class _Observer:
    """Forwards the loop's metrics calls to the client's observer of the moment (`configure`)."""

    def __init__(self, client: EngineClient):
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., None]:
        observer = self._client.observer
        return getattr(observer, name) if observer is not None else _ignore


def _ignore(*args: Any) -> None:
    pass


def _resolve(fut: asyncio.Future, error: BaseException | None, value: Any = None) -> None:
    if fut.done():  # the handler gave up (client gone); its requests were aborted
        return
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)


def _deliver(routed: list[tuple[Any, RequestUpdate]]) -> None:
    for queue, update in routed:
        queue.put_nowait(update)
