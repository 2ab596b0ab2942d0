"""The model runner: the device side of one step.

    runner = ModelRunner(config)                 # load, size the KV pool, warm up, capture graphs
    handle = runner.launch(inputs, sampling)     # host StepInputs -> device -> model -> sampler
    result = runner.wait(handle)                 # the sampled tokens on the host

`launch` moves the step's inputs (`StepInputs`, built on the host by `build_step_inputs`) to the
device as one payload through a pinned staging buffer, plans the step's attention once
(`AttentionBackend.plan`), runs the model (a CUDA graph for decode steps, eager otherwise),
samples, and queues the copy of the sampled tokens back; `wait` is the step's only host sync.

Parts: `kv_pool.py` (how many blocks, the allocation), `cuda_graphs.py` (decode graphs),
`staging.py` (pinned host buffers), `sampler.py` (sampling on the device), `step_inputs.py` (the
step's one form and its serialization), `tp_worker.py` (the other tensor-parallel ranks).

Tensor parallelism (`group`): each rank has a runner holding its shard of the model and of the
KV pool (its KV heads; the pool size is the smallest any rank can hold). Rank 0 (`TPDriver`, in
the engine's process) sends each step's header and payload to the other ranks before running
it, and alone samples; the others run `execute_remote` on what it sends, replaying the same CUDA
graph. Any failure inside a step stops every rank and raises on rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tilellm.attention import BatchKind, attention_context, get_attention_backend
from tilellm.config import EngineConfig
from tilellm.distributed.driver import WorkerError
from tilellm.kernels.fp8 import FP8_DTYPE, kv_cache_torch_dtype
from tilellm.kernels.pdl import pdl_enabled
from tilellm.worker import kv_pool
from tilellm.worker.cuda_graphs import DecodeGraphs, graph_logits_rows
from tilellm.worker.draft_runner import DraftProposal, DraftRequest, DraftRunner
from tilellm.worker.kv_scales import KVScales, bind_kv_cache
from tilellm.worker.logits_processors import BadWordsState, PenaltyState
from tilellm.worker.piecewise_graphs import PiecewiseGraphs
from tilellm.worker.rejection import DraftVerification
from tilellm.worker.sampler import HostSampling, PromptLogprobs, Sampler, SamplerOutput, prompt_logprobs_of
from tilellm.worker.staging import PinnedStaging
from tilellm.worker.step_inputs import NUM_WORDS, StepInputs, build_step_inputs

if TYPE_CHECKING:
    from tilellm.distributed import TPDriver, TPGroup

logger = logging.getLogger(__name__)


def resolve_device(device: str | None) -> torch.device:
    """`device`, or "cuda" when available else "cpu"; a CUDA device gets its index."""
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
    prompt: PromptLogprobs | None = None  # numpy arrays: the step's prompt logprobs rows


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
    """A launched step: its device outputs, their host copies and the event that ends it."""

    tokens_dev: torch.Tensor  # [N] int64 on the device (read by the next step's InputPatch)
    out: SamplerOutput
    host: StepResult  # pinned numpy views, valid once `event` has completed
    event: torch.cuda.Event | None = None
    start_event: torch.cuda.Event | None = None


def warmup_steps(
    max_num_batched_tokens: int, max_model_len: int, long_ctx: int
) -> list[tuple[list[int], list[int]]]:
    """The made-up steps (q_lens, seq_lens) that compile the kernel variants eager steps use:
    one request's new tokens q at a short context (no split-KV), a long one (splits) and as a
    prefill, for the query tiles and token counts steps reach; eight decodes; and mixed steps,
    decodes beside a prompt chunk. None holds more tokens than a scheduled step can
    (`max_num_batched_tokens`); only a prefill (which attends to its own tokens alone) has a
    context longer than `long_ctx` (<= max_model_len), and none is longer than the model."""
    budget = max_num_batched_tokens
    cap = min(budget, max_model_len - 1)
    steps: list[tuple[list[int], list[int]]] = []
    for q in sorted({q for q in (1, 2, 3, 4, 8, 16, 17, 32, 64, 128, 129, 1024, cap) if 1 <= q <= cap}):
        for ctx in (q + 1, long_ctx):  # short context: no split-KV; long: splits for one request
            if q < ctx <= long_ctx:
                steps.append(([q], [ctx]))
        steps.append(([q], [q]))  # prefill
    if budget >= 8:
        steps.append(([1] * 8, [long_ctx] * 8))  # decode
    # Mixed steps: decodes (the decode kernel, split and not) beside a prompt chunk, within the
    # step's token budget (a chunk of 129 beside 8 decodes only where 137 tokens fit a step)
    for q in (2, 129, cap):
        q8, q1 = min(q, budget - 8, long_ctx - 1), min(q, budget - 1, long_ctx - 1)
        if q8 >= 1:
            steps.append(([1] * 8 + [q8], [long_ctx] * 8 + [q8]))
        if q1 >= 1:
            steps.append(([1, q1], [q1 + 1, long_ctx]))
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()  # (a small budget repeats some)
    unique = []
    for q_lens, seq_lens in steps:
        if (key := (tuple(q_lens), tuple(seq_lens))) not in seen:
            seen.add(key)
            unique.append((q_lens, seq_lens))
    return unique


def start_runner(config: EngineConfig) -> ModelRunner:
    """The model runner of an engine. With tensor parallelism this starts the worker ranks first
    (`tilellm.distributed`); the calling process is rank 0."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    from tilellm.distributed import start_tensor_parallel
    from tilellm.worker.tp_worker import run_worker

    driver = start_tensor_parallel(config, run_worker)
    try:
        return ModelRunner(config, driver)
    except BaseException as e:  # a worker's failure makes rank 0's start-up collectives fail
        err = driver.failure(e)
        if err is e:
            raise
        raise err from e


