"""Rank 0's side: check the sizes, start one worker process per other rank, watch, stop them.

    driver = start_tensor_parallel(config, run_worker)   # workers spawned, group joined
    runner = ModelRunner(config, driver)                  # rank 0's shard; broadcasts every step
    ...
    driver.shutdown()                          # also at interpreter exit, and on any failure

Workers are daemon processes started with "spawn" (they inherit the environment, e.g.
`NCCL_*`, `CUDA_VISIBLE_DEVICES`, `TRITON_INTERPRET`). A worker that raises sends its traceback
and exits; rank 0 notices at its next collective (gloo fails at once when a peer is gone; on
CUDA `wait_event` polls the workers while it waits, in every step and in the engine's start-up
syncs) and raises `WorkerError` with that
traceback after stopping every rank. No process outlives the driver: `shutdown` joins (and if
need be kills) the workers, it runs at exit, and workers watch their parent.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_any
from typing import Any

import torch
import torch.distributed as dist

from tilellm.distributed.group import STORE_TIMEOUT, TPGroup, destroy_group, join_group, stop_message

_STOP_TIMEOUT_S = 30.0  # a worker finishing its last step and leaving the group
_REPORT_GRACE_S = 1.0  # after a failed collective: how long a live worker may take to report
_CHECK_EVERY_S = 0.05  # worker checks while waiting for a CUDA step

_live: weakref.WeakSet = weakref.WeakSet()
_atexit_registered = False


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed; the message carries its traceback."""


def _shutdown_live() -> None:
    for driver in list(_live):
        driver.shutdown()


def check_tensor_parallel(tp_size: int, hf_config: Any, device: torch.device) -> None:
    """ValueError naming the problem when the model cannot be split `tp_size` ways on `device`."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({tp_size})"
        )
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise ValueError(
            f"num_key_value_heads ({kv_heads}) is not divisible by tensor_parallel_size ({tp_size})"
        )
    if kv_heads < tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) is not a multiple of num_key_value_heads ({kv_heads}): "
            "the KV heads cannot be replicated evenly"
        )
    intermediate = getattr(hf_config, "intermediate_size", None)
    if intermediate is not None and int(intermediate) % tp_size:
        raise ValueError(
            f"intermediate_size ({intermediate}) is not divisible by tensor_parallel_size ({tp_size})"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count()
        first = device.index or 0
        if first + tp_size > count:
            where = f" from cuda:{first}" if first else ""
            raise ValueError(
                f"tensor_parallel_size ({tp_size}) is larger than the number of GPUs available{where} "
                f"({count - first if count > first else 0}); one GPU per rank is needed"
            )


def rank_devices(device: str | None, tp_size: int) -> list[torch.device]:
    """The device of each rank: GPUs first, first+1, ... on CUDA; the CPU for every rank on CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return [torch.device("cpu")] * tp_size
    first = dev.index if dev.index is not None else 0
    return [torch.device("cuda", first + r) for r in range(tp_size)]


