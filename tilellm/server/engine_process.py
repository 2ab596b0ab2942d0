"""The engine in its own process, so that the HTTP side and the engine do not share one GIL.

Why: at 20k+ output tokens/s the engine thread needs most of a step's time in Python (scheduling,
input preparation, stop checks, one output per request per step), and the event loop needs ~20 us
of Python for every streamed chunk: in one process they take turns on the GIL, the engine thread
falls behind the GPU, and the server delivered half of what the same engine does offline
(benchmarks/RESULTS.md, run 10). In its own process the engine keeps a whole GIL.

    engine = EngineProcess("path/to/model", {"max_num_seqs": 256, ...})   # returns once built
    app = create_app(engine, config)                                      # as with an LLMEngine

The engine process runs the same loop as the in-process `AsyncEngine` (commands in, one step,
per-request deltas out); only the transport differs: one multiprocessing pipe each way, carrying
compact tuples instead of `call_soon_threadsafe` callbacks. This side keeps, per HTTP request, its
asyncio queue and the engine request ids that feed it; a reader thread turns the engine's
messages into queue items on the event loop.

Messages, this process -> engine: ("add", [(EngineRequest, tag)], qid, fid, arrival),
("abort", [request_id]), ("call", fn, fid), ("stop",).
Engine -> this process: ("ready", info) | ("failed", text) once at start, then ("updates",
[(qid, update tuple)], StatsSnapshot) once per step that produced updates (the step's stats ride
along), ("stats", StatsSnapshot) when stats changed without updates, ("resolve", fid, error,
value), ("obs", method, args) for the metrics observer, ("exit", error or None) last.

The engine process ignores SIGINT/SIGTERM (a Ctrl-C reaches the whole process group): the server
process decides when it stops; if the server process dies, the pipe closes and the engine stops.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import weakref
from typing import Any

from tilellm.server.async_engine import (
    AsyncEngine,
    EngineRequest,
    QueueFullError,
    RequestUpdate,
    SeqDelta,
    StatsSnapshot,
    _deliver,
    _resolve,
)

logger = logging.getLogger("tilellm.server")


# -- update tuples: pickled in the engine's hot loop, so plain tuples, not dataclasses -----------


def _pack(update: RequestUpdate) -> tuple:
    deltas = [
        (d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason, d.final_text)
        for d in update.deltas
    ]
    return (update.tag, deltas, update.finished, update.num_cached_tokens, update.error)


def _unpack(packed: tuple) -> RequestUpdate:
    tag, deltas, finished, num_cached, error = packed
    return RequestUpdate(tag, [SeqDelta(*d) for d in deltas], finished, num_cached, error)


def _portable(fid: int, error: BaseException | None, value: Any) -> tuple:
    """A ("resolve", ...) message the server process can surely unpickle: an error or value
    that does not survive the round trip becomes a RuntimeError with its text."""
    message = ("resolve", fid, error, value)
    try:
        pickle.loads(pickle.dumps(message))
        return message
    except Exception as exc:
        what = f"{type(error).__name__}: {error}" if error is not None else f"a {type(value).__name__} result"
        return ("resolve", fid, RuntimeError(f"{what} cannot cross to the server process ({exc})"), None)


# -- engine process ------------------------------------------------------------------------------


class _PipeObserver:
    """The metrics observer's calls, forwarded to the server process."""

    def __init__(self, send):
        self._send = send

    def on_first_token(self, ttft: float) -> None:
        self._send(("obs", "on_first_token", (ttft,)))

    def on_finished(self, e2e: float, tpot: float | None, reason: str, num_tokens: int | None = None) -> None:
        self._send(("obs", "on_finished", (e2e, tpot, reason, num_tokens)))

    def on_aborted(self) -> None:
        self._send(("obs", "on_aborted", ()))


