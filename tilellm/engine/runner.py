"""The model runner: owns the model, the KV pool, the CUDA graphs and the sampler.

One call per engine step: `execute(batch, sampling)` takes the step's CPU metadata (from
`build_step_batch`) and the rows' sampling arrays, moves them to the device in one copy through
a pinned staging buffer, runs the model (a CUDA graph for decode steps, eager otherwise),
samples, and copies the sampled tokens back: the only host sync of the step.

KV pool: one K and one V cache per layer, `[num_blocks, block_size, Hkv, D]`, views into one
allocation. On CUDA its size comes from the memory left after a profiling forward at the
largest step (`max_num_batched_tokens` tokens, `max_num_seqs` sampled rows), times
`gpu_memory_utilization`; `num_kv_blocks` overrides it. On CPU the pool is at most 2 GiB.

CUDA graphs: decode steps (one new token per request) replay a graph captured at the next
bucketed batch size (1, 2, 4, 8, 16, 24, 32, ... up to `max_num_seqs`); padding rows store
nothing (slot -1) and attend to one key. A graph fixes its split-KV plan at capture, made for
`max_model_len`-long contexts; where that plan splits, a second graph without split-KV is
captured for the bucket and replayed while the batch's longest context is too short to split
(the plan's own rule), which saves the merge kernel and the partial outputs on most steps.
`enforce_eager=True`, CPU, and every other step kind run eagerly.

Inputs: a step's model inputs travel as one flat int64 payload described by a 13-word header
(`tilellm.distributed.message`); the model reads views into the payload's device copy.

Tensor parallelism (`group`): each rank has a runner holding its shard of the model and of the
KV pool (its KV heads; the pool size is the smallest any rank can hold). Rank 0 (`TPDriver`,
in the engine's process) sends each step's header and payload to the other ranks before running
it, and alone samples; the others run `execute_remote` on what it sends, replaying the same
CUDA graph. Any failure inside a step stops every rank and raises on rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tilellm.distributed.driver import WorkerError
from tilellm.distributed.message import NUM_WORDS, StepInputs, StepMessage, decode_step, encode_step
from tilellm.engine.config import EngineConfig
from tilellm.engine.metadata import (
    CASCADE_MIN_REQUESTS,
    AttentionMetadata,
    BatchKind,
    StepBatch,
    attention_context,
    num_leading_decodes,
)
from tilellm.kernels.config import paged_config
from tilellm.kernels.schedule import MIN_CONTEXT_TO_SPLIT, choose_num_splits
from tilellm.worker.sampler import HostSampling, Sampler, SamplerOutput

if TYPE_CHECKING:
    from tilellm.distributed import TPDriver, TPGroup

logger = logging.getLogger(__name__)

_CPU_POOL_BYTES = 2 << 30
_GRAPH_RESERVE_BYTES = 512 << 20  # CUDA graph pool and allocator slack, kept out of the KV pool


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a decode graph: 1, 2, 4, 8, then every multiple of 8 up to the max."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass
class StepResult:
    """Host copies of the sampler's output for the sampled rows of one step."""

    token_ids: np.ndarray  # [N] int64
    sampled_logprobs: np.ndarray | None = None  # [N] float32
    sampled_ranks: np.ndarray | None = None  # [N] int64
    top_logprobs: np.ndarray | None = None  # [N, K] float32
    top_token_ids: np.ndarray | None = None  # [N, K] int64
    device_time_s: float | None = None  # H2D + forward + sampling + D2H (CUDA events), when timed


@dataclass
class InputPatch:
    """Input tokens not known on the host when a step is launched (asynchronous scheduling).

    `input_ids[dst[j]]` is the token the step `prev` sampled in its row `src[j]`; the runner copies
    it on the device, so the host never waits for it.
    """

    dst: np.ndarray  # [P] int64 rows of the step's input_ids
    src: np.ndarray  # [P] int64 rows of prev's sampled tokens
    prev: StepHandle


