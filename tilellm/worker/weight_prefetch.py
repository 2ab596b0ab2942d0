"""Linear layers' weights asked for in L2 a few layers ahead, on a side stream, in small steps.

In a decode step of a few tokens every linear layer is bound by reading its weight, and started
cold it reads slower than the copy rate (see `tilellm.kernels.prefetch`). `WeightPrefetcher`
knows the order in which a forward calls the model's linear layers (recorded on the first forward
it watches) and, while a step of at most `max_tokens` tokens runs, asks for the weight of the
layer `distance` places ahead each time a layer is called: the prefetch kernel runs on a side
stream that waits for the main stream to reach that layer, so the next weights stream into L2
while this layer, its attention or norms run, and cost no time on the main stream. The side
stream joins the main one when the forward ends (a CUDA graph's capture requires it; the
prefetches write nothing, so nothing waits on them before that).

The hooks are installed only inside `watching(num_tokens)`: outside it a layer's call is
untouched. The runner wraps the forwards of its decode steps (those its CUDA graphs capture, and
their eager warm-up) in it; `TILELLM_WEIGHT_PREFETCH=N` turns it on with distance N (0, the
default: off).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tilellm.kernels.prefetch import prefetch_l2, prefetch_supported

# Steps of at most this many tokens prefetch: beyond, a GEMM reuses its weight across many rows
# and reads it at the copy rate anyway.
DEFAULT_MAX_TOKENS = 64
# Tensors larger than this are not prefetched (an LM head of 150k tokens is 300 MB: it would only
# evict what the next layers need from a 50 MB L2).
MAX_PREFETCH_BYTES = 32 << 20


def prefetch_distance() -> int:
    """`TILELLM_WEIGHT_PREFETCH`: how many linear layers ahead a small step asks for weights
    (0: off, the default)."""
    raw = os.environ.get("TILELLM_WEIGHT_PREFETCH", "0")
    try:
        distance = int(raw)
    except ValueError:
        distance = -1
    if distance < 0:
        raise ValueError(f"TILELLM_WEIGHT_PREFETCH={raw!r}: give a distance in layers, 0 (off) or more")
    return distance


class WeightPrefetcher:
    """Prefetches `layer_types`' weights `distance` calls ahead during watched forwards.

    `issue(tensors)` launches the prefetches on the current stream (`prefetch_l2` on each by
    default; a test passes its own to see what would be asked for and when).
    """

    def __init__(
        self,
        model: nn.Module,
        layer_types: tuple[type[nn.Module], ...],
        distance: int,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        issue: Callable[[list[torch.Tensor]], None] | None = None,
    ):
        if distance < 1:
            raise ValueError(f"distance must be >= 1, got {distance}")
        self.model, self.layer_types = model, layer_types
        self.distance, self.max_tokens = distance, max_tokens
        self._issue = issue or _prefetch_all
        self.order: list[nn.Module] | None = None  # the layers in call order, once recorded
        self._position: dict[int, int] = {}  # id(layer) -> its place in `order`
        self._side: torch.cuda.Stream | None = None

    def weights_of(self, layer: nn.Module) -> list[torch.Tensor]:
        """The tensors of `layer` a prefetch asks for: its own parameters and buffers of at most
        MAX_PREFETCH_BYTES (the weight, an FP8 layer's scales, a bias)."""
        tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
        return [t for t in tensors if 0 < t.numel() * t.element_size() <= MAX_PREFETCH_BYTES]

    @contextlib.contextmanager
    def watching(self, num_tokens: int) -> Iterator[None]:
        """Prefetch during the forward run inside, if it has at most `max_tokens` tokens. The first
        watched forward records the layers' call order and prefetches nothing."""
        layers = [m for m in self.model.modules() if isinstance(m, self.layer_types)]
        if num_tokens > self.max_tokens or not layers:
            yield
            return
        recording = self.order is None
        calls: list[nn.Module] = []
        hook = self._record(calls) if recording else self._prefetch_ahead()
        handles = [layer.register_forward_pre_hook(hook) for layer in layers]
        main = torch.cuda.current_stream() if self._on_cuda() else None
        try:
            if not recording and main is not None:
                self._side_stream().wait_stream(main)
            yield
        finally:
            for handle in handles:
                handle.remove()
            if recording:
                self._set_order(calls)
            elif main is not None:
                main.wait_stream(self._side_stream())

    # -- hooks ----------------------------------------------------------------------------------

    def _record(self, calls: list[nn.Module]) -> Callable:
        def hook(layer: nn.Module, args: tuple) -> None:
            calls.append(layer)

        return hook

    def _set_order(self, calls: list[nn.Module]) -> None:
        seen: set[int] = set()
        self.order = [m for m in calls if not (id(m) in seen or seen.add(id(m)))]
        self._position = {id(m): i for i, m in enumerate(self.order)}

    def _prefetch_ahead(self) -> Callable:
        """The hook: at layer i, ask for layer i + distance (at the first layer, for layers
        0 .. distance: nothing asked for them before)."""
        order, position, distance = self.order or [], self._position, self.distance

        def hook(layer: nn.Module, args: tuple) -> None:
            i = position.get(id(layer))
            if i is None:
                return
            ahead = range(i, distance + 1) if i == 0 else range(i + distance, i + distance + 1)
            tensors = [t for j in ahead if j < len(order) for t in self.weights_of(order[j])]
            if not tensors:
                return
            if self._on_cuda():
                side, main = self._side_stream(), torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    self._issue(tensors)
            else:
                self._issue(tensors)

        return hook

    def _on_cuda(self) -> bool:
        param = next(self.model.parameters(), None)
        return param is not None and param.device.type == "cuda"

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(next(self.model.parameters()).device)
        return self._side


def _prefetch_all(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if t.is_contiguous():
            prefetch_l2(t)


def weight_prefetcher_for(
    model: nn.Module, layer_types: tuple[type[nn.Module], ...]
) -> WeightPrefetcher | None:
    """The runner's prefetcher: None unless `TILELLM_WEIGHT_PREFETCH` asks for one and the model's
    device can prefetch (`prefetch_supported`)."""
    distance = prefetch_distance()
    param = next(model.parameters(), None)
    if distance == 0 or param is None or not prefetch_supported(param.device):
        return None
    return WeightPrefetcher(model, layer_types, distance)
