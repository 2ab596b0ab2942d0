"""The engine in its own process, so that the HTTP side and the engine do not share one GIL.

Why: at 20k+ output tokens/s the engine thread needs most of a step's time in Python (scheduling,
input preparation, stop checks, one output per request per step), and the event loop needs ~20 us
of Python for every streamed chunk: in one process they take turns on the GIL, the engine thread
falls behind the GPU, and the server delivered half of what the same engine does offline
(measured on an H200 with E1). In its own process the engine keeps a whole GIL.

    engine = EngineProcess("path/to/model", {"max_num_seqs": 256, ...})   # returns once built
    app = create_app(engine, config)                                      # as with an LLMEngine

The engine process runs the same `EngineLoop` as the in-process `AsyncEngine`, and this side is
the same `EngineClient` (async_engine.py); only the transport differs: one multiprocessing pipe
each way. Commands are pickled on the event loop (an error shows at once) and written by a sender
thread, so a stopped engine process whose pipe is full never blocks the event loop; a reader
thread hands the engine's messages to the client.

The messages are the loop's (async_engine.py), with each update packed as a plain tuple, plus
("ready", info) | ("failed", text) once at start and ("obs", method, args) for the metrics
observer.

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
import queue
import signal
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

from tilellm.server.async_engine import EngineClient, EngineLoop, RequestUpdate, SeqDelta

logger = logging.getLogger("tilellm.server")


# -- update tuples: pickled in the engine's hot loop, so plain tuples, not dataclasses -----------


def _pack(update: RequestUpdate) -> tuple:
    deltas = [
        (d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason, d.final_text)
        for d in update.deltas
    ]
    # (positional, in RequestUpdate's field order: `_unpack` fills the fields by position)
    head = (update.tag, deltas, update.finished, update.num_cached_tokens, update.prompt_logprobs)
    if update.error is None:
        return head
    return (*head, update.error, update.status, update.code)


def _unpack(packed: tuple) -> RequestUpdate:
    tag, deltas, *rest = packed
    return RequestUpdate(tag, [SeqDelta(*d) for d in deltas], *rest)


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


class _ProcessLoop(EngineLoop):
    """The `EngineLoop` inside the engine process: what it emits goes down the pipe, and a thread
    of this process reads the server's commands into it."""

    def __init__(self, engine: Any, conn: Any):
        self._conn = conn
        self._send_lock = threading.Lock()
        self.parent_gone = False
        self.send_s = 0.0  # time in pipe sends (pickling included)
        self.loop_step_s = 0.0  # time in `_step`: the engine step, building updates, sending them
        self.loop_steps = 0
        super().__init__(engine, self._emit, observer=_PipeObserver(self._send))

    def _emit(self, message: tuple) -> None:
        kind = message[0]
        if kind == "updates":
            message = ("updates", [(qid, _pack(u)) for qid, u in message[1]], message[2])
        elif kind == "resolve":
            message = _portable(*message[1:])
        self._send(message)

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
            self.put(("stop",))

    def _step(self) -> None:
        t0 = time.perf_counter()
        super()._step()
        self.loop_step_s += time.perf_counter() - t0
        self.loop_steps += 1

    def read_commands(self) -> None:
        """Pipe -> inbox, in a thread of the engine process (the main thread runs the loop)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the server process is gone
                message = ("stop",)
            except Exception:  # one command that cannot be unpickled here: drop it, keep serving
                logger.exception("engine process: a command from the server could not be read")
                continue
            self.put(message)
            if message[0] == "stop":
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
        "default_sampling": dict(engine.default_sampling),
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
    loop = _ProcessLoop(engine, conn)
    reader = threading.Thread(target=loop.read_commands, name="tilellm-engine-commands", daemon=True)
    reader.start()
    try:
        loop.run()  # its last message is ("exit", error)
        _log_step_times(engine, loop)
    finally:
        engine.shutdown()
        # The heap frozen above goes back to the collector before the interpreter tears down:
        # frozen objects are never collected, and Triton's nanobind reports each of its types and
        # functions still alive at exit as "leaked".
        gc.unfreeze()
        conn.close()


def _exit_with_parent(parent_pid: int) -> None:
    """The engine process ignores signals, so it must notice on its own when the server process
    is gone (killed before it could stop the engine, e.g. by a SIGTERM during start-up)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:  # re-parented: the server process is gone
            os._exit(1)


def _log_step_times(engine: Any, loop: _ProcessLoop) -> None:
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


class EngineProcess(EngineClient):
    """An `LLMEngine` in a child process, with `AsyncEngine`'s interface for the HTTP side.

    Construction starts the process and returns once the engine is built (model loaded, KV pool
    sized, CUDA graphs captured), raising RuntimeError with the engine's error if that fails.
    `tokenizer`, `max_model_len` and `vocab_size` are what `create_app` needs; the tokenizer is
    loaded here too (chat templates and logprob token strings are rendered on the HTTP side).
    """

    def __init__(self, model: str, engine_kwargs: dict, *, async_scheduling: bool | None = None):
        super().__init__()
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
        self.default_sampling: dict = info.get("default_sampling", {})
        self.max_num_seqs: int = info["max_num_seqs"]
        self.tokenizer = None
        if not engine_kwargs.get("skip_tokenizer_init", False):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._pipe_broken = False
        self._reader: threading.Thread | None = None
        self._sender = threading.Thread(target=self._write, name="tilellm-engine-sender", daemon=True)
        self._sender.start()

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._proc.pid

    # ---- lifecycle ----

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self.last_heard = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="tilellm-engine-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is still in flight and wait for the engine process to exit."""
        with self._lock:
            self._stopping = True
        try:
            self._send(("stop",))
        except RuntimeError:
            pass
        self._outbox.put(None)  # the sender's end, after the stop command
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine process still running %.0f s after stop: terminating it", timeout)
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None:
            self._reader.join(5)
        self._sender.join(5)

    def _transport_alive(self) -> bool:
        return self._proc.is_alive()

    # ---- transport ----

    def _send(self, message: tuple) -> None:
        """Pickle here, write in the sender thread. RuntimeError when the message cannot go (the
        engine process is gone, or it does not pickle)."""
        if self._pipe_broken or not self._proc.is_alive():
            raise RuntimeError(self.error or "the engine process is not running")
        try:
            data = bytes(ForkingPickler.dumps(message))
        except Exception as exc:
            raise RuntimeError(f"cannot send to the engine process: {type(exc).__name__}: {exc}") from exc
        self._outbox.put(data)

    def _write(self) -> None:
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self._conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._pipe_broken = True  # the reader notices the process is gone

    def _read(self) -> None:
        """Engine messages -> the client, until the engine process exits."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._proc.join(5)
                    error = f"the engine process exited unexpectedly (status {self._proc.exitcode})"
                    logger.error(error)
                    self._engine_gone(error)
                break
            except Exception:  # one message that cannot be unpickled here: drop it, keep serving
                logger.exception("a message from the engine process could not be read")
                continue
            try:
                kind = message[0]
                if kind == "updates":
                    message = ("updates", [(qid, _unpack(u)) for qid, u in message[1]], message[2])
                if kind == "obs":
                    self.last_heard = time.monotonic()
                    if self.observer is not None:
                        getattr(self.observer, message[1])(*message[2])
                else:
                    self._receive(message)
            except Exception:  # e.g. a metrics observer that raised: the reader must live on
                logger.exception("handling a message from the engine process failed")
            if kind == "exit":
                break


def _terminate(proc: Any) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(5)
