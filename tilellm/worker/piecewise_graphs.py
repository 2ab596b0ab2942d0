"""Piecewise CUDA graphs: prefill and mixed steps replayed around eager attention.

A decode step has one shape per batch size, so `cuda_graphs.py` captures it whole. A step that
carries prompt chunks does not: its requests, chunk lengths and attention plan change from step
to step. What does not change is everything between two attention calls (linear layers, norms,
rotary, the MLP, the tensor-parallel all-reduces), which depends only on the token count. So,
as vLLM v1 does, each bucket of token counts T gets the model captured in L + 1 pieces, broken at
the L attention calls (`tilellm.attention.graph_break`):

    piece 0:  embedding, layer 0 up to its attention         (graph)
    attn 0:   store K/V, attention as this step's plan says  (eager, the real T tokens)
    piece 1:  layer 0's o_proj and MLP, layer 1 up to attn   (graph)
    ...
    piece L:  the last layer's o_proj and MLP, the final norm (graph) -> hidden [T, hidden]

A step of n <= T tokens copies its token ids and positions into the bucket's static buffers
(rows past n keep older values: the pieces compute them and nothing reads them), replays piece 0,
runs attention 0 on the first n rows of the buffers piece 0 wrote, copies its output into the
buffer piece 1 reads, and so on. The eager attention reads the installed metadata, so it runs the
step's own plan, stores into its own slots and fills only its n rows.

Memory: all pieces of all buckets share one graph memory pool (with the decode graphs). Only the
inputs of each attention call must survive from one piece to the next, and only until that call
has run, so they are kept as non-owning aliases: the allocator may hand their memory to a later
piece, which in replay order runs after the attention has read them (the same reasoning that
lets torch.compile's CUDA-graph trees alias piece outputs). One output buffer of the largest
bucket's attention output is shared by every layer and bucket, since each piece's o_proj reads
it before the next attention call writes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tilellm.attention.graph_break import breaking_graphs_at_attention
from tilellm.distributed.driver import WorkerError
from tilellm.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from tilellm.distributed import TPGroup

logger = logging.getLogger(__name__)

SMALLEST_BUCKET = 16
# Up to DOUBLING_UP_TO tokens buckets double: such steps are host-bound, and padding costs little.
# Above, the device bounds a step and the padded rows cost the linear layers real time, so
# buckets grow by LINEAR_STEP (at most 512 / T extra work: 6% at 8192 tokens).
DOUBLING_UP_TO = 2048
LINEAR_STEP = 512


def piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts that get piecewise graphs: 16, 32, ..., 2048, then every multiple of 512,
    and the step budget itself."""
    budget = max_num_batched_tokens
    sizes, t = [], SMALLEST_BUCKET
    while t < budget and t <= DOUBLING_UP_TO:
        sizes.append(t)
        t *= 2
    sizes += list(range(DOUBLING_UP_TO + LINEAR_STEP, budget, LINEAR_STEP))
    return sizes + [budget]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep that memory allocated."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())


@dataclass
class _Break:
    """One attention call between two pieces."""

    fn: Callable[..., torch.Tensor]
    inputs: list[torch.Tensor]  # [T, ...] aliases of what the piece before wrote
    out: torch.Tensor  # [T, ...] view of the shared output buffer the piece after reads


@dataclass
class _Bucket:
    graphs: list[torch.cuda.CUDAGraph]  # L + 1 pieces
    breaks: list[_Break]  # L attention calls
    hidden: torch.Tensor  # [T, hidden] alias of the last piece's output


