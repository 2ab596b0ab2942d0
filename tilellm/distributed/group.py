"""The tensor-parallel process group as one rank sees it.

Two torch.distributed groups over the same ranks:
  - the default group (NCCL on CUDA, gloo on CPU) carries the model's collectives (the layers of
    `tilellm.models.layers.linear` use it) and each step's payload, device to device;
  - a gloo group carries each step's header and the start-up agreements (KV pool size, graphs),
    on the host: a worker learns the payload's size without a device sync, and a rank that dies
    makes the others' next gloo call fail at once ("connection closed") instead of hanging.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

# The control message rank 0 sends before every step: CONTROL_WORDS int64, word 0 the op. A
# step's header (`tilellm.worker.step_inputs`) fills the rest; a stop order is the op alone.
CONTROL_WORDS = 64
OP = 0
OP_STEP, OP_STOP = 1, 2

# Workers wait for the next header as long as the engine is idle (a server may idle for days);
# they exit with the driver through the parent watch in `tilellm.worker.tp_worker`, not through a timeout.
_IDLE_TIMEOUT = datetime.timedelta(days=365)
STORE_TIMEOUT = datetime.timedelta(minutes=5)  # rendezvous of the ranks at start-up


class TPGroup:
    """This rank's handle on the group: `rank` of `world_size`, its device, the collectives the
    runner needs besides the model's own."""

    def __init__(self, rank: int, world_size: int, device: torch.device, control: dist.ProcessGroup | None):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.control = control  # the gloo group; None until joined
        self._header = torch.zeros(CONTROL_WORDS, dtype=torch.int64)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (every rank calls it at the same point)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def send_header(self, header: np.ndarray) -> None:
        """Rank 0: the next step's header (or the stop order) to every rank (at most CONTROL_WORDS)."""
        if header.shape[0] > CONTROL_WORDS:
            raise ValueError(f"a control message holds at most {CONTROL_WORDS} words, got {header.shape[0]}")
        self._header.zero_()
        self._header[: header.shape[0]].copy_(torch.from_numpy(header))
        dist.broadcast(self._header, src=0, group=self.control)

    def recv_header(self) -> np.ndarray:
        """Other ranks: block until rank 0 sends the next header."""
        dist.broadcast(self._header, src=0, group=self.control)
        return self._header.numpy().copy()

    def broadcast_payload(self, payload: torch.Tensor) -> None:
        """Rank 0 sends `payload` (on its device), the others receive into theirs (same length)."""
        dist.broadcast(payload, src=0)


def stop_message() -> np.ndarray:
    """The control message that stops the workers."""
    message = np.zeros(CONTROL_WORDS, dtype=np.int64)
    message[OP] = OP_STOP
    return message


def join_group(rank: int, world_size: int, store: dist.Store, device: torch.device) -> dist.ProcessGroup:
    """Join the group (every rank calls this): NCCL on CUDA (one GPU per rank), gloo on CPU.
    Returns the gloo group of the headers."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


def destroy_group(broken: bool = False) -> None:
    """Leave the group. `broken`: a rank died or stopped mid-step, so pending NCCL work will never
    finish; abort the communicators instead of waiting for them."""
    if not dist.is_initialized():
        return
    if broken and dist.get_backend() == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
            return
    dist.destroy_process_group()