class TPDriver(TPGroup):
    """Rank 0's group handle plus the worker processes (see the module docstring)."""

    def __init__(self, world_size: int, device: torch.device, procs: list, conns: list):
        super().__init__(0, world_size, device, None)
        self.procs = procs  # rank r is procs[r - 1]
        self.conns = conns
        self._errors: dict[int, str] = {}
        self._started: set[int] = set()
        self._closed = False
        self._reason = ""
        # Held by the runner while it sends a step: a shutdown from another thread (at exit)
        # must not put its stop order between a step's header and that step's payload.
        self.step_lock = threading.RLock()
        _live.add(self)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- watching the workers -------------------------------------------------------------------

    def _drain(self) -> None:
        """Read every message the workers have sent."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while not conn.closed and conn.poll():
                    msg = conn.recv()
                    if msg[0] == "started":
                        self._started.add(rank)
                    elif msg[0] == "error":
                        self._errors.setdefault(rank, msg[2])
            except (EOFError, OSError):  # the worker closed its end: it has exited
                conn.close()

    def _failure_message(self) -> str | None:
        if self._errors:
            rank = min(self._errors)
            others = sorted(set(self._errors) - {rank})
            also = f" (ranks {others} failed too)" if others else ""
            return f"tensor-parallel worker rank {rank} failed{also}:\n{self._errors[rank]}"
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return f"tensor-parallel worker rank {rank} exited unexpectedly (exit code {p.exitcode})"
        return None

    def _collect(self, grace: float) -> str | None:
        """Wait up to `grace` seconds for a worker to report a failure (or to die)."""
        deadline = time.monotonic() + grace
        while True:
            self._drain()
            message = self._failure_message()
            remaining = deadline - time.monotonic()
            if message is not None or remaining <= 0:
                return message
            handles = [c for c in self.conns if not c.closed] + [p.sentinel for p in self.procs]
            wait_any(handles, timeout=remaining)

    def _closed_error(self) -> RuntimeError:
        lines = [line.strip() for line in self._reason.strip().splitlines()]
        why = ""
        if lines:  # the failure's first line and, for a traceback, the exception itself
            why = f": {lines[0].rstrip(':')}" + (f" ({lines[-1]})" if len(lines) > 1 else "")
        return RuntimeError(f"the tensor-parallel workers have shut down{why}; create a new engine")

    def check_workers(self) -> None:
        """Raise (after stopping every rank) if the group was shut down or a worker failed."""
        if self._closed:
            raise self._closed_error()
        handles = [c for c in self.conns if not c.closed] + [p.sentinel for p in self.procs]
        if not wait_any(handles, timeout=0):  # one poll(2): no message, no exit (every step)
            return
        self._drain()
        message = self._failure_message()
        if message is not None:
            self._reason = message
            self.shutdown(broken=True)
            raise WorkerError(message)

    def failure(self, exc: BaseException) -> BaseException:
        """What to raise for `exc`, raised by rank 0 in the middle of a step or at start-up: a
        `WorkerError` when a worker failed (its traceback in the message), else `exc`. Every
        rank is stopped either way: the others may be stuck in a collective of that step."""
        if self._closed:
            return exc
        message = self._collect(_REPORT_GRACE_S)
        self._reason = message or f"{type(exc).__name__}: {exc}"
        self.shutdown(broken=True)
        return WorkerError(message) if message is not None else exc

    def wait_started(self) -> None:
        """Block until every worker has started (imports done), or raise if one died first."""
        while len(self._started) < len(self.procs):
            self._drain()
            message = self._failure_message()
            if message is not None:
                self.shutdown(broken=True)
                raise WorkerError(message)
            handles = [c for c in self.conns if not c.closed] + [p.sentinel for p in self.procs]
            wait_any(handles, timeout=1.0)

    def wait_event(self, event: torch.cuda.Event) -> None:
        """Block until `event` has completed, checking the workers meanwhile: NCCL would wait
        forever for a rank that died."""
        start = next_check = time.monotonic()
        while not event.query():
            now = time.monotonic()
            if now >= next_check:
                self.check_workers()
                next_check = now + _CHECK_EVERY_S
            if now - start > 1e-3:
                time.sleep(5e-5)

    # -- stopping -------------------------------------------------------------------------------

    def shutdown(self, broken: bool = False) -> None:
        """Stop every worker and leave the group (idempotent). `broken`: the group may be in the
        middle of a step, so the workers are killed instead of told to stop."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        broken = broken or self.control is None  # not joined yet: nothing to tell them
        locked = self.step_lock.acquire(timeout=0 if broken else _STOP_TIMEOUT_S)
        try:
            if not broken and locked:
                self.send_header(stop_message())
        except Exception:
            broken = True
        finally:
            if locked:
                self.step_lock.release()
        broken = broken or not locked  # a step is stuck mid-way: the workers cannot be told
        deadline = time.monotonic() + (0.0 if broken else _STOP_TIMEOUT_S)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        self._drain()
        for conn in self.conns:
            conn.close()
        destroy_group(broken)


@contextlib.contextmanager
def _spawn_without_user_main() -> Iterator[None]:
    """Keep "spawn" from re-running the user's script in the workers (it does so to rebuild
    `__main__`), so that a script without an `if __name__ == "__main__":` guard works: a worker
    needs nothing from it, its target and arguments all live in tilellm and torch."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: vars(main)[name] for name in ("__spec__", "__file__") if name in vars(main)}
    main.__spec__ = None
    vars(main).pop("__file__", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def start_tensor_parallel(config: Any, worker_main: Callable[..., None]) -> TPDriver:
    """Validate `config.tensor_parallel_size`, start the workers, join the group as rank 0.

    `worker_main(rank, world_size, config, device, store_port, conn, num_threads)` is each
    worker process's entry point (`tilellm.worker.tp_worker.run_worker`).

    ValueError when the sizes do not fit (heads, GPUs); RuntimeError when this process already
    belongs to a process group (one tensor-parallel engine per process)."""
    from tilellm.models.loader import read_model_config

    tp_size = config.tensor_parallel_size
    devices = rank_devices(config.device, tp_size)
    _, hf_config = read_model_config(config.model)
    check_tensor_parallel(tp_size, hf_config, devices[0])
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process (another tensor-parallel "
            "engine?): shut it down before starting one with tensor_parallel_size > 1"
        )
    global _atexit_registered
    if not _atexit_registered:  # registered after multiprocessing's own hook, so it runs first
        atexit.register(_shutdown_live)
        _atexit_registered = True

    store = dist.TCPStore(
        "127.0.0.1", 0, tp_size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
    )
    ctx = torch.multiprocessing.get_context("spawn")
    procs, conns = [], []
    driver = TPDriver(tp_size, devices[0], procs, conns)
    try:
        for rank in range(1, tp_size):
            reader, writer = ctx.Pipe(duplex=False)
            args = (rank, tp_size, config, devices[rank], store.port, writer, torch.get_num_threads())
            p = ctx.Process(target=worker_main, args=args, name=f"tilellm-tp-rank{rank}", daemon=True)
            with _spawn_without_user_main():
                p.start()
            writer.close()
            procs.append(p)
            conns.append(reader)
        driver.wait_started()
        driver.control = join_group(0, tp_size, store, devices[0])
    except BaseException as e:
        err = driver.failure(e)
        if err is e:
            raise
        raise err from e
    driver.store = store  # the rendezvous store lives as long as the group
    return driver
