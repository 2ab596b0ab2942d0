"""Where a piecewise CUDA graph breaks: at every attention call.

A step that carries prompt chunks has a shape no graph can fix in advance (how many requests,
how long each chunk, which kernels the plan picks), but everything around attention (the linear
layers, norms, rotary, the MLP) depends only on the step's token count. Piecewise CUDA graphs
(as vLLM v1 runs them) capture that part per padded token count and run attention eagerly
between the pieces, planned for the real step. The model marks the boundary by running its
attention through `attention_call`:

    o = attention_call(self._attend, q, k, v)   # every positional tensor is [T, ...]

Outside a capture this is `self._attend(q, k, v)`. While `tilellm.worker.piecewise_graphs`
captures, it installs a splitter with `breaking_graphs_at_attention(split)`: the call then ends
the graph being captured, runs `fn` eagerly (recording `fn` and where its inputs live), and starts
the next graph, which reads the output from a buffer that replays refill.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

# fn, its [T, ...] inputs -> the [T, ...] output the next piece reads
Splitter = Callable[[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]], torch.Tensor]

_splitter: Splitter | None = None


def attention_call(fn: Callable[..., torch.Tensor], *token_tensors: torch.Tensor) -> torch.Tensor:
    """`fn(*token_tensors)`, or, during a piecewise capture, a break between two graph pieces.

    `fn` must read everything that changes from step to step (the attention metadata) when it
    is called, and take only tensors whose first dimension is the step's tokens: a replay calls
    it again on the first T rows of the same buffers.
    """
    splitter = _splitter
    if splitter is None:
        return fn(*token_tensors)
    return splitter(fn, token_tensors)


@contextlib.contextmanager
def breaking_graphs_at_attention(splitter: Splitter) -> Iterator[None]:
    """Route every `attention_call` to `splitter` (one capture at a time)."""
    global _splitter
    if _splitter is not None:
        raise RuntimeError("a piecewise capture is already in progress")
    _splitter = splitter
    try:
        yield
    finally:
        _splitter = None
