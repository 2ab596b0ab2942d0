"""A worker process: one tensor-parallel rank other than 0.

It joins the group, builds its `ModelRunner` (its shard of every layer and of the KV pool), then
runs whatever step rank 0 broadcasts until rank 0 says stop. It never schedules or samples.

Failure: any exception is sent to rank 0 as a traceback over the process's pipe, then the
process exits at once; rank 0 raises it (`WorkerError`). A clean stop exits with 0 without the
interpreter's teardown. The worker also exits when rank 0's
process ends, however it ends: a thread waits on the parent's sentinel.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from typing import Any

# Test-only: "RANK:POINT" makes that rank raise at POINT: "init" (after joining the group, before
# loading the model) or "step:N" (before running its N-th step).
FAIL_ENV = "TILELLM_TEST_WORKER_FAILURE"
# Diagnostics: after this many seconds, dump every thread's stack to stderr (a hung collective
# then shows where each rank waits); set by `tilellm bench throughput --dump-traceback-after`.
DUMP_ENV = "TILELLM_DUMP_TRACEBACK_AFTER"


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns once the parent process has ended
        os._exit(1)

    threading.Thread(target=watch, name="tilellm-parent-watch", daemon=True).start()


def _injected_failure(rank: int, point: str) -> None:
    if os.environ.get(FAIL_ENV) == f"{rank}:{point}":
        raise RuntimeError(f"injected failure on rank {rank} at {point} ({FAIL_ENV})")


def run_worker(
    rank: int,
    world_size: int,
    config: Any,
    device: Any,
    store_port: int,
    conn: Any,
    num_threads: int,
) -> None:
    """Process entry point (spawned by `tilellm.distributed.driver.start_tensor_parallel`)."""
    _exit_with_parent()
    if os.environ.get(DUMP_ENV):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ[DUMP_ENV]), exit=False)
    try:
        import torch
        import torch.distributed as dist

        from tilellm.distributed.group import OP, OP_STOP, STORE_TIMEOUT, TPGroup, destroy_group, join_group
        from tilellm.worker.model_runner import ModelRunner

        if device.type == "cpu":
            torch.set_num_threads(num_threads)
        conn.send(("started", rank))
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=STORE_TIMEOUT)
        group = TPGroup(rank, world_size, device, join_group(rank, world_size, store, device))
        _injected_failure(rank, "init")
        runner = ModelRunner(config, group)
        step = 0
        while True:
            header = group.recv_header()
            if header[OP] == OP_STOP:
                break
            step += 1
            _injected_failure(rank, f"step:{step}")
            runner.execute_remote(header)
        del runner
        destroy_group()
    except BaseException:
        # Also on stderr: if rank 0 is blocked in a collective with this rank, it cannot read the
        # pipe, and this is the only trace of why.
        traceback.print_exc()
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except Exception:  # the driver is gone: nobody to tell
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    conn.close()
    # A clean stop skips the interpreter's teardown: the collectives' backend and the store may
    # still hold C++ threads, and destroying a joinable one at exit aborts the process (SIGABRT,
    # exit code -6, seen now and then after a clean stop). Nothing is left to flush but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
