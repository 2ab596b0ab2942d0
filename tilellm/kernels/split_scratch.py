"""Split-KV scratch, per stream: the partials and arrival counters of split calls.

An eager split call takes its partials and arrival counters from its stream's workspace rather
than allocating them: calls on one stream run in order, so each finds the buffers free (and the
counters at zero: every launch that merges in the kernel leaves its counters at zero), and calls
on two streams never share them. A call captured into a CUDA graph allocates its own in the
graph's pool (counters zeroed at each replay), so that no graph shares a buffer with anything
else. TILELLM_DEBUG=1 checks the counters after every eager call that used them
(`check_counters`).
"""

from __future__ import annotations

import torch

from tilellm.kernels.config import next_power_of_2
from tilellm.kernels.launch import current_stream


class StreamWorkspace:
    """One stream's split-KV scratch: `counters` int32 arrivals per tile (zero between launches),
    `o_parts` / `lse_parts` flat float32 partials, each grown to the largest call seen (their
    sizes kept as ints: an eager split call asks for them on every launch)."""

    __slots__ = ("counters", "o_parts", "lse_parts", "counters_size", "o_size", "lse_size")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Give up every buffer (the next call allocates afresh)."""
        self.counters: torch.Tensor | None = None
        self.o_parts: torch.Tensor | None = None
        self.lse_parts: torch.Tensor | None = None
        # (-1: nothing held, so that even a request of size 0 gets a tensor)
        self.counters_size = self.o_size = self.lse_size = -1

    def parts(
        self, o_size: int, lse_size: int, counter_slots: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`split_parts` outside a capture: partials of at least these sizes (per call past
        WORKSPACE_MAX_PARTIALS) and `counter_slots` zeroed counters (None for 0)."""
        counters = self.counters_for(counter_slots, device) if counter_slots else None
        if o_size > WORKSPACE_MAX_PARTIALS:
            return _own_parts(o_size, lse_size, device) + (counters,)
        # (a buffer given up stays with the stream: the caching allocator hands it out again only
        # to work queued after the calls that used it)
        if self.o_size < o_size:
            self.o_size = next_power_of_2(o_size)
            self.o_parts = torch.empty(self.o_size, dtype=torch.float32, device=device)
        if self.lse_size < lse_size:
            self.lse_size = next_power_of_2(lse_size)
            self.lse_parts = torch.empty(self.lse_size, dtype=torch.float32, device=device)
        return self.o_parts, self.lse_parts, counters

    def counters_for(self, slots: int, device: torch.device) -> torch.Tensor:
        """The stream's counters, grown (zeroed) to at least `slots`."""
        if self.counters_size < slots:
            self.counters_size = max(SPLIT_COUNTERS_MIN, next_power_of_2(slots))
            self.counters = torch.zeros(self.counters_size, dtype=torch.int32, device=device)
        return self.counters


SPLIT_COUNTERS_MIN = 4096
# Partials past this many float32 (a prompt chunk's, 32 MiB) are allocated per call, not kept.
WORKSPACE_MAX_PARTIALS = 1 << 23
_workspaces: dict[tuple, StreamWorkspace] = {}


def stream_workspace(device: torch.device) -> StreamWorkspace:
    """The workspace of `device`'s current stream."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, current_stream(index))
    else:
        key = device.type
    workspace = _workspaces.get(key)
    if workspace is None:
        workspace = _workspaces[key] = StreamWorkspace()
    return workspace


def stream_capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a CUDA graph."""
    return device.type == "cuda" and _is_current_stream_capturing()


_is_current_stream_capturing = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


def split_parts(
    splits: int,
    T: int,
    Hq: int,
    D: int,
    device: torch.device,
    counter_slots: int = 0,
    capturing: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A split call's scratch: partials in `merge_into`'s layout from element 0, flat float32,
    o_parts [>= splits * T * Hq * D] and lse_parts [>= splits * T * Hq], and `counter_slots`
    arrival counters (None for 0): the stream's workspace outside a capture, the graph's own
    inside one (`capturing`, when the caller has asked)."""
    lse_size = splits * T * Hq
    o_size = lse_size * D
    if stream_capturing(device) if capturing is None else capturing:
        counters = torch.zeros(counter_slots, dtype=torch.int32, device=device) if counter_slots else None
        return _own_parts(o_size, lse_size, device) + (counters,)
    return stream_workspace(device).parts(o_size, lse_size, counter_slots, device)


def _own_parts(o_size: int, lse_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(o_size, dtype=torch.float32, device=device),
        torch.empty(lse_size, dtype=torch.float32, device=device),
    )


def split_counters(device: torch.device, slots: int) -> torch.Tensor:
    """At least `slots` int32 arrival counters, zero: those of `device`'s current stream, or,
    inside a CUDA-graph capture, the graph's own (allocated in its pool and zeroed at every
    replay)."""
    if stream_capturing(device):
        return torch.zeros(slots, dtype=torch.int32, device=device)
    return stream_workspace(device).counters_for(slots, device)


def reset_split_counters() -> None:
    """Set every stream's arrival counters back to zero (after a fault left one off zero)."""
    for workspace in _workspaces.values():
        if workspace.counters is not None:
            workspace.counters.zero_()


def check_counters(counters: torch.Tensor, slots: int) -> None:
    """TILELLM_DEBUG: the counters the call used are back at zero (reads the device)."""
    if stream_capturing(counters.device):
        return
    left = int(counters[:slots].count_nonzero())
    if left:
        counters[:slots].zero_()
        raise RuntimeError(
            f"split-KV merge: {left} arrival counters were left non-zero after the call (a kernel "
            "fault?); they are reset now. TILELLM_SPLIT_MERGE=separate merges in a second launch."
        )