@dataclass
class StepHandle:
    """A launched step: its device outputs, their pinned host copies and the event that ends it."""

    tokens_dev: torch.Tensor  # [N] int64 on the device (read by the next step's InputPatch)
    out: SamplerOutput
    host: StepResult  # pinned numpy views, valid once `event` has completed
    event: torch.cuda.Event | None = None
    start_event: torch.cuda.Event | None = None


class _Staging:
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
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

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

    def commit(self) -> list[torch.Tensor]:
        """Copy everything added since the last commit; returns the device views, in order."""
        self.dev[: self._offset].copy_(self.host[: self._offset], non_blocking=True)
        out = []
        for off, n, dtype, shape in self._items:
            t = self.dev[off : off + n].view(_TORCH_DTYPES[np.dtype(dtype)]).view(shape)
            out.append(t)
        self._items, self._offset = [], 0
        return out


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


class ModelRunner:
    """Runs one step on the device: see the module docstring."""

    def __init__(self, config: EngineConfig, group: TPGroup | None = None):
        """`group`: this rank's tensor-parallel group; None for one device (no collectives)."""
        from tilellm.models.loader import load_model, model_kv_spec

        self.config = config
        self.group = group
        # Rank 0's handle on the workers (it alone launches steps); None on one device and on workers.
        self.driver: TPDriver | None = group if group is not None and group.is_driver else None  # type: ignore[assignment]
        tp_rank, tp_size = (group.rank, group.world_size) if group is not None else (0, 1)
        self.device = group.device if group is not None else resolve_device(config.device)
        dtype = config.dtype
        if dtype == "auto" and self.device.type == "cpu":
            dtype = "float32"  # CPU: the fp32 oracle's precision (and no bf16 interpreter trap)
        t0 = time.perf_counter()
        self.model, self.hf_config = load_model(
            config.model,
            dtype=dtype,
            device=self.device,
            attention_backend=config.attention_backend,
            fused_ops_backend=config.fused_ops_backend,
            load_format=config.load_format,
            tp_rank=tp_rank,
            tp_size=tp_size,
            seed=config.seed,
        )
        self.dtype = next(self.model.parameters()).dtype
        self.vocab_size = int(self.hf_config.vocab_size)
        logger.info("loaded %s in %.1f s", config.model, time.perf_counter() - t0)
        self.num_layers, self.num_kv_heads, self.head_dim = model_kv_spec(self.hf_config, tp_size)
        self.block_size = config.block_size
        self.block_bytes = (
            2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        )
        self.sampler = Sampler()
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:  # two of each: step N+1 is prepared while step N runs
            self._stagings = [_Staging(self.device), _Staging(self.device)]
            self._token_hosts = [
                torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        self._parity = 0
        self._step_id = 0
        self._recv_payload: torch.Tensor | None = None  # workers: where each step's payload lands
        max_positions = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or None
        model_len = config.max_model_len or max_positions or 2048
        if max_positions is not None and model_len > max_positions:
            raise ValueError(
                f"max_model_len ({model_len}) is larger than the model's "
                f"max_position_embeddings ({max_positions})"
            )

        num_blocks = config.num_kv_blocks or self._auto_num_blocks(model_len)
        if group is not None:  # the same block ids on every rank: the pool any rank can hold
            num_blocks = group.agree_min(num_blocks)
        self.num_kv_blocks = num_blocks
        pool_tokens = self.num_kv_blocks * self.block_size
        if model_len > pool_tokens:
            logger.warning("max_model_len %d capped at the KV pool's %d tokens", model_len, pool_tokens)
            model_len = pool_tokens
        self.max_model_len = model_len
        self.max_blocks_per_seq = -(-model_len // self.block_size)
        self._allocate_kv_cache()

        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Buckets whose graph splits the KV range: the same batch without split-KV, replayed
        # while every context is shorter than MIN_CONTEXT_TO_SPLIT.
        self.short_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # The same buckets with cascade decode (requests sharing a cached prefix), from the
        # smallest batch that `shared_prefix_len` ever reports; only with prefix caching on.
        self.cascade_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_replays = {"plain": 0, "short": 0, "cascade": 0}  # decode steps by graph variant
        self.time_device = False  # CUDA-event timing of each step (benchmarks turn it on)
        # Host seconds spent in each part of `launch`, by path ("graph" / "eager") and phase.
        self.host_times: dict[str, float] = {}
        if self.is_cuda:
            self._warmup_kernels()
        if self.is_cuda and not config.enforce_eager:
            try:
                self._capture_graphs()
            except WorkerError:  # a worker died: every rank is already stopped
                raise
            except Exception:  # a kernel that syncs with the host cannot be captured
                logger.exception("CUDA graph capture failed: decode steps run eagerly")
                self.graphs, self.short_graphs, self.cascade_graphs = {}, {}, {}
                torch.cuda.synchronize()
            if group is not None and not group.agree_min(int(bool(self.graphs))):
                self.graphs, self.short_graphs, self.cascade_graphs = {}, {}, {}  # all ranks, or none
            if group is not None and not group.agree_min(int(bool(self.cascade_graphs))):
                self.cascade_graphs = {}  # likewise for the cascade variant
        if self.driver is not None:  # the workers stop when this runner goes (or at exit)
            weakref.finalize(self, self.driver.shutdown)

    def _sync(self) -> None:
        """Wait for the device during start-up. Under tensor parallelism rank 0 polls the workers
        meanwhile (`TPDriver.wait_event`): a worker that died before its all-reduce is raised as a
        `WorkerError` with its traceback, where a plain synchronize would wait on NCCL forever."""
        if self.driver is not None:
            event = torch.cuda.Event()
            event.record()
            self.driver.wait_event(event)
        torch.cuda.synchronize()

    # -- KV pool --------------------------------------------------------------------------------

    def _auto_num_blocks(self, model_len: int) -> int:
        if not self.is_cuda:
            return max(_CPU_POOL_BYTES // self.block_bytes, 1)
        self._sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run(model_len)
        self._sync()
        peak = torch.cuda.max_memory_allocated()
        current = torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free  # weights, CUDA context, other processes
        reserve = _GRAPH_RESERVE_BYTES
        if not self.config.enforce_eager:
            # Each captured graph keeps its logits output alive, [bucket, V] in the model dtype:
            # the plain and the no-split graph of every bucket (at most), and the cascade graph of
            # every bucket from CASCADE_MIN_REQUESTS when prefix caching is on.
            sizes = graph_batch_sizes(self.config.max_num_seqs)
            rows = 2 * sum(sizes)
            if self.config.enable_prefix_caching:
                rows += sum(bs for bs in sizes if bs >= CASCADE_MIN_REQUESTS)
            reserve += rows * self.vocab_size * self.dtype.itemsize
        budget = total * self.config.gpu_memory_utilization - used - (peak - current) - reserve
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: {used / 2**30:.1f} GiB in use, activations peak at "
                f"{(peak - current) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise "
                "gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs"
            )
        logger.info(
            "KV pool: %d blocks of %d tokens (%.1f GiB); activation peak %.2f GiB",
            num_blocks,
            self.block_size,
            num_blocks * self.block_bytes / 2**30,
            (peak - current) / 2**30,
        )
        return num_blocks

    @torch.inference_mode()
    def _profile_run(self, model_len: int) -> None:
        """One forward at the largest step before the pool exists (PREFILL, K/V not stored)."""
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        seq_len = min(model_len, num_tokens)
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens // seq_len))
        lens = [seq_len] * num_seqs
        num_tokens = sum(lens)
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            kind=BatchKind.PREFILL,
            cu_seqlens_q=cu,
            seq_lens=cu[1:] - cu[:-1],
            max_seqlen_q=seq_len,
            max_seqlen_k=seq_len,
            block_table=torch.zeros((num_seqs, 1), dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, device=self.device) % seq_len
        with attention_context(meta):
            hidden = self.model(ids, pos)
        rows = min(cfg.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        del hidden
        # The sampler at its most expensive: every filter and 20 logprobs.
        n = rows
        host = HostSampling(
            rows=np.arange(n),
            steps=np.zeros(n, np.int64),
            inv_temp=np.ones(n, np.float32),
            seed_keys=np.zeros(n, np.int64),
            all_greedy=False,
            top_k=np.full(n, 50, np.int64),
            max_top_k=50,
            top_p=np.full(n, 0.9, np.float32),
            min_p=np.full(n, 0.05, np.float32),
            max_num_logprobs=20,
        )
        dev = {
            k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
            for k, v in host.device_arrays().items()
        }
        self.sampler(logits, host.to_metadata(dev))

    def _allocate_kv_cache(self) -> None:
        shape = (2, self.num_layers, self.num_kv_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # Zeroed so that padding rows (which read key 0 of block 0) never meet NaN garbage.
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        layers = self.model.attention_layers()
        if len(layers) != self.num_layers:
            raise RuntimeError(f"model has {len(layers)} attention layers, config says {self.num_layers}")
        for i, layer in enumerate(layers):
            layer.bind_kv_cache(self.kv_cache[0, i], self.kv_cache[1, i])

    @torch.inference_mode()
    def _warmup_kernels(self) -> None:
        """Compile the kernel variants that eager steps use, so that no step pays a JIT compile.

        Triton specialises the attention kernels on the query tile (from the longest new-token
        run of a step), on split-KV or not, and the fused kernels on the token count; one small
        step per variant (slots -1: nothing is stored) compiles them before serving starts.
        """
        t0 = time.perf_counter()
        cap = min(self.config.max_num_batched_tokens, self.max_model_len - 1)
        q_lens = sorted({q for q in (1, 2, 3, 4, 8, 16, 17, 32, 64, 128, 129, 1024, cap) if 1 <= q <= cap})
        long_ctx = min(self.max_model_len, self.num_kv_blocks * self.block_size, 4096)
        for q in q_lens:
            for ctx in (q + 1, long_ctx):  # short context: no split-KV; long: splits for one request
                if ctx > long_ctx or ctx <= q:
                    continue
                self._warmup_step([q], [ctx], BatchKind.DECODE if q == 1 else BatchKind.MIXED)
            self._warmup_step([q], [q], BatchKind.PREFILL)
        self._warmup_step([1] * 8, [long_ctx] * 8, BatchKind.DECODE)
        # Mixed steps: decodes (the decode kernel, split and not) beside a prompt chunk.
        for q in (2, 129, cap):
            if q < long_ctx:
                self._warmup_step([1] * 8 + [q], [long_ctx] * 8 + [q], BatchKind.MIXED)
                self._warmup_step([1, q], [q + 1, long_ctx], BatchKind.MIXED)
        self._warmup_hopper_paged()
        if long_ctx > 256:  # cascade decode (a shared prefix): its two passes and the merge
            self._warmup_step([1] * 8, [long_ctx] * 8, BatchKind.DECODE, cascade_prefix=256)
        self._sync()
        logger.info("warmed up the kernels in %.1f s", time.perf_counter() - t0)

    def _warmup_hopper_paged(self) -> None:
        """On Hopper, compile paged_attention's Gluon kernel (prompt chunks, see
        `config.paged_uses_gluon`), which a step reaches only for batches wide enough to fill a
        wave: one direct launch over layer 0's cache, reading block 0 for 128 new tokens."""
        import tilellm.kernels as triton_ops
        from tilellm.kernels.config import launch_gluon, paged_uses_gluon
        from tilellm.kernels.prefill import LOG2_E

        attn = self.model.attention_layers()[0]
        # The dispatch gate itself, for a chunk of one full query tile in a batch of any width.
        may_run = paged_uses_gluon(attn.head_dim, self.dtype, self.block_size, 128, programs=1 << 30)
        if not (may_run and attn.ops is triton_ops and attn.k_cache.is_contiguous()):
            return
        dev = self.device
        q = torch.zeros(128, attn.num_heads, attn.head_dim, dtype=self.dtype, device=dev)
        table = torch.zeros(1, -(-128 // self.block_size), dtype=torch.int32, device=dev)
        cu = torch.tensor([0, 128], dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([128], dtype=torch.int32, device=dev)
        launch_gluon(lambda hopper: hopper.launch_paged(
            q.view(128, -1), attn.k_cache, attn.v_cache, torch.empty_like(q), table, cu, seq_lens, 128,
            attn.num_heads // attn.num_kv_heads, attn.scale * LOG2_E,
        ))  # fmt: skip

    def _warmup_step(
        self, q_lens: list[int], seq_lens: list[int], kind: BatchKind, cascade_prefix: int = 0
    ) -> None:
        dev = self.device
        num_blocks = -(-max(seq_lens) // self.block_size)
        table = torch.arange(num_blocks, dtype=torch.int32, device=dev).repeat(len(q_lens), 1)
        cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=dev)
        num_tokens = sum(q_lens)
        positions = torch.cat([torch.arange(s - q, s, device=dev) for q, s in zip(q_lens, seq_lens)])
        num_decodes = num_leading_decodes(q_lens) if kind is BatchKind.MIXED else 0
        meta = AttentionMetadata(
            kind=kind,
            cu_seqlens_q=cu,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
            block_table=table,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            cascade_prefix_len=(
                torch.tensor([cascade_prefix], dtype=torch.int32, device=dev) if cascade_prefix else None
            ),
            num_decodes=num_decodes,
        )
        with attention_context(meta):
            hidden = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=dev), positions)
        self.model.compute_logits(hidden[cu[1:] - 1])

    # -- CUDA graphs ----------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        t0 = time.perf_counter()
        max_bs = self.config.max_num_seqs
        dev = self.device
        self.graph_sizes = graph_batch_sizes(max_bs)
        self.g_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.g_slots = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.g_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.g_block_table = torch.zeros((max_bs, self.max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.g_cu = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.g_prefix_len = torch.zeros(1, dtype=torch.int32, device=dev)
        pool = self._capture_variant(self.graphs, self.graph_sizes, None, None)
        splitting = [bs for bs in self.graph_sizes if self._decode_graph_splits(bs) > 1]
        if splitting:
            short = MIN_CONTEXT_TO_SPLIT - 1
            self._capture_variant(self.short_graphs, splitting, None, pool, max_seqlen_k=short)
        if self.config.enable_prefix_caching:
            sizes = [bs for bs in self.graph_sizes if bs >= CASCADE_MIN_REQUESTS]
            try:
                self._capture_variant(self.cascade_graphs, sizes, self.g_prefix_len, pool)
            except WorkerError:
                raise
            except Exception:  # keep the plain graphs: cascade steps then run eagerly
                logger.exception("cascade graph capture failed: cascade decode steps run eagerly")
                self.cascade_graphs = {}
                torch.cuda.synchronize()
        self._sync()
        logger.info(
            "captured %d decode graphs (+%d without split-KV, +%d cascade) in %.1f s",
            len(self.graphs),
            len(self.short_graphs),
            len(self.cascade_graphs),
            time.perf_counter() - t0,
        )

    def _decode_graph_splits(self, bs: int) -> int:
        """Segments the decode kernel plans for `bs` requests of `max_model_len`-long contexts
        (what a graph captured with `max_seqlen_k = max_model_len` runs)."""
        attn = self.model.attention_layers()[0]
        cfg, _ = paged_config(self.head_dim, self.dtype, attn.num_heads // attn.num_kv_heads, 1)
        plan = choose_num_splits(
            bs, attn.num_kv_heads, 1, None, max_seqlen_k=self.max_model_len, rows_per_program=cfg.block_m
        )
        return plan.num_splits

    def _capture_variant(
        self,
        graphs: dict,
        sizes: list[int],
        prefix_len: torch.Tensor | None,
        pool,
        max_seqlen_k: int | None = None,
    ):
        """Capture one decode graph per batch size into `graphs`; returns the shared memory pool.
        `max_seqlen_k` is the longest context the split-KV plan is made for (default
        `max_model_len`); the graph stays correct for any length, only the plan is fixed."""
        # Under tensor parallelism NCCL's watchdog thread queries events while this thread
        # captures: only this thread's own calls need to be capture-safe.
        capture_mode = "thread_local" if self.group is not None else "global"
        for bs in reversed(sizes):
            new_pool = self._capture_one(graphs, bs, prefix_len, pool, max_seqlen_k, capture_mode)
            captured = new_pool is not None
            if self.group is not None:
                # Every rank stops at the same bucket: a rank that went on alone would wait in the
                # next bucket's warm-up all-reduces for a peer that has left the loop.
                captured = bool(self.group.agree_min(int(captured)))
            if not captured:
                raise RuntimeError(f"decode graph capture failed at batch size {bs} (this rank or another)")
            pool = new_pool
        return pool

    def _capture_one(self, graphs: dict, bs: int, prefix_len, pool, max_seqlen_k, capture_mode):
        """Warm up and capture the decode graph of `bs` requests into `graphs`. Returns the memory
        pool the graphs share, or None (logged) when this rank failed."""
        try:
            meta = AttentionMetadata(
                kind=BatchKind.DECODE,
                cu_seqlens_q=self.g_cu[: bs + 1],
                seq_lens=self.g_seq_lens[:bs],
                max_seqlen_q=1,
                max_seqlen_k=max_seqlen_k or self.max_model_len,
                block_table=self.g_block_table[:bs],
                slot_mapping=self.g_slots[:bs],
                cascade_prefix_len=prefix_len,
            )
            with attention_context(meta):
                self._graph_body(bs)  # warm-up: compiles the kernels outside the capture
                self._sync()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_mode):
                    logits = self._graph_body(bs)
        except WorkerError:
            raise
        except Exception:
            logger.exception("decode graph capture failed at batch size %d", bs)
            return None
        graphs[bs] = (graph, logits)
        return pool if pool is not None else graph.pool()

    def _graph_body(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.g_ids[:bs], self.g_pos[:bs])
        return self.model.compute_logits(hidden)

    def _graph_bucket(self, num_reqs: int) -> int | None:
        if not self.graphs or num_reqs > self.config.max_num_seqs:
            return None
        for bs in self.graph_sizes:
            if bs >= num_reqs:
                return bs
        return None

    # -- one step -------------------------------------------------------------------------------

    def execute(self, batch: StepBatch, sampling: HostSampling) -> StepResult:
        """Run one step and wait for its result (see `launch` / `wait`)."""
        return self.wait(self.launch(batch, sampling))

    @torch.inference_mode()
    def launch(self, batch: StepBatch, sampling: HostSampling, patch: InputPatch | None = None) -> StepHandle:
        """Start the model on `batch` (CPU tensors) and the sampler on its `logits_indices` rows.

        On CUDA this returns as soon as the work is queued: the host can prepare the next step
        while the device runs this one. `patch` fills input tokens from an earlier step's output.
        With tensor parallelism the step goes to every rank first (see the module docstring).
        """
        t0 = time.perf_counter()
        attn = batch.attn
        # Decode steps replay a captured graph: plain decode, or cascade when requests share a prefix.
        bucket = self._graph_bucket(attn.seq_lens.shape[0]) if attn.kind is BatchKind.DECODE else None
        if attn.cascade_prefix_len is not None and self.is_cuda and bucket not in self.cascade_graphs:
            # On the GPU, cascade pays only inside a graph: eagerly its extra launches cost more
            # host time than the prefix re-read it saves. Then the step is plain decode.
            attn = dataclasses.replace(attn, cascade_prefix_len=None)
            batch = dataclasses.replace(batch, attn=attn)
        self._step_id += 1
        msg = encode_step(batch, bucket, self._step_id)
        if self.driver is None:
            return self._launch(msg, sampling, patch, t0)
        with self.driver.step_lock:
            self.driver.check_workers()
            with self._all_ranks():
                self.driver.send_header(msg.header)
                return self._launch(msg, sampling, patch, t0)

    @contextlib.contextmanager
    def _all_ranks(self, catch: type[BaseException] = BaseException) -> Iterator[None]:
        """Rank 0's part of a step all ranks take part in: a failure stops every rank (the others
        may be waiting in one of its collectives) and raises the first failed rank's error."""
        assert self.driver is not None
        try:
            yield
        except catch as e:
            err = self.driver.failure(e)
            if err is e:
                raise
            raise err from e

    def _launch(
        self, msg: StepMessage, sampling: HostSampling, patch: InputPatch | None, t0: float
    ) -> StepHandle:
        if not self.is_cuda:
            return self._launch_cpu(msg, sampling, patch)
        parity, self._parity = self._parity, self._parity ^ 1
        st = self._stagings[parity]
        msg.write(st.reserve((msg.num_words,), np.int64)[1])  # item 0: the payload
        where = {name: st.add(a) for name, a in sampling.device_arrays().items()}
        if patch is not None:
            where["patch_dst"], where["patch_src"] = st.add(patch.dst), st.add(patch.src)
        t1 = time.perf_counter()
        # The device span starts here: when the host is late, the idle time before it is excluded.
        start_ev = None
        if self.time_device:
            start_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record()
        dev = st.commit()
        md = sampling.to_metadata({name: dev[i] for name, i in where.items() if not name.startswith("patch")})
        payload = dev[0]
        inputs = decode_step(msg.header, payload)
        self._apply_patch(inputs.input_ids, patch, dev, where)
        if self.driver is not None:  # patched first: the workers get the tokens of the step before
            self.driver.broadcast_payload(payload)
        t2 = time.perf_counter()
        logits = self._forward(inputs)
        t3 = time.perf_counter()
        out = self.sampler(logits, md)
        handle = self._copy_out(out, parity)
        handle.start_event = start_ev
        t4 = time.perf_counter()
        path = "graph" if inputs.graph else "eager"
        ht = self.host_times
        for phase, dt in (("stage", t1 - t0), ("inputs", t2 - t1), ("forward", t3 - t2), ("sample", t4 - t3)):
            key = f"{path}.{phase}"
            ht[key] = ht.get(key, 0.0) + dt
        ht[f"{path}.steps"] = ht.get(f"{path}.steps", 0.0) + 1
        return handle

    def _forward(self, x: StepInputs) -> torch.Tensor:
        """Logits [N, V] of the step's sampled rows; every rank runs this on the same inputs."""
        if x.graph:
            bucket = x.input_ids.shape[0]
            nb = x.block_table.shape[1]
            self.g_ids[:bucket].copy_(x.input_ids)
            self.g_pos[:bucket].copy_(x.positions)
            self.g_slots[:bucket].copy_(x.slot_mapping)
            self.g_seq_lens[:bucket].copy_(x.seq_lens)
            self.g_block_table[: x.num_reqs, :nb].copy_(x.block_table)
            if x.cascade_prefix_len is not None:
                self.g_prefix_len.copy_(x.cascade_prefix_len)
                variant, graphs = "cascade", self.cascade_graphs
            elif x.max_seqlen_k < MIN_CONTEXT_TO_SPLIT and bucket in self.short_graphs:
                variant, graphs = "short", self.short_graphs
            else:
                variant, graphs = "plain", self.graphs
            self.graph_replays[variant] += 1
            graph, graph_logits = graphs[bucket]
            graph.replay()
            # Usually every request samples, in order: a view, not a gather.
            if x.logits_indices.shape[0] == x.num_reqs:
                return graph_logits[: x.num_reqs]
            return graph_logits[x.logits_indices]
        meta = AttentionMetadata(
            kind=x.kind,
            cu_seqlens_q=x.cu_seqlens_q,
            seq_lens=x.seq_lens,
            max_seqlen_q=x.max_seqlen_q,
            max_seqlen_k=x.max_seqlen_k,
            block_table=x.block_table,
            slot_mapping=x.slot_mapping,
            cascade_prefix_len=x.cascade_prefix_len,
            num_decodes=x.num_decodes,
            rest_cu_seqlens_q=x.cu_seqlens_q[x.num_decodes :] - x.num_decodes if x.num_decodes else None,
        )
        with attention_context(meta):
            hidden = self.model(x.input_ids, x.positions)
        return self.model.compute_logits(hidden[x.logits_indices])

    @torch.inference_mode()
    def execute_remote(self, header: np.ndarray) -> None:
        """A worker rank's step: receive the payload `header` announces from rank 0 and run the
        forward on it (the logits are dropped: rank 0 samples)."""
        assert self.group is not None and self.driver is None, "only tensor-parallel workers receive steps"
        num_words = int(header[NUM_WORDS])
        buf = self._recv_payload
        if buf is None or buf.shape[0] < num_words:  # reused in stream order, like the staging
            size = max(num_words, 2 * buf.shape[0] if buf is not None else 1 << 14)
            buf = self._recv_payload = torch.empty(size, dtype=torch.int64, device=self.device)
        payload = buf[:num_words]
        self.group.broadcast_payload(payload)
        self._forward(decode_step(header, payload))

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; idempotent); nothing on one device."""
        if self.driver is not None:
            self.driver.shutdown()

    @staticmethod
    def _apply_patch(ids: torch.Tensor, patch: InputPatch | None, dev: list, where: dict) -> None:
        if patch is not None and len(patch.dst):
            dst, src = dev[where["patch_dst"]], dev[where["patch_src"]]
            ids.index_copy_(0, dst, patch.prev.tokens_dev.index_select(0, src))

    def _copy_out(self, out: SamplerOutput, parity: int) -> StepHandle:
        """Queue the D2H copies of the sampler's output into pinned memory, then an event."""

        def host(t: torch.Tensor | None) -> np.ndarray | None:
            if t is None:
                return None
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            return buf.numpy()

        n = out.token_ids.shape[0]
        if self._token_hosts[parity].shape[0] < n:
            self._token_hosts[parity] = torch.empty(n, dtype=torch.int64, pin_memory=True)
        tokens = self._token_hosts[parity][:n]
        tokens.copy_(out.token_ids, non_blocking=True)
        host_result = StepResult(
            token_ids=tokens.numpy(),  # valid until this parity's buffer is reused, two steps later
            sampled_logprobs=host(out.sampled_logprobs),
            sampled_ranks=host(out.sampled_ranks),
            top_logprobs=host(out.top_logprobs),
            top_token_ids=host(out.top_token_ids),
        )
        event = torch.cuda.Event(enable_timing=self.time_device)
        event.record()
        return StepHandle(tokens_dev=out.token_ids, out=out, host=host_result, event=event)

    def wait(self, handle: StepHandle) -> StepResult:
        """Block until `handle`'s step is done; its sampled tokens (and logprobs) on the host."""
        if handle.event is not None:
            if self.driver is None:
                handle.event.synchronize()
            else:  # a dead worker would leave NCCL waiting: watch the workers meanwhile
                # (an interrupt here leaves the group intact: the whole step is queued on every rank)
                with self._all_ranks(catch=Exception):
                    self.driver.wait_event(handle.event)
            if handle.start_event is not None:
                handle.host.device_time_s = handle.start_event.elapsed_time(handle.event) / 1e3
        return handle.host

    def _launch_cpu(self, msg: StepMessage, sampling: HostSampling, patch: InputPatch | None) -> StepHandle:
        t0 = time.perf_counter()
        payload = torch.from_numpy(msg.to_words())
        inputs = decode_step(msg.header, payload)
        if patch is not None and len(patch.dst):
            ids = inputs.input_ids
            ids[torch.from_numpy(patch.dst)] = patch.prev.tokens_dev[torch.from_numpy(patch.src)]
        if self.driver is not None:
            self.driver.broadcast_payload(payload)
        logits = self._forward(inputs)
        out = self.sampler(logits, sampling.to_cpu_metadata())

        def host(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy()

        result = StepResult(
            token_ids=out.token_ids.numpy(),
            sampled_logprobs=host(out.sampled_logprobs),
            sampled_ranks=host(out.sampled_ranks),
            top_logprobs=host(out.top_logprobs),
            top_token_ids=host(out.top_token_ids),
            device_time_s=time.perf_counter() - t0 if self.time_device else None,
        )
        return StepHandle(tokens_dev=out.token_ids, out=out, host=result)