class _EngineLoop(AsyncEngine):
    """`AsyncEngine`'s engine-thread half inside the engine process: what it would hand to the
    event loop goes down the pipe. Its `queue` handles are the server's queue ids (ints) and its
    futures are the server's future ids."""

    def __init__(self, engine: Any, conn: Any):
        self._conn = conn
        self._send_lock = threading.Lock()
        self.parent_gone = False
        self.send_s = 0.0  # time in pipe sends (pickling included)
        self.loop_step_s = 0.0  # time in `_step`: the engine step, building updates, sending them
        self.loop_steps = 0
        self._in_step = False
        self._stats_unsent = False
        super().__init__(engine, max_waiting=1 << 62, observer=_PipeObserver(self._send))

    def _send(self, message: tuple) -> None:
        if self.parent_gone:
            return
        t0 = time.perf_counter()
        try:
            with self._send_lock:
                self._conn.send(message)
            self.send_s += time.perf_counter() - t0  # a full pipe (a slow reader) blocks here
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            # The server process is gone: stop at the loop's next turn, without a traceback.
            self.parent_gone = True
            with self._cv:
                self._stopping = True
                self._cv.notify()

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._in_step = True
        try:
            super()._step()
        finally:
            self._in_step = False
        if self._stats_unsent:  # a step that produced no update still reports its stats
            self._send(("stats", self.stats))
            self._stats_unsent = False
        self.loop_step_s += time.perf_counter() - t0
        self.loop_steps += 1

    def _call_in_loop(self, fn, *args) -> None:
        if fn is _deliver:
            (routed,) = args
            # The stats of this step travel with its updates: one message per step.
            self._send(("updates", [(qid, _pack(update)) for qid, update in routed], self.stats))
            self._stats_unsent = False
        elif fn is _resolve:
            fid, error, *value = args
            self._send(_portable(fid, error, value[0] if value else None))
        else:  # pragma: no cover - AsyncEngine hands nothing else to the loop
            raise RuntimeError(f"unexpected loop callback {fn!r}")

    def _publish_stats(self) -> None:
        super()._publish_stats()
        if self._in_step:
            self._stats_unsent = True  # sent with the step's updates (or after the step)
        else:
            self._send(("stats", self.stats))

    def read_commands(self) -> None:
        """Pipe -> inbox, in a thread of the engine process (the main thread runs `_run`)."""
        from tilellm.server.async_engine import _AddBatch, _Call

        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the server process is gone
                message = ("stop",)
            except Exception:  # one command that cannot be unpickled here: drop it, keep serving
                logger.exception("engine process: a command from the server could not be read")
                continue
            kind = message[0]
            with self._cv:
                if kind == "add":
                    _, requests, qid, fid, arrival = message
                    self._pending_adds += len(requests)
                    self._inbox.append(_AddBatch(requests, qid, fid, arrival))
                elif kind == "abort":
                    self._inbox.append(list(message[1]))
                elif kind == "call":
                    self._inbox.append(_Call(message[1], message[2]))
                else:
                    self._stopping = True
                self._cv.notify()
            if kind == "stop":
                return


def _engine_main(conn: Any, model: str, engine_kwargs: dict, async_scheduling: bool | None) -> None:
    """Entry point of the engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        from tilellm.engine.llm_engine import LLMEngine

        engine = LLMEngine(model, **engine_kwargs)
        is_cuda = bool(getattr(engine.runner, "is_cuda", False))
        engine.async_scheduling = is_cuda if async_scheduling is None else async_scheduling
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    info = {
        "max_model_len": int(engine.max_model_len),
        "vocab_size": int(engine.vocab_size),
        "max_num_seqs": int(engine.config.max_num_seqs),
    }
    # Everything built so far (model modules, tokenizer, graphs) lives as long as the process:
    # out of the cyclic collector's sight, so that its full collections during serving scan only
    # the requests' objects (a CPU model of a step with a large start-up heap: 3.3 -> 2.2 ms).
    gc.collect()
    gc.freeze()
    try:
        conn.send(("ready", info))
    except (BrokenPipeError, OSError):  # the server process died while the engine was built
        engine.shutdown()
        return
    loop = _EngineLoop(engine, conn)
    loop._publish_stats()
    reader = threading.Thread(target=loop.read_commands, name="tilellm-engine-commands", daemon=True)
    reader.start()
    try:
        loop._run()
        _log_step_times(engine, loop)
        conn.send(("exit", loop.error))
    except (BrokenPipeError, OSError):  # the server process is gone
        pass
    finally:
        engine.shutdown()
        conn.close()


def _exit_with_parent(parent_pid: int) -> None:
    """The engine process ignores signals, so it must notice on its own when the server process
    is gone (killed before it could stop the engine, e.g. by a SIGTERM during start-up)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:  # re-parented: the server process is gone
            os._exit(1)