class PiecewiseGraphs:
    """The piecewise graphs of one runner (see the module docstring).

    `forward(x, input_ids, positions)` runs the model on `x`'s metadata (the runner installs
    the attention context) and returns hidden states; `synthetic(T)` gives device `StepInputs`
    of T tokens that store nothing (capture runs attention on them once).
    """

    def __init__(
        self,
        device: torch.device,
        max_num_batched_tokens: int,
        forward: Callable[[StepInputs, torch.Tensor, torch.Tensor], torch.Tensor],
        synthetic: Callable[[int], StepInputs],
        group: TPGroup | None = None,
    ):
        self.device = device
        self.sizes = piecewise_sizes(max_num_batched_tokens)
        self.forward = forward
        self.synthetic = synthetic
        self.group = group
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.buckets: dict[int, _Bucket] = {}
        self._out = torch.empty(0, dtype=torch.uint8, device=device)  # the shared attention output

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def clear(self) -> None:
        self.buckets = {}

    def bucket(self, num_tokens: int) -> int | None:
        """The token count whose graphs replay a step of `num_tokens` tokens, or None."""
        if not self.buckets:
            return None
        return next((t for t in self.sizes if t >= num_tokens and t in self.buckets), None)

    # -- capture --------------------------------------------------------------------------------

    def capture(self, pool, sync: Callable[[], None]) -> None:
        """Capture every bucket, largest first, into `pool` (shared with the decode graphs; None:
        a new one). A failure on any rank drops every bucket on every rank (steps run eagerly)."""
        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        mode = "thread_local" if self.group is not None else "global"
        stream = torch.cuda.Stream(self.device)
        for t in reversed(self.sizes):
            ok = self._capture_one(t, pool, mode, stream, sync)
            if self.group is not None:  # every rank stops at the same bucket
                ok = bool(self.group.agree_min(int(ok)))
            if not ok:
                self.clear()
                sync()
                logger.warning("piecewise graphs dropped (capture failed at %d tokens): steps run eagerly", t)
                return
        sync()
        pieces = sum(len(b.graphs) for b in self.buckets.values())
        logger.info(
            "captured piecewise graphs for %d token counts (%d..%d, %d pieces) in %.1f s",
            len(self.buckets), self.sizes[0], self.sizes[-1], pieces, time.perf_counter() - t0,
        )  # fmt: skip

    def _capture_one(self, t: int, pool, mode: str, stream: torch.cuda.Stream, sync) -> bool:
        x = self.synthetic(t)
        ids, pos = self.input_ids[:t], self.positions[:t]
        ids.copy_(x.input_ids)
        pos.copy_(x.positions)
        graphs: list[torch.cuda.CUDAGraph] = []
        breaks: list[_Break] = []
        capturing: list[torch.cuda.CUDAGraph] = []

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode=mode)
            capturing.append(graph)

        def end() -> None:
            graph = capturing.pop()
            graph.capture_end()
            graphs.append(graph)

        def split(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            end()
            out = fn(*inputs)  # eager, on the capture stream
            static = self._out_view(out)
            static.copy_(out)
            breaks.append(_Break(fn, [_alias(a) for a in inputs], static))
            begin()
            return static

        try:
            self.forward(x, ids, pos)  # warm-up: compiles this token count's kernels
            sync()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                begin()
                try:
                    with breaking_graphs_at_attention(split):
                        hidden = self.forward(x, ids, pos)
                finally:
                    if capturing:
                        end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            sync()
        except WorkerError:
            raise
        except Exception:
            logger.exception("piecewise graph capture failed at %d tokens", t)
            return False
        self.buckets[t] = _Bucket(graphs, breaks, _alias(hidden))
        return True

    def _out_view(self, out: torch.Tensor) -> torch.Tensor:
        """`out`'s shape in the shared output buffer (grown if it is too small)."""
        nbytes = out.numel() * out.element_size()
        if self._out.numel() < nbytes:
            self._out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._out[:nbytes].view(out.dtype).view(out.shape)

    # -- replay ---------------------------------------------------------------------------------

    def replay(self, x: StepInputs) -> torch.Tensor:
        """Hidden states [n, hidden] of the step `x` (n tokens, device inputs), run in the
        bucket's pieces with attention called eagerly on the installed metadata. The result
        aliases graph memory: read it before another graph replays."""
        n = x.num_tokens
        t = self.bucket(n)
        if t is None:
            raise ValueError(f"no piecewise graph holds {n} tokens")
        b = self.buckets[t]
        self.input_ids[:n].copy_(x.input_ids)
        self.positions[:n].copy_(x.positions)
        for graph, brk in zip(b.graphs, b.breaks):
            graph.replay()
            brk.out[:n].copy_(brk.fn(*(a[:n] for a in brk.inputs)))
        b.graphs[-1].replay()
        return b.hidden[:n]
