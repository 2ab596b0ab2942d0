"""Pinned host staging: a step's host arrays packed into one buffer, moved by one H2D copy."""

from __future__ import annotations

import math

import numpy as np
import torch


class PinnedStaging:
    """Packs a step's host arrays into one pinned buffer and moves them with a single H2D copy.

    NOTE: the runner alternates two of these. Step N+2 rewrites step N's pinned buffer only after
    the engine has waited for step N's sampled tokens, which the device produces after step N's
    copy has completed; device buffers are reused in stream order.
    """

    _ALIGN = 64

    def __init__(self, device: torch.device, nbytes: int = 1 << 20):
        self.device = device
        self._alloc(nbytes)
        self._items: list[tuple[int, int, np.dtype, tuple[int, ...]]] = []
        self._offset = 0

    def _alloc(self, nbytes: int) -> None:
        nbytes = -(-nbytes // self._ALIGN) * self._ALIGN  # (whole elements of every dtype)
        # (pinned for a CUDA device, so the copy is asynchronous; plain memory elsewhere)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        # the device buffer viewed as each dtype, made once: a step's arrays are slices of these
        # (items are _ALIGN-aligned, so every offset is a whole number of elements)
        self._dev_views = {np_dtype: self.dev.view(t) for np_dtype, t in _TORCH_DTYPES.items()}

    def add(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        index, view = self.reserve(a.shape, a.dtype)
        view[...] = a
        return index

    def reserve(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, np.ndarray]:
        """Room for an array, written in place through the returned view before the next `add`."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        off = -(-self._offset // self._ALIGN) * self._ALIGN
        end = off + nbytes
        if end > self.host_np.nbytes:
            old, used = self.host_np, self._offset
            self._alloc(max(2 * self.host_np.nbytes, end + (1 << 20)))
            self.host_np[:used] = old[:used]
        self._items.append((off, nbytes, dtype, tuple(shape)))
        self._offset = end
        return len(self._items) - 1, self.host_np[off:end].view(dtype).reshape(shape)

    def discard(self) -> None:
        """Forget what was added since the last commit."""
        self._items, self._offset = [], 0

    def commit(self) -> list[torch.Tensor]:
        """Copy everything added since the last commit; returns the device views, in order."""
        self.dev[: self._offset].copy_(self.host[: self._offset], non_blocking=True)
        out = []
        for off, n, dtype, shape in self._items:
            size = dtype.itemsize
            t = self._dev_views[dtype][off // size : (off + n) // size]
            out.append(t if len(shape) == 1 else t.view(shape))
        self.discard()
        return out


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}