def _log_step_times(engine: Any, loop: _EngineLoop) -> None:
    """One line at exit: where the engine process's time went per step: the engine's host work,
    waiting for the device (near zero: host-bound), and the loop around it (turning outputs
    into updates and sending them; the send blocks when the server process reads too slowly)."""
    tm = getattr(engine, "timings", None)
    if tm is None or not tm.num_steps or not loop.loop_steps:
        return
    n, m = tm.num_steps, loop.loop_steps
    engine_s = tm.schedule_s + tm.prepare_s + tm.execute_s + tm.postprocess_s
    logger.warning(
        "engine process: %d steps; per step: schedule %.2f ms, prepare+launch %.2f ms, "
        "waiting for the device %.2f ms, postprocess %.2f ms; loop %.2f ms per step, of which "
        "updates and sends %.2f ms (pipe sends %.2f ms)",
        n,
        tm.schedule_s / n * 1e3,
        tm.prepare_s / n * 1e3,
        tm.execute_s / n * 1e3,
        tm.postprocess_s / n * 1e3,
        loop.loop_step_s / m * 1e3,
        (loop.loop_step_s - engine_s) / m * 1e3,
        loop.send_s / m * 1e3,
    )


# -- server process ------------------------------------------------------------------------------


class EngineProcess:
    """An `LLMEngine` in a child process, with `AsyncEngine`'s interface for the HTTP side.

    Construction starts the process and returns once the engine is built (model loaded, KV pool
    sized, CUDA graphs captured), raising RuntimeError with the engine's error if that fails.
    `tokenizer`, `max_model_len` and `vocab_size` are what `create_app` needs; the tokenizer is
    loaded here too (chat templates and logprob token strings are rendered on the HTTP side).
    """

    def __init__(self, model: str, engine_kwargs: dict, *, async_scheduling: bool | None = None):
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(child_conn, model, engine_kwargs, async_scheduling),
            name="tilellm-engine",
        )
        self._proc.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _terminate, self._proc)
        try:
            kind, info = self._conn.recv()
        except EOFError:
            kind, info = "failed", f"the engine process exited with status {self._proc.exitcode}"
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(f"the engine failed to start: {info}")
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.max_num_seqs: int = info["max_num_seqs"]
        self.tokenizer = None
        if not engine_kwargs.get("skip_tokenizer_init", False):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.max_waiting = 1024
        self.observer: Any = None
        self.stats = StatsSnapshot()
        self.error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # sends come from the event loop and from stop()
        self._pending_adds = 0
        self._next_id = 0
        self._queues: dict[int, tuple[asyncio.Queue, dict[int, str]]] = {}  # qid -> (queue, tag -> id)
        self._qid_of: dict[str, int] = {}  # engine request id -> qid
        self._futures: dict[int, tuple[asyncio.Future, int, int | None]] = {}  # fid -> (future, adds, qid)
        self._stopping = False
        self._reader: threading.Thread | None = None

    def configure(self, *, max_waiting: int, observer: Any) -> None:
        """The server's queue bound and metrics observer (`create_app` calls this)."""
        self.max_waiting = max_waiting
        self.observer = observer

    # ---- lifecycle ----

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="tilellm-engine-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is still in flight and wait for the engine process to exit."""
        with self._lock:
            self._stopping = True
        try:
            self._conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine process still running %.0f s after stop: terminating it", timeout)
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None:
            self._reader.join(5)

    @property
    def is_alive(self) -> bool:
        return self._proc.is_alive() and self.error is None

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ---- requests (event loop side) ----

    async def add_requests(
        self, requests: list[EngineRequest], queue: Any, tags: list[int] | None = None
    ) -> None:
        """As `AsyncEngine.add_requests`: QueueFullError, or the engine's ValueError; then none runs."""
        tags = list(range(len(requests))) if tags is None else tags
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopping or self.error is not None:
                raise RuntimeError("the server is shutting down" if self._stopping else self.error)
            if self._pending_adds + self.stats.num_waiting + len(requests) > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            qid, fid = self._new_id(), self._new_id()
            self._pending_adds += len(requests)
            self._queues[qid] = (queue, {tag: r.request_id for tag, r in zip(tags, requests)})
            for r in requests:
                self._qid_of[r.request_id] = qid
            self._futures[fid] = (fut, len(requests), qid)
        try:
            self._send(("add", list(zip(requests, tags)), qid, fid, _monotonic()))
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
        """Abort these requests; never raises (with the engine process gone there is nothing to abort)."""
        if not request_ids:
            return
        with self._lock:
            for rid in request_ids:
                self._forget(rid)
        try:
            self._send(("abort", list(request_ids)))
        except RuntimeError:
            pass

    async def call(self, fn) -> Any:
        """Run `fn(engine)` in the engine process between two steps; `fn` and its result must pickle."""
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            fid = self._new_id()
            self._futures[fid] = (fut, 0, None)
        try:
            self._send(("call", fn, fid))
        except RuntimeError:
            with self._lock:
                self._futures.pop(fid, None)
            raise
        return await fut

    # ---- internals ----

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _forget(self, rid: str) -> None:
        """Drop an engine request from the routing tables (caller holds the lock)."""
        qid = self._qid_of.pop(rid, None)
        if qid is None:
            return
        queue, tags = self._queues[qid]
        for tag, r in list(tags.items()):
            if r == rid:
                del tags[tag]
        if not tags:
            del self._queues[qid]

    def _send(self, message: tuple) -> None:
        """RuntimeError when the message cannot go (engine process gone, or it does not pickle)."""
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise RuntimeError("the engine process is not running") from exc
        except Exception as exc:  # pickling
            raise RuntimeError(f"cannot send to the engine process: {type(exc).__name__}: {exc}") from exc

    def _read(self) -> None:
        """Engine messages -> event loop, until the engine process exits."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._proc.join(5)
                    self.error = f"the engine process exited unexpectedly (status {self._proc.exitcode})"
                    logger.error(self.error)
                break
            except Exception:  # one message that cannot be unpickled here: drop it, keep serving
                logger.exception("a message from the engine process could not be read")
                continue
            try:
                kind = message[0]
                if kind == "updates":
                    self.stats = message[2]
                    self._route(message[1])
                elif kind == "resolve":
                    self._resolved(*message[1:])
                elif kind == "stats":
                    self.stats = message[1]
                elif kind == "obs":
                    if self.observer is not None:
                        getattr(self.observer, message[1])(*message[2])
                elif kind == "exit":
                    if message[1] is not None:
                        self.error = message[1]
                    break
            except Exception:  # e.g. a metrics observer that raised: the reader must live on
                logger.exception("handling a message from the engine process failed")
        if self.error is not None:
            self._fail_all(self.error)

    def _route(self, packed: list[tuple[int, tuple]]) -> None:
        routed = []
        updates = [(qid, _unpack(item)) for qid, item in packed]  # outside the lock the event loop takes
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
        routed = [
            (queue, RequestUpdate(tag, [], True, error=message))
            for queue, tags in queues.values()
            for tag in tags
        ]
        if routed:
            self._call_in_loop(_deliver, routed)
        for fut, _, _ in futures.values():
            self._call_in_loop(_resolve, fut, RuntimeError(message))

    def _call_in_loop(self, fn, *args) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed
            pass


def _monotonic() -> float:
    return time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC is system-wide)


def _terminate(proc: Any) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(5)