class ModelRunner:
    """Runs one step on the device: see the module docstring."""

    def __init__(self, config: EngineConfig, group: TPGroup | None = None):
        """`group`: this rank's tensor-parallel group; None for one device (no collectives)."""
        from tilellm.models.loader import index_head_dim, kv_caches_per_layer, load_model, model_kv_spec

        self.config = config
        self.group = group
        # Rank 0's handle on the workers (it alone launches steps); None on one device and on workers.
        self.driver: TPDriver | None = group if group is not None and group.is_driver else None  # type: ignore[assignment]
        tp_rank, tp_size = (group.rank, group.world_size) if group is not None else (0, 1)
        self.device = group.device if group is not None else resolve_device(config.device)
        self.is_cuda = self.device.type == "cuda"
        dtype = config.dtype
        if dtype == "auto" and not self.is_cuda:
            dtype = "float32"  # CPU: the fp32 oracle's precision (and no bf16 interpreter trap)
        t0 = time.perf_counter()
        self.model, self.hf_config = load_model(
            config.model,
            dtype=dtype,
            device=self.device,
            attention_backend=config.attention_backend,
            fused_ops_backend=config.fused_ops_backend,
            load_format=config.load_format,
            quantization=config.quantization,
            tp_rank=tp_rank,
            tp_size=tp_size,
            seed=config.seed,
        )
        self.dtype = next(self.model.parameters()).dtype
        if self.is_cuda:
            _check_fp8_support(self.device, config, self.model)
        self.vocab_size = int(self.hf_config.vocab_size)
        logger.info("loaded %s in %.1f s", config.model, time.perf_counter() - t0)
        if pdl_enabled(self.device):
            logger.info("TILELLM_PDL=1: the decode path's kernels launch with programmatic dependent launch")
        num_layers, num_kv_heads, head_dim = model_kv_spec(self.hf_config, tp_size)
        self.block_size = config.block_size
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.kv_spec = kv_pool.KVSpec(
            num_layers,
            num_kv_heads,
            head_dim,
            config.block_size,
            self.kv_dtype,
            kv_caches_per_layer(self.hf_config),
        )
        index_dim = index_head_dim(self.hf_config)
        self._selection_layer = None  # the layer whose selection `tilellm inspect` shows
        # DeepSeek-V3.2's indexer keys: one more cache of rows, one per layer (with an FP8 cache in
        # e4m3 too, plus each key's fp32 scale: `index_scale_spec`)
        index_dtype = self.dtype if self.kv_dtype != FP8_DTYPE else FP8_DTYPE
        self.index_spec = (
            kv_pool.KVSpec(num_layers, 1, index_dim, config.block_size, index_dtype, 1) if index_dim else None
        )
        self.index_scale_spec = (
            kv_pool.KVSpec(num_layers, 1, 1, config.block_size, torch.float32, 1)
            if index_dim and index_dtype == FP8_DTYPE
            else None
        )
        layer0 = self.model.attention_layers()[0]
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        self.attn_spec = dataclasses.replace(
            layer0.spec(self.dtype), block_size=config.block_size, cache_dtype=self.kv_dtype
        )
        # Token counts of every sequence slot for penalties (allocated when first needed).
        self.penalties = PenaltyState(config.max_num_seqs, self.vocab_size, self.device)
        self.bad_words = BadWordsState(config.max_num_seqs, self.device)  # recent output tokens per slot
        self.sampler = Sampler(penalties=self.penalties, bad_words=self.bad_words)
        # Speculative decoding with a draft model: on rank 0 only (it alone samples); its cache
        # shares the target's block ids, so the pool is sized by both (`kv_pool.PooledSpec`).
        spec = config.speculative_config
        self.draft: DraftRunner | None = None
        if spec is not None and spec.method == "draft_model" and (group is None or group.is_driver):
            self.draft = DraftRunner(config, self.device, self.dtype, self.vocab_size)
        self._draft_probs: torch.Tensor | None = None  # q of the drafts the next step verifies
        if self.is_cuda:  # two of each: step N+1 is prepared while step N runs
            self._stagings = [PinnedStaging(self.device), PinnedStaging(self.device)]
            self._token_hosts = [
                torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        self._parity = 0
        self._events: dict[tuple[int, bool, bool], torch.cuda.Event] = {}  # (`_step_event`)
        self._step_id = 0
        self._recv_payload: torch.Tensor | None = None  # workers: where each step's payload lands
        # CUDA-event timing of each step (benchmarks turn it on; TILELLM_TIME_DEVICE=1 from the start,
        # as `benchmarks/serve_overhead.sh` does for the server)
        self.time_device = self.is_cuda and os.environ.get("TILELLM_TIME_DEVICE") == "1"
        # Host seconds spent in each part of `launch`, by path ("graph" / "eager") and phase.
        self.host_times: dict[str, float] = {}

        model_len = self._model_len()
        try:
            num_blocks = config.num_kv_blocks or self._auto_num_blocks(model_len)
        except RuntimeError as e:
            if self.draft is None:
                raise
            raise ValueError(
                f"speculative_config.model: with the draft model loaded, {e}; pick a smaller draft"
            ) from None
        if group is not None:  # the same block ids on every rank: the pool any rank can hold
            num_blocks = group.agree_min(num_blocks)
        self.num_kv_blocks = num_blocks
        spec_kv = self.kv_spec
        layout = (
            f"one latent row of {spec_kv.head_dim} per layer (MLA)"
            if spec_kv.num_caches == 1
            else f"K and V of {spec_kv.num_kv_heads} x {spec_kv.head_dim} per layer"
        )
        if self.index_spec is not None:
            layout += f", indexer keys of {self.index_spec.head_dim}"
            if self.index_scale_spec is not None:
                layout += " (e4m3, an fp32 scale per key)"
        if self.kv_dtype == FP8_DTYPE:
            layout += (
                f"; FP8 (e4m3) values: {self.dtype.itemsize}x the tokens of a {str(self.dtype)[6:]} cache"
            )
        logger.info(
            "KV cache: %d bytes per token (%s); %d blocks of %d tokens = %d tokens, %.2f GiB",
            self.kv_bytes_per_token, layout, num_blocks, self.block_size,
            num_blocks * self.block_size, num_blocks * self.pool_spec.block_bytes / 2**30,
        )  # fmt: skip
        self.max_model_len = kv_pool.check_fits(
            num_blocks * self.block_size, model_len, explicit=config.max_model_len is not None
        )
        if self.draft is not None and self.draft.max_model_len is not None:
            if self.draft.max_model_len < self.max_model_len:
                raise ValueError(
                    f"speculative_config.model: the draft model's max_position_embeddings "
                    f"({self.draft.max_model_len}) is below the engine's max_model_len "
                    f"({self.max_model_len}); lower max_model_len or pick another draft"
                )
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self._bind_kv_pool()
        if self.draft is not None:
            self.draft.bind_kv_pool(num_blocks)

        self.decode_graphs = DecodeGraphs(
            self.device,
            config.max_num_seqs,
            self.max_blocks_per_seq,
            self.max_model_len,
            forward=self._forward_all_rows,
            decode_splits=self.decode_splits,
            group=group,
            verify_width=spec.num_speculative_tokens + 1 if spec is not None else 0,
        )
        self.piecewise_graphs = PiecewiseGraphs(
            self.device,
            config.max_num_batched_tokens,
            forward=self._forward_hidden,
            synthetic=self._synthetic_tokens,
            group=group,
        )
        if self.is_cuda:
            self._warmup_kernels()
        if self.is_cuda and self.uses_graphs:
            with _no_garbage_collection():
                self._capture_graphs()
                if config.cudagraph_mode == "full_and_piecewise":
                    self._capture_piecewise_graphs()
            if self.draft is not None:
                self.draft.capture_graphs(
                    config.max_num_seqs, self.max_blocks_per_seq, self.max_model_len, self._sync
                )
        if self.driver is not None:  # the workers stop when this runner goes (or at exit)
            weakref.finalize(self, self.driver.shutdown)

    @property
    def uses_graphs(self) -> bool:
        return not self.config.enforce_eager and self.config.cudagraph_mode != "none"

    # -- start-up -------------------------------------------------------------------------------

    def _model_len(self) -> int:
        max_positions = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or None
        model_len = self.config.max_model_len or max_positions or 2048
        if max_positions is not None and model_len > max_positions:
            raise ValueError(
                f"max_model_len ({model_len}) is larger than the model's "
                f"max_position_embeddings ({max_positions})"
            )
        return model_len

    def _sync(self) -> None:
        """Wait for the device during start-up. Under tensor parallelism rank 0 polls the workers
        meanwhile (`TPDriver.wait_event`): a worker that died before its all-reduce is raised as a
        `WorkerError` with its traceback, where a plain synchronize would wait on NCCL forever."""
        if self.driver is not None:
            event = torch.cuda.Event()
            event.record()
            self.driver.wait_event(event)
        torch.cuda.synchronize()

    @property
    def pool_spec(self) -> kv_pool.KVSpec | kv_pool.PooledSpec:
        """What one block id costs: the target's block, plus its indexer keys' (DeepSeek-V3.2)
        and the draft model's block when there are."""
        specs = [self.kv_spec]
        if self.index_spec is not None:
            specs.append(self.index_spec)
        if self.index_scale_spec is not None:
            specs.append(self.index_scale_spec)
        if self.draft is not None:
            specs.append(self.draft.kv_spec)
        return specs[0] if len(specs) == 1 else kv_pool.PooledSpec(tuple(specs))

    def _auto_num_blocks(self, model_len: int) -> int:
        if not self.is_cuda:
            return kv_pool.cpu_num_blocks(self.pool_spec, model_len, self.config.max_num_seqs)
        self._sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run(model_len)
        self._sync()
        peak = torch.cuda.max_memory_allocated()
        current = torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        reserve = kv_pool.GRAPH_RESERVE_BYTES
        if self.uses_graphs and self.config.cudagraph_mode == "full_and_piecewise":
            # piecewise graphs hold their activations in the graphs' pool, apart from the eager
            # steps' (the profiling step measured the largest; the shared attention output
            # buffer is smaller than it)
            reserve += peak - current
        if self.uses_graphs:  # the captured graphs' logits outputs
            spec = self.config.speculative_config
            width = spec.num_speculative_tokens + 1 if spec is not None else 0
            rows = graph_logits_rows(self.config.max_num_seqs, self.config.enable_prefix_caching, width)
            if self.draft is not None:  # its decode graphs (plain and no-split variants)
                rows += graph_logits_rows(self.config.max_num_seqs, False)
            reserve += rows * self.vocab_size * self.dtype.itemsize
        reserve += self.config.max_num_seqs * self.vocab_size * 5  # penalties' counts and prompt masks
        reserve += self._mla_reserve_bytes()
        return kv_pool.gpu_num_blocks(
            self.pool_spec,
            peak_activation_bytes=peak - current,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            graph_reserve_bytes=reserve,
        )

    @torch.inference_mode()
    def _profile_run(self, model_len: int) -> None:
        """One forward at the largest step before the pool exists (PREFILL, K/V not stored),
        then the LM head and the sampler at their most expensive."""
        cfg = self.config
        seq_len = min(model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens // seq_len))
        x = self._synthetic_inputs([seq_len] * num_seqs, [seq_len] * num_seqs)
        with attention_context(self._plan(x)):
            hidden = self.model(x.input_ids, x.positions)
        rows = min(cfg.max_num_seqs, x.num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        del hidden
        # The sampler with every filter and 20 logprobs.
        host = HostSampling(
            rows=np.arange(rows),
            steps=np.zeros(rows, np.int64),
            inv_temp=np.ones(rows, np.float32),
            seed_keys=np.zeros(rows, np.int64),
            all_greedy=False,
            top_k=np.full(rows, 50, np.int64),
            max_top_k=50,
            top_p=np.full(rows, 0.9, np.float32),
            min_p=np.full(rows, 0.05, np.float32),
            max_num_logprobs=20,
        )
        dev = {
            k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
            for k, v in host.device_arrays().items()
        }
        self.sampler(logits, host.to_metadata(dev))

    def _mla_reserve_bytes(self) -> int:
        """Memory of MLA steps that the profiling pass (a dense prefill) does not reach: the
        absorbed queries and latent outputs of a full-budget chunked step ([T, H, 2L + Dr]), and for
        sparse attention the selection ([T, index_topk] indices) and the indexer's score scratch."""
        from tilellm.kernels.indexer import SCRATCH_ELEMENTS

        spec = self.attn_spec
        if not spec.kv_lora_rank:
            return 0
        tokens = self.config.max_num_batched_tokens
        absorbed = tokens * spec.num_heads * (spec.head_dim + spec.kv_lora_rank) * self.dtype.itemsize
        if self.index_spec is None:
            return absorbed
        topk = int(self.hf_config.index_topk)
        scratch = SCRATCH_ELEMENTS * 4  # int32 score keys
        reserve = absorbed + tokens * topk * 4 + 2 * scratch  # one scratch in the graphs' pool too
        if self.index_scale_spec is not None:  # FP8 keys: the step's e4m3 queries and scaled weights
            heads = int(self.hf_config.index_n_heads)
            reserve += tokens * heads * (self.index_spec.head_dim + 2 * 4)
        return reserve

    def _bind_kv_pool(self) -> None:
        self.kv_cache = kv_pool.allocate_kv_pool(self.kv_spec, self.num_kv_blocks, self.device)
        layers = self.model.attention_layers()
        if len(layers) != self.kv_spec.num_layers:
            raise RuntimeError(
                f"model has {len(layers)} attention layers, config says {self.kv_spec.num_layers}"
            )
        # FP8 caches: each layer's dequantization scales (`kv_scales.KVScales`), measured on the
        # first real step (`_forward`) unless the checkpoint brought them.
        self.fp8_scales = None
        if self.kv_dtype == FP8_DTYPE:
            self.fp8_scales = KVScales(layers, self.kv_spec.num_caches, self.device, "the model")
        bind_kv_cache(layers, self.kv_cache, self.fp8_scales)
        if self.index_spec is not None:  # DeepSeek-V3.2: the indexer keys, on the same block ids
            self.index_cache = kv_pool.allocate_kv_pool(self.index_spec, self.num_kv_blocks, self.device)
            self.index_scales = None
            if self.index_scale_spec is not None:  # [1, L, nb, bs, 1, 1]: layer i's [nb, bs]
                self.index_scales = kv_pool.allocate_kv_pool(
                    self.index_scale_spec, self.num_kv_blocks, self.device
                )
            for i, layer in enumerate(layers):
                scales = self.index_scales[0, i, ..., 0, 0] if self.index_scales is not None else None
                layer.bind_index_cache(self.index_cache[0, i], scales)
            layers[0].record_selection = True
            self._selection_layer = layers[0]

    def _synthetic_inputs(
        self, q_lens: list[int], seq_lens: list[int], cascade_prefix: int = 0
    ) -> StepInputs:
        """Device inputs of a made-up step that stores nothing (warm-up, profiling): request i
        computes its last q_lens[i] of seq_lens[i] tokens over blocks 0, 1, 2, ...; a decode step
        with `cascade_prefix` shares that many keys."""
        num_blocks = -(-max(seq_lens) // self.block_size)
        table = np.tile(np.arange(num_blocks, dtype=np.int32), (len(q_lens), 1))
        starts = [s - q for q, s in zip(q_lens, seq_lens)]
        x = build_step_inputs(
            None, starts, q_lens, np.arange(len(q_lens)), [True] * len(q_lens), table, self.block_size,
            store=False, cascade=False,
        )  # fmt: skip
        if cascade_prefix:
            x = dataclasses.replace(x, cascade_prefix_len=np.array([cascade_prefix], dtype=np.int32))
        return self._to_device(x)

    def _synthetic_tokens(self, num_tokens: int) -> StepInputs:
        """A made-up prefill of `num_tokens` tokens (requests of at most `max_model_len`) that
        stores nothing: what piecewise graphs are captured on."""
        chunk = min(num_tokens, self.max_model_len)
        lens = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
        return self._synthetic_inputs(lens, lens)

    def _to_device(self, x: StepInputs) -> StepInputs:
        header = x.header()
        return StepInputs.from_payload(header, torch.from_numpy(x.to_words(header)).to(self.device))

    @torch.inference_mode()
    def _warmup_kernels(self) -> None:
        """Compile the kernel variants that eager steps use, so that no step pays a JIT compile.

        Triton specialises the attention kernels on the query tile (from the longest new-token
        run of a step), on split-KV or not, and the fused kernels on the token count; one small
        step per variant (nothing is stored) compiles them before serving starts.
        """
        t0 = time.perf_counter()
        long_ctx = min(self.max_model_len, self.num_kv_blocks * self.block_size, 4096)
        steps = warmup_steps(self.config.max_num_batched_tokens, self.max_model_len, long_ctx)
        for q_lens, seq_lens in steps:
            self._warmup_step(q_lens, seq_lens)
        self._warmup_gluon_paged()
        if long_ctx > 256 and self.config.max_num_batched_tokens >= 8:
            # cascade decode (a shared prefix): its two passes and the merge
            self._warmup_step([1] * 8, [long_ctx] * 8, cascade_prefix=256)
        self._sync()
        logger.info("warmed up the kernels in %.1f s", time.perf_counter() - t0)

    def _warmup_step(self, q_lens: list[int], seq_lens: list[int], cascade_prefix: int = 0) -> None:
        x = self._synthetic_inputs(q_lens, seq_lens, cascade_prefix)
        with attention_context(self._plan(x)):
            hidden = self.model(x.input_ids, x.positions)
        self.model.compute_logits(hidden[x.logits_indices])

    def _warmup_gluon_paged(self) -> None:
        """Compile the paged kernel the backend plans for prompt chunks in batches wide enough
        to fill a wave (on Hopper: `hopper.py`'s), which warm-up batches are too small to reach:
        that plan, run on one 128-token chunk over layer 0's cache (nothing stored)."""
        attn = self.model.attention_layers()[0]
        plan = self.attn_backend.plan_paged(self.attn_spec, 1 << 16, 128, 128 << 16, 128, is_decode=False)
        if plan is None or getattr(plan, "kernel", None) != "gluon":
            return
        dev = self.device
        q = torch.zeros(128, attn.num_heads, attn.head_dim, dtype=self.dtype, device=dev)
        table = torch.zeros(1, -(-128 // self.block_size), dtype=torch.int32, device=dev)
        cu = torch.tensor([0, 128], dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([128], dtype=torch.int32, device=dev)
        self.attn_backend.ops.paged_attention(
            q, attn.k_cache, attn.v_cache, table, cu, seq_lens, 128, scale=attn.scale, num_splits=plan
        )

    def decode_splits(self, num_reqs: int, max_seqlen_k: int) -> int:
        """Split-KV segments the backend plans for a decode batch (1 when it plans none)."""
        plan = self.attn_backend.plan_paged(
            self.attn_spec, num_reqs, 1, num_reqs, max_seqlen_k, is_decode=True
        )
        return 1 if plan is None else plan.num_splits

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        graphs = self.decode_graphs
        try:
            graphs.capture(self._sync, enable_cascade=self.config.enable_prefix_caching)
        except WorkerError:  # a worker died: every rank is already stopped
            raise
        except Exception:  # a kernel that syncs with the host cannot be captured
            logger.exception("CUDA graph capture failed: decode steps run eagerly")
            graphs.clear()
            torch.cuda.synchronize()
        if self.group is not None and not self.group.agree_min(int(bool(graphs))):
            graphs.clear()  # all ranks, or none
        if self.group is not None and not self.group.agree_min(int(bool(graphs.variants["cascade"]))):
            graphs.clear("cascade")  # likewise for the cascade variant

    @torch.inference_mode()
    def _capture_piecewise_graphs(self) -> None:
        """Prefill and mixed steps' piecewise graphs (`piecewise_graphs.py`), in the decode graphs'
        memory pool. Without them those steps run eagerly."""
        try:
            self.piecewise_graphs.capture(self.decode_graphs.pool, self._sync)
        except WorkerError:
            raise
        except Exception:
            logger.exception("piecewise CUDA graph capture failed: prefill and mixed steps run eagerly")
            self.piecewise_graphs.clear()
            torch.cuda.synchronize()
        if self.group is not None and not self.group.agree_min(int(bool(self.piecewise_graphs))):
            self.piecewise_graphs.clear()

    @property
    def verify_pad(self) -> tuple[int, int]:
        """(k, most requests): verification steps of at most that many decoding requests are
        best launched with every draft padded to k tokens, the shape the verification graphs
        replay; (0, 0) when there are none."""
        graphs = self.decode_graphs
        if not graphs.variants["verify"]:
            return 0, 0
        return graphs.verify_width - 1, max(graphs.variants["verify"])

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over every layer of this rank: K and V (or MLA's latent rows),
        plus DeepSeek-V3.2's indexer keys (and their scales)."""
        specs = (self.kv_spec, self.index_spec, self.index_scale_spec)
        return sum(spec.block_bytes for spec in specs if spec is not None)

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token costs this model on this rank (the draft model's not counted)."""
        return self.block_bytes // self.block_size

    # Read-outs of the graphs (benchmarks, tests).
    @property
    def graphs(self) -> dict:
        return self.decode_graphs.variants["plain"]

    @property
    def short_graphs(self) -> dict:
        return self.decode_graphs.variants["short"]

    @property
    def cascade_graphs(self) -> dict:
        return self.decode_graphs.variants["cascade"]

    @property
    def graph_replays(self) -> dict[str, int]:
        return self.decode_graphs.replays

    # -- one step -------------------------------------------------------------------------------

    def _plan(self, x: StepInputs):
        """The step's attention metadata, planned once for every layer."""
        return self.attn_backend.plan(x.attention_metadata(), self.attn_spec)

    def _forward_hidden(
        self, x: StepInputs, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of `input_ids` / `positions` over `x`'s attention metadata
        (what the piecewise graphs capture)."""
        with attention_context(self._plan(x)):
            return self.model(input_ids, positions)

    def _forward_all_rows(self, x: StepInputs) -> torch.Tensor:
        """Logits [T, V] of every row (what a decode graph captures)."""
        with attention_context(self._plan(x)):
            hidden = self.model(x.input_ids, x.positions)
        return self.model.compute_logits(hidden)

    # Prompt logprobs: rows of logits computed at once (a 152k vocabulary makes 1024 rows 0.6 GB).
    PROMPT_LOGITS_CHUNK = 1024

    def _forward(
        self, x: StepInputs, num_prompt_logprobs: int = -1
    ) -> tuple[torch.Tensor, PromptLogprobs | None]:
        """Logits [N, V] of the step's sampled rows, and the prompt logprobs of its
        `prompt_logits_indices` rows (the top `num_prompt_logprobs`; -1 on the workers, which only
        take part in the LM head's collectives). Every rank runs this on the same inputs."""
        if x.graph_size:
            if self._selection_layer is not None:  # a replay runs no Python: nothing to show
                self._selection_layer.last_topk_indices = None
            return self.decode_graphs.replay(x), None
        piecewise = self.piecewise_graphs.bucket(x.num_tokens) is not None
        with attention_context(self._plan(x)), self._measuring_kv_scales():
            if piecewise:  # every layer but attention from graphs; hidden read before any replay
                self.decode_graphs.replays["piecewise"] += 1
                hidden = self.piecewise_graphs.replay(x)
            else:
                hidden = self.model(x.input_ids, x.positions)
        logits = self.model.compute_logits(hidden[x.logits_indices])
        if x.prompt_logits_indices is None:
            return logits, None
        parts = []
        rows, targets = x.prompt_logits_indices, x.prompt_logits_targets
        for start in range(0, rows.shape[0], self.PROMPT_LOGITS_CHUNK):
            end = start + self.PROMPT_LOGITS_CHUNK
            chunk = self.model.compute_logits(hidden[rows[start:end]])
            if num_prompt_logprobs >= 0:
                parts.append(prompt_logprobs_of(chunk, targets[start:end], num_prompt_logprobs))
        return logits, PromptLogprobs.cat(parts) if parts else None

    @property
    def kv_scales(self) -> torch.Tensor | None:
        """The FP8 cache's scales [num_layers, num_caches] on the device (None: not FP8)."""
        return None if self.fp8_scales is None else self.fp8_scales.values

    @property
    def kv_scales_pending(self) -> bool:
        """Whether the FP8 cache's scales are still to be measured on the first real step."""
        return self.fp8_scales is not None and self.fp8_scales.pending

    def _measuring_kv_scales(self) -> contextlib.AbstractContextManager:
        """The first real step with an FP8 cache whose scales are unknown measures them."""
        return contextlib.nullcontext() if self.fp8_scales is None else self.fp8_scales.measuring()

    def log_kv_scales(self) -> None:
        """Say, once, the scales the first step measured (the target's and the draft's)."""
        for scales in (self.fp8_scales, self.draft.fp8_scales if self.draft is not None else None):
            if scales is not None:
                scales.log_once()

    def execute(self, inputs: StepInputs, sampling: HostSampling) -> StepResult:
        """Run one step and wait for its result (see `launch` / `wait`)."""
        return self.wait(self.launch(inputs, sampling))

    @torch.inference_mode()
    def reset_penalty_row(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A sequence with penalties took slot `row`: its prompt and the tokens it generated before."""
        self.penalties.reset_row(row, prompt_ids, output_ids)

    @torch.inference_mode()
    def reset_bad_words_row(self, row: int, output_ids: list[int]) -> None:
        """A sequence with bad words took slot `row`: the tokens it generated before."""
        self.bad_words.reset_row(row, output_ids)

    def propose_drafts(self, requests: list[DraftRequest], block_tables: np.ndarray) -> DraftProposal:
        """Draft tokens from the draft model for the next step (see `DraftRunner.propose`); their
        proposal distributions stay here for that step's rejection sampler."""
        assert self.draft is not None, "propose_drafts needs speculative_config's draft model"
        proposal = self.draft.propose(requests, block_tables)
        self._draft_probs = proposal.probs
        return proposal

    @torch.inference_mode()
    def launch(
        self,
        inputs: StepInputs,
        sampling: HostSampling,
        patch: InputPatch | None = None,
        drafts: tuple[np.ndarray, np.ndarray] | None = None,
        bitmask: Callable[[], torch.Tensor] | None = None,
    ) -> StepHandle:
        """Start the model on `inputs` (host arrays) and the sampler on its `logits_indices` rows.

        On CUDA this returns as soon as the work is queued: the host can prepare the next step
        while the device runs this one. `patch` fills input tokens from an earlier step's output.
        With tensor parallelism the step goes to every rank first (see the module docstring).
        `drafts`: (logits rows, token ids) of the draft tokens this step verifies; with the draft
        model's distributions from `propose_drafts` they are rejection-sampled.
        `bitmask`: called once the forward is queued, it returns structured outputs' token
        bitmask ([rows, ceil(V / 32)] int32 on the CPU, pinned on CUDA) for the sampler, so the
        host fills it while the device runs the forward.
        """
        verification = None
        probs, self._draft_probs = self._draft_probs, None
        if drafts is not None and probs is not None:
            rows, ids = (torch.from_numpy(a).to(self.device) for a in drafts)
            verification = DraftVerification(rows, ids, probs)
        t0 = time.perf_counter()
        graphs = self.decode_graphs
        bucket = graphs.bucket(inputs.num_reqs) if inputs.kind is BatchKind.DECODE else None
        if inputs.cascade_prefix_len is not None and self.is_cuda and not graphs.has_cascade(bucket):
            # On the GPU, cascade pays only inside a graph: eagerly its extra launches cost more
            # host time than the prefix re-read it saves. Then the step is plain decode.
            inputs = dataclasses.replace(inputs, cascade_prefix_len=None)
        if bucket is not None:
            inputs = inputs.padded_to(bucket)
        elif inputs.verify_width and (vb := graphs.verify_bucket(inputs.num_reqs)) is not None:
            inputs = inputs.padded_requests_to(vb)
        self._step_id += 1
        header = inputs.header(self._step_id)
        if self.driver is None:
            return self._launch(inputs, header, sampling, patch, t0, verification, bitmask)
        # The mask callback finishes the engine's step before (a wait and its postprocessing): its
        # errors (an interrupt too) are the engine's, not a rank's failure, so they are raised
        # after the guard that stops every rank.
        deferred: list[BaseException] = []
        guarded = None if bitmask is None else functools.partial(_deferred_errors, bitmask, deferred)
        with self.driver.step_lock:
            self.driver.check_workers()
            with self._all_ranks():
                self.driver.send_header(header)
                handle = self._launch(inputs, header, sampling, patch, t0, verification, guarded)
        if deferred:
            raise deferred[0]
        return handle

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
        self,
        inputs: StepInputs,
        header: np.ndarray,
        sampling: HostSampling,
        patch: InputPatch | None,
        t0: float,
        verification: DraftVerification | None = None,
        bitmask: Callable[[], torch.Tensor] | None = None,
    ) -> StepHandle:
        if not self.is_cuda:
            return self._launch_cpu(inputs, header, sampling, patch, verification, bitmask)
        # The parity flips once the step is launched: a launch that fails leaves the other parity
        # to the step still in flight (its staging, token buffer and events).
        parity = self._parity
        st = self._stagings[parity]
        st.discard()  # (what a failed launch added)
        inputs.write(st.reserve((int(header[NUM_WORDS]),), np.int64)[1], header)  # item 0: the payload
        where = {name: st.add(a) for name, a in sampling.device_arrays().items()}
        if patch is not None:
            where["patch_dst"], where["patch_src"] = st.add(patch.dst), st.add(patch.src)
        t1 = time.perf_counter()
        # The device span starts here: when the host is late, the idle time before it is excluded.
        start_ev = None
        if self.time_device:
            start_ev = self._step_event(parity, start=True)
            start_ev.record()
        dev = st.commit()
        md = sampling.to_metadata({name: dev[i] for name, i in where.items() if not name.startswith("patch")})
        payload = dev[0]
        x = StepInputs.from_payload(header, payload)
        if patch is not None and len(patch.dst):
            dst, src = dev[where["patch_dst"]], dev[where["patch_src"]]
            x.input_ids.index_copy_(0, dst, patch.prev.tokens_dev.index_select(0, src))
        if self.driver is not None:  # patched first: the workers get the tokens of the step before
            self.driver.broadcast_payload(payload)
        t2 = time.perf_counter()
        logits, prompt = self._forward(x, sampling.max_num_prompt_logprobs)
        t3 = time.perf_counter()
        mask = bitmask() if bitmask is not None else None  # filled now, while the device runs the forward
        if mask is not None:
            md.token_bitmask = mask.to(self.device, non_blocking=True)
        out = self.sampler(logits, md, verification)
        out.prompt = prompt
        handle = self._copy_out(out, parity)
        handle.start_event = start_ev
        self._parity = parity ^ 1
        t4 = time.perf_counter()
        path = "graph" if x.graph_size else "eager"
        if not x.graph_size and self.piecewise_graphs.bucket(x.num_tokens) is not None:
            path = "piecewise"
        ht = self.host_times
        for phase, dt in (("stage", t1 - t0), ("inputs", t2 - t1), ("forward", t3 - t2), ("sample", t4 - t3)):
            key = f"{path}.{phase}"
            ht[key] = ht.get(key, 0.0) + dt
        ht[f"{path}.steps"] = ht.get(f"{path}.steps", 0.0) + 1
        return handle

    def _launch_cpu(
        self,
        inputs: StepInputs,
        header: np.ndarray,
        sampling: HostSampling,
        patch: InputPatch | None,
        verification: DraftVerification | None = None,
        bitmask: Callable[[], torch.Tensor] | None = None,
    ) -> StepHandle:
        t0 = time.perf_counter()
        payload = torch.from_numpy(inputs.to_words(header))
        x = StepInputs.from_payload(header, payload)
        if patch is not None and len(patch.dst):
            x.input_ids[torch.from_numpy(patch.dst)] = patch.prev.tokens_dev[torch.from_numpy(patch.src)]
        if self.driver is not None:
            self.driver.broadcast_payload(payload)
        logits, prompt = self._forward(x, sampling.max_num_prompt_logprobs)
        md = sampling.to_cpu_metadata()
        if bitmask is not None:
            md.token_bitmask = bitmask()  # (None when a tensor-parallel step deferred its error)
        out = self.sampler(logits, md, verification)
        out.prompt = prompt

        def host(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy()

        result = StepResult(
            token_ids=out.token_ids.numpy(),
            sampled_logprobs=host(out.sampled_logprobs),
            sampled_ranks=host(out.sampled_ranks),
            top_logprobs=host(out.top_logprobs),
            top_token_ids=host(out.top_token_ids),
            device_time_s=time.perf_counter() - t0 if self.time_device else None,
            prompt=out.prompt.map(lambda t: t.numpy()) if out.prompt is not None else None,
        )
        return StepHandle(tokens_dev=out.token_ids, out=out, host=result)

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
        self._forward(StepInputs.from_payload(header, payload))  # the logits are rank 0's

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; idempotent); nothing on one device."""
        if self.driver is not None:
            self.driver.shutdown()

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
            prompt=out.prompt.map(host) if out.prompt is not None else None,
        )
        event = self._step_event(parity)
        event.record()
        return StepHandle(tokens_dev=out.token_ids, out=out, host=host_result, event=event)

    def _step_event(self, parity: int, start: bool = False) -> torch.cuda.Event:
        """The CUDA event that ends (`start`: begins) the steps of this parity, made once: like
        the pinned token buffers, it is recorded again two steps later, once the engine has
        waited for the step that recorded it (an event's creation is host work on every step)."""
        key = (parity, start, self.time_device)
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event(enable_timing=self.time_device)
        return event

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
        self.log_kv_scales()
        return handle.host


def _check_fp8_support(device: torch.device, config: EngineConfig, model: torch.nn.Module) -> None:
    """FP8 caches and weights need e4m3 arithmetic on the GPU (compute capability 8.9+: Ada,
    Hopper and newer); elsewhere Triton cannot build the kernels, so say so before it tries."""
    capability = torch.cuda.get_device_capability(device)
    if capability >= (8, 9):
        return
    gpu = f"a GPU of compute capability 8.9 or newer (this one is sm_{capability[0]}{capability[1]})"
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs {gpu}; use kv_cache_dtype='auto'")
    if any(p.dtype == FP8_DTYPE for p in model.parameters()):
        raise ValueError(
            f"FP8 weights (an FP8 checkpoint or quantization='fp8') need {gpu}; load a 16-bit checkpoint"
        )


@contextlib.contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """Python's cyclic collector off while graphs are captured: a collection inside a capture
    can free another engine's graphs and memory (CUDA calls a capture forbids), which ends the
    capture with "operation failed due to a previous error during capture"."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _deferred_errors(fn: Callable[[], torch.Tensor], errors: list[BaseException]) -> torch.Tensor | None:
    """`fn()`, or None with its exception appended to `errors` (raised later by the caller)."""
    try:
        return fn()
    except BaseException as e:
        errors.append(e)
        return None
