"""The draft model of speculative decoding (`speculative_config={"method": "draft_model", ...}`).

    draft = DraftRunner(config, device, dtype, target_vocab_size)   # load; KV spec for pool sizing
    draft.bind_kv_pool(num_blocks)                                  # its own cache, the same block ids
    proposal = draft.propose(requests, block_tables)                # k draft tokens per request

The draft model keeps its own K/V cache over the target's block ids: block b of a sequence holds
the target's K/V in the target's cache and the draft's in this one, so one block table and one
slot mapping serve both and the block manager needs to know nothing of the draft. Its cache is
filled lazily: when a sequence drafts, the draft model first computes the tokens it has not
seen (the whole prompt the first time, afterwards the one or two tokens the last verification
emitted), then runs one decode step per further draft token (replayed from its own CUDA graphs
on the GPU, `capture_graphs`). Which of its K/V are valid is
tracked per sequence (`DraftState`); what it writes for rejected tokens is overwritten later,
like the target's.

Correctness never depends on the draft: verification decides every emitted token. The draft's
tokens are its argmax for greedy requests; for sampled requests they are drawn from its
temperature-scaled distribution `q` (kept on the device for the rejection sampler,
`tilellm.worker.rejection`), with noise of their own seeded stream so that seeded requests stay
reproducible.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from tilellm.attention import attention_context, get_attention_backend
from tilellm.config import EngineConfig
from tilellm.kernels.fp8 import FP8_DTYPE, kv_cache_torch_dtype
from tilellm.kernels.sampling import device_row_keys, gumbel_noise
from tilellm.worker import kv_pool
from tilellm.worker.cuda_graphs import DecodeGraphs
from tilellm.worker.kv_scales import KVScales, bind_kv_cache
from tilellm.worker.step_inputs import StepInputs, build_step_inputs

logger = logging.getLogger(__name__)

DRAFT_STREAM = 0x5BD1E995  # xor-ed into a request's seed key: the draft's own noise stream


@dataclass
class DraftRequest:
    """One sequence to draft for. `token_ids[:-1]` all have target K/V; the draft's first token
    follows `token_ids[-1]` (at position len(token_ids)). `num_computed`: leading tokens whose
    draft K/V is valid. `row`: its block-table row. Sampling: greedy, or 1/temperature, the seed
    key and the output index of the first draft token (its noise counter)."""

    token_ids: list[int]
    num_computed: int
    num_drafts: int
    row: int
    greedy: bool
    inv_temp: float
    seed_key: int
    step: int


@dataclass
class DraftProposal:
    """Draft tokens per request (host lists), the draft K/V now valid per request, and for the
    rejection sampler `probs`: [M, V] float32 on the device, the draft distribution of every draft
    token, request-major (None when every request is greedy)."""

    token_ids: list[list[int]]
    num_computed: list[int]
    probs: torch.Tensor | None


class DraftRunner:
    """Loads the draft model and runs its steps (see the module docstring)."""

    def __init__(
        self, config: EngineConfig, device: torch.device, dtype: torch.dtype, target_vocab_size: int
    ):
        from tilellm.models.loader import kv_caches_per_layer, load_model, model_kv_spec

        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        self.device = device
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        try:
            self.model, self.hf_config = load_model(
                spec.model,
                dtype=str(dtype).removeprefix("torch."),
                device=device,
                attention_backend=config.attention_backend,
                fused_ops_backend=config.fused_ops_backend,
                load_format="safetensors",
                seed=config.seed,
            )
        except torch.OutOfMemoryError:
            raise ValueError(
                f"speculative_config.model: the draft model {spec.model} does not fit in the device's memory"
            ) from None
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        vocab = int(self.hf_config.vocab_size)
        if vocab != target_vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft model's vocabulary ({vocab} tokens) differs "
                f"from the target's ({target_vocab_size}); a draft must share the target's tokenizer"
            )
        self.vocab_size = vocab
        num_layers, num_kv_heads, head_dim = model_kv_spec(self.hf_config, 1)
        # The target's kv_cache_dtype: an FP8 target cache gets an FP8 draft cache, scales of its own.
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
        num_caches = kv_caches_per_layer(self.hf_config)
        block = config.block_size
        self.kv_spec = kv_pool.KVSpec(num_layers, num_kv_heads, head_dim, block, self.kv_dtype, num_caches)
        layer0 = self.model.attention_layers()[0]
        self.attn_backend = get_attention_backend(config.attention_backend, device)
        self.attn_spec = dataclasses.replace(
            layer0.spec(dtype), block_size=config.block_size, cache_dtype=self.kv_dtype
        )
        self.fp8_scales: KVScales | None = None
        self.max_model_len = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0) or None
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of its decode steps (`capture_graphs`)

    def bind_kv_pool(self, num_blocks: int) -> None:
        self.kv_cache = kv_pool.allocate_kv_pool(self.kv_spec, num_blocks, self.device)
        layers = self.model.attention_layers()
        if self.kv_dtype == FP8_DTYPE:  # measured on its first real step (a catch-up, eager)
            self.fp8_scales = KVScales(layers, self.kv_spec.num_caches, self.device, "the draft model")
        bind_kv_cache(layers, self.kv_cache, self.fp8_scales)

    def capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int, sync) -> None:
        """CUDA graphs of the draft model's decode steps, per batch-size bucket as the target's
        (`DecodeGraphs`); a failed capture leaves its decode steps eager."""
        graphs = DecodeGraphs(
            self.device,
            max_num_seqs,
            max_blocks_per_seq,
            max_model_len,
            forward=self._forward_all_rows,
            decode_splits=self._decode_splits,
        )
        try:
            graphs.capture(sync, enable_cascade=False)
        except Exception:
            logger.exception("draft model graph capture failed: its decode steps run eagerly")
            graphs.clear()
            torch.cuda.synchronize()
        self.graphs = graphs if graphs else None

    def _decode_splits(self, num_reqs: int, max_seqlen_k: int) -> int:
        plan = self.attn_backend.plan_paged(
            self.attn_spec, num_reqs, 1, num_reqs, max_seqlen_k, is_decode=True
        )
        return 1 if plan is None else plan.num_splits

    def _forward_all_rows(self, x: StepInputs) -> torch.Tensor:
        """Logits [T, V] of every row (what a decode graph captures)."""
        with attention_context(self.attn_backend.plan(x.attention_metadata(), self.attn_spec)):
            hidden = self.model(x.input_ids, x.positions)
        return self.model.compute_logits(hidden)

    # -- drafting ---------------------------------------------------------------------------

    def _forward(self, x: StepInputs) -> torch.Tensor:
        """Float32 logits [N, V] of the step's sampled rows."""
        measuring = self.fp8_scales.measuring() if self.fp8_scales is not None else nullcontext()
        with attention_context(self.attn_backend.plan(x.attention_metadata(), self.attn_spec)), measuring:
            hidden = self.model(x.input_ids, x.positions)
        return self.model.compute_logits(hidden[x.logits_indices]).float()

    def _to_device(self, x: StepInputs) -> StepInputs:
        header = x.header()
        return StepInputs.from_payload(header, torch.from_numpy(x.to_words(header)).to(self.device))

    def _step(
        self,
        token_ids: list[list[int]],
        starts: list[int],
        q_lens: list[int],
        rows: list[int],
        tables: np.ndarray,
    ) -> torch.Tensor:
        x = build_step_inputs(
            token_ids, starts, q_lens, rows, [True] * len(rows), tables, self.block_size, cascade=False
        )
        return self._forward(self._to_device(x))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], block_tables: np.ndarray) -> DraftProposal:
        """Draft `num_drafts` tokens for each request; the K/V it writes land in slots the
        scheduler has already allocated (the verification step's)."""
        n = len(requests)
        dev = self.device
        greedy = torch.tensor([r.greedy for r in requests], device=dev)
        all_greedy = bool(greedy.all())
        inv_temp = torch.tensor([r.inv_temp for r in requests], dtype=torch.float32, device=dev)
        keys = torch.tensor([r.seed_key ^ DRAFT_STREAM for r in requests], dtype=torch.int64, device=dev)
        steps = torch.tensor([r.step for r in requests], dtype=torch.int64, device=dev)
        drafts: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]

        # Catch-up: every token the draft has not seen, the last one's logits draft token 0. In
        # chunks of at most max_num_batched_tokens tokens (the activations the pool was sized for).
        todo = list(range(n))
        logits = torch.empty(n, self.vocab_size, device=dev)
        progress = [r.num_computed for r in requests]
        while todo:
            batch, budget = [], self.max_num_batched_tokens
            for i in todo:
                if budget <= 0:
                    break
                batch.append((i, min(len(requests[i].token_ids) - progress[i], budget)))
                budget -= batch[-1][1]
            out = self._step(
                [requests[i].token_ids for i, _ in batch],
                [progress[i] for i, _ in batch],
                [q for _, q in batch],
                [requests[i].row for i, _ in batch],
                block_tables,
            )
            done_rows = []
            for k, (i, q) in enumerate(batch):
                progress[i] += q
                if progress[i] == len(requests[i].token_ids):
                    done_rows.append((i, k))
            if done_rows:
                idx = torch.tensor([i for i, _ in done_rows], device=dev)
                logits[idx] = out[torch.tensor([k for _, k in done_rows], device=dev)]
            todo = [i for i in todo if progress[i] < len(requests[i].token_ids)]

        active = list(range(n))
        for j in range(max(r.num_drafts for r in requests)):
            act = torch.tensor(active, device=dev)
            tokens = self._sample(
                logits, greedy[act], all_greedy, inv_temp[act], keys[act], steps[act] + j, probs, active
            )
            host = tokens.tolist()
            for i, t in zip(active, host):
                drafts[i].append(t)
            active = [i for i in active if len(drafts[i]) < requests[i].num_drafts]
            if not active:
                break
            # One decode step: each active request's newest draft token at its position.
            starts = [len(requests[i].token_ids) + j for i in active]
            logits = self._decode(active, drafts, starts, requests, block_tables)

        num_computed = [len(r.token_ids) + r.num_drafts - 1 for r in requests]
        q = None
        if not all_greedy:
            q = torch.cat([torch.stack(p) for p in probs if p]) if any(probs) else None
        return DraftProposal(drafts, num_computed, q)

    def _decode(
        self,
        active: list[int],
        drafts: list[list[int]],
        starts: list[int],
        requests: list[DraftRequest],
        tables: np.ndarray,
    ) -> torch.Tensor:
        """Logits of one decode step: request i's newest draft token at position starts[k]."""
        x = build_step_inputs(
            None, starts, [1] * len(active), [requests[i].row for i in active], [True] * len(active),
            tables, self.block_size, cascade=False,
        )  # fmt: skip
        x.input_ids = np.asarray([drafts[i][-1] for i in active], dtype=np.int64)
        bucket = self.graphs.bucket(len(active)) if self.graphs is not None else None
        if bucket is not None:
            return self.graphs.replay(self._to_device(x.padded_to(bucket))).float()
        return self._forward(self._to_device(x))

    def _sample(
        self,
        logits: torch.Tensor,
        greedy: torch.Tensor,
        all_greedy: bool,
        inv_temp: torch.Tensor,
        keys: torch.Tensor,
        steps: torch.Tensor,
        probs: list[list[torch.Tensor]],
        active: list[int],
    ) -> torch.Tensor:
        """Draft tokens [A] of the active requests; records q of the sampled requests' rows."""
        best = logits.argmax(dim=-1)
        if all_greedy:
            return best
        scaled = logits * inv_temp[:, None]
        drawn = (scaled + gumbel_noise(device_row_keys(keys, steps), logits.shape[1])).argmax(dim=-1)
        q = torch.softmax(scaled, dim=-1)
        for k, i in enumerate(active):
            probs[i].append(q[k])
        return torch.where(greedy, best, drawn)
