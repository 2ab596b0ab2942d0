"""The attention backend interface: `plan` once per step, `forward` once per layer.

A backend owns one implementation of the attention layer's kernels (`ops`: a module with the
functions of `tilellm.kernels`, or their PyTorch twins). Its `plan(metadata)` decides, from what
the host knows, how every layer of the step runs: the mode (prefill, cascade decode, decode,
paged, or a mixed step's decode + paged halves), the paged kernels' `PagedPlan`s (which kernel,
how many split-KV segments). `forward(layer, q, k, v, metadata)` stores the step's K/V and runs
what the plan says, with no planning of its own; a CUDA graph captures the plan with the kernels.

MLA (DeepSeek's latent cache, `AttentionSpec.kv_lora_rank > 0`) shares the plan's modes and
runs through `forward_mla`: new prompts expand their latents into per-head K/V and run the
ordinary prefill kernel; every other step absorbs the key and value up-projections into the
queries and the output and attends over the cached latent rows (`mla_ops`: the
`mla_decode_attention` / `mla_paged_attention` kernels or their twins).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tilellm.attention.metadata import AttentionMetadata, BatchKind
from tilellm.kernels.config import rope_store_fused
from tilellm.kernels.fp8 import K_SCALE_RANGE, V_SCALE_RANGE, measure_kv_scale
from tilellm.kernels.schedule import PagedPlan

if TYPE_CHECKING:
    from tilellm.models.layers.attention import Attention, MLAAttention, SparseMLAAttention


@dataclass(frozen=True)
class AttentionSpec:
    """The attention shape every layer of a model shares (what a plan depends on)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    kv_lora_rank: int = 0  # MLA: the latent's width (head_dim = kv_lora_rank + rope dims); 0 = not MLA
    cache_dtype: torch.dtype | None = None  # the KV cache's dtype (None: `dtype`); FP8 or not

    @property
    def fp8_cache(self) -> bool:
        return self.cache_dtype == torch.float8_e4m3fn


@dataclass(frozen=True)
class AttentionPlan:
    """How every attention layer of one step runs.

    mode: "prefill" (causal prefill over this step's K/V), "cascade" (decode sharing a prefix),
    "decode" (one token per request), "paged" (any mix of chunks / verification over cached
    keys), "mixed" (the leading `num_decodes` one-token requests as decode, the rest as paged).
    decode / paged: the plans of the decode rows and of the multi-token rows (None when absent).
    rest_cu_seqlens_q: "mixed" only, [B - num_decodes + 1] int32 cu_seqlens_q of the paged rows.
    """

    mode: str
    decode: PagedPlan | None = None
    paged: PagedPlan | None = None
    num_decodes: int = 0
    rest_cu_seqlens_q: torch.Tensor | None = None
    prefill_kernel: str = "triton"  # "gluon" where hopper.py runs the step's prefill


class AttentionBackend:
    """One implementation of the attention layer (see the module docstring).

    Subclasses set `name` and `ops`, and may override `plan_paged` / `prefill_kernel`. A backend
    holds no per-model state: one instance serves every layer; the layer shape comes with `plan`.
    """

    name: str = "base"
    ops: types.ModuleType
    mla_ops: types.ModuleType
    fused_ops: types.ModuleType  # the element-wise ops of `ops`' kind (its `apply_rotary` stores too)

    # -- plan: once per step ------------------------------------------------------------------

    def plan_paged(
        self,
        spec: AttentionSpec,
        num_requests: int,
        max_seqlen_q: int,
        num_tokens: int,
        max_seqlen_k: int,
        *,
        is_decode: bool,
    ) -> PagedPlan | None:
        """The paged kernels' plan for `num_requests` requests (None: the kernels need none)."""
        return None

    def prefill_kernel(self, spec: AttentionSpec, max_seqlen_q: int) -> str:
        return "triton"

    def plan(self, meta: AttentionMetadata, spec: AttentionSpec) -> AttentionMetadata:
        """`meta` with this step's plan attached (host work only: no device value is read)."""
        num_reqs = int(meta.seq_lens.shape[0])
        num_tokens = int(meta.slot_mapping.shape[0])
        max_q, max_k = meta.max_seqlen_q, meta.max_seqlen_k
        if meta.kind is BatchKind.PREFILL:
            plan = AttentionPlan("prefill", prefill_kernel=self.prefill_kernel(spec, max_q))
        elif meta.kind is BatchKind.DECODE and meta.cascade_prefix_len is not None:
            plan = AttentionPlan("cascade")
        elif meta.kind is BatchKind.DECODE:
            decode = self.plan_paged(spec, num_reqs, 1, num_reqs, max_k, is_decode=True)
            plan = AttentionPlan("decode", decode=decode)
        elif meta.num_decodes == 0:
            paged = self.plan_paged(spec, num_reqs, max_q, num_tokens, max_k, is_decode=False)
            plan = AttentionPlan("paged", paged=paged)
        else:
            nd = meta.num_decodes
            decode = self.plan_paged(spec, nd, 1, nd, max_k, is_decode=True)
            paged = None
            if nd < num_reqs:
                paged = self.plan_paged(spec, num_reqs - nd, max_q, num_tokens - nd, max_k, is_decode=False)
            rest_cu = meta.cu_seqlens_q[nd:] - nd
            plan = AttentionPlan(
                "mixed", decode=decode, paged=paged, num_decodes=nd, rest_cu_seqlens_q=rest_cu
            )
        return dataclasses.replace(meta, plan=plan)

    # -- forward: once per layer --------------------------------------------------------------

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D] -> o [T, Hq, D], as `meta.plan` says.

        With `positions` [T] (a layer built with its rotary embedding), q and k arrive unrotated:
        they are rotated here, in the same launch that stores K/V into the cache where it can.
        The engine installs planned metadata; metadata installed without a plan (tests, tools)
        is planned here, for this layer, on every call.
        """
        ops, plan = self.ops, meta.plan
        if plan is None:
            plan = self.plan(meta, layer.spec(q.dtype)).plan
        assert plan is not None
        k_cache, v_cache, scale = layer.k_cache, layer.v_cache, layer.scale
        kv_scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
        stored = False
        if positions is not None:
            # Rotation and store in one launch, except before the pool exists, on an FP8 cache's
            # first step (its scales are measured on the rotated keys before the store), and
            # where the model's element-wise ops are not this backend's (the store stays ours).
            fuse = (
                k_cache.numel() > 0
                and not layer.calibrate_kv_scales
                and layer.rotary.ops is self.fused_ops
                and rope_store_fused()
            )
            kv_store = None
            if fuse:
                kv_store = dict(
                    v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping, **kv_scales
                )
            q, k = layer.rotate(q, k, positions, kv_store)
            stored = fuse
        if k_cache.numel() == 0:
            # Profiling pass before the pool exists: plain causal prefill over this step's K/V.
            if plan.mode != "prefill":
                raise RuntimeError("KV cache not bound: only PREFILL steps can run without it")
            return ops.prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale=scale)
        if layer.calibrate_kv_scales:  # an FP8 cache's first real step: scales from its K and V
            measure_kv_scale(k, layer.k_scale, K_SCALE_RANGE)
            measure_kv_scale(v, layer.v_scale, V_SCALE_RANGE)
        if not stored:
            ops.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, **kv_scales)
        if plan.mode == "prefill":
            return ops.prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale=scale)
        if plan.mode == "cascade":
            # Requests share their first blocks: read the shared keys once for the whole batch.
            return ops.cascade_decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.cascade_prefix_len, scale=scale,
                **kv_scales,
            )  # fmt: skip
        if plan.mode == "decode":
            return ops.decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale=scale,
                num_splits=plan.decode, max_seqlen_k=meta.max_seqlen_k, **kv_scales,
            )  # fmt: skip
        if plan.mode == "paged":
            return ops.paged_attention(
                q, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens, meta.max_seqlen_q,
                scale=scale, num_splits=plan.paged, max_seqlen_k=meta.max_seqlen_k, **kv_scales,
            )  # fmt: skip
        # A mixed step: its leading one-token requests through the decode kernel (a query tile of
        # one token's heads), the others (prompt chunks, verification) through the paged kernel,
        # whose larger query tiles one-token rows would leave almost empty.
        nd = plan.num_decodes
        out = torch.empty_like(q)
        ops.decode_attention(
            q[:nd], k_cache, v_cache, meta.block_table[:nd], meta.seq_lens[:nd], scale=scale,
            num_splits=plan.decode, max_seqlen_k=meta.max_seqlen_k, out=out[:nd], **kv_scales,
        )  # fmt: skip
        if nd < meta.seq_lens.shape[0]:
            ops.paged_attention(
                q[nd:], k_cache, v_cache, meta.block_table[nd:], plan.rest_cu_seqlens_q, meta.seq_lens[nd:],
                meta.max_seqlen_q, scale=scale, num_splits=plan.paged, max_seqlen_k=meta.max_seqlen_k,
                out=out[nd:], **kv_scales,
            )  # fmt: skip
        return out

    # -- MLA: once per layer ------------------------------------------------------------------

    def forward_mla(
        self,
        layer: MLAAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, Dr], latent [T, L], k_pe [T, Dr] -> o [T, H, Dv].

        Stores each token's row [latent | k_pe], then attends as `meta.plan` says: "prefill"
        expands this step's latents (`kv_b_weight` [H (Dn + Dv), L]) and runs causal prefill over
        them; every other mode runs the absorbed form over the cached rows:

            score_h(t, s) = q_nope_h(t) . (W_UK_h c_s) + q_pe_h(t) . k_pe_s
                          = [q_nope_h(t) W_UK_h | q_pe_h(t)] . [c_s | k_pe_s]
            o_h(t)        = W_UV_h (sum_s p_h(t, s) c_s)
        """
        plan = meta.plan
        if plan is None:
            plan = self.plan(meta, layer.spec(q_nope.dtype)).plan
        assert plan is not None
        num_tokens, num_heads = q_nope.shape[0], layer.num_heads
        dn, dv = layer.qk_nope_head_dim, layer.v_head_dim
        cache = layer.kv_cache
        if cache.numel() == 0 and plan.mode != "prefill":
            raise RuntimeError("KV cache not bound: only PREFILL steps can run without it")
        if cache.numel() != 0:
            self._store_mla_rows(layer, latent, k_pe, meta.slot_mapping)
        if plan.mode == "prefill":
            kv = F.linear(latent, kv_b_weight).view(num_tokens, num_heads, dn + dv)
            k_nope, v = kv.split([dn, dv], dim=-1)
            k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, num_heads, -1)), dim=-1)
            q = torch.cat((q_nope, q_pe), dim=-1)
            return self.ops.prefill_attention(
                q, k, v.contiguous(), meta.cu_seqlens_q, meta.max_seqlen_q, scale=layer.scale
            )
        w_uk, w_uv = _mla_up_projections(layer, kv_b_weight)
        q_abs = _absorb_query(q_nope, q_pe, w_uk)  # [T, H, L + Dr]
        o_latent = self._mla_attend(layer, q_abs, cache, plan, meta)  # [T, H, L]
        return _expand_output(o_latent, w_uv)  # [T, H, Dv]

    def forward_sparse_mla(
        self,
        layer: SparseMLAAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        index_k: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """DeepSeek-V3.2's sparse MLA: `forward_mla`'s inputs plus the indexer's (index_q [T, Hi,
        Di] and index_weights [T, Hi] of the new tokens, index_k [T, Di] their keys) -> [T, H, Dv].

        Stores the step's latent rows and indexer keys, picks each query token's top-k keys
        (`index_topk` scores every causal key of its request through the block table), and attends
        over those rows only, in the absorbed form (`sparse_mla_attention`), whatever the step's
        kind: prefill chunks, decode and verification alike. The profiling pass before the pool
        exists runs `forward_mla`'s dense prefill; the runner reserves the memory the selection and
        the absorbed form take beyond it (`ModelRunner._mla_reserve_bytes`).
        """
        cache, index_cache = layer.kv_cache, layer.index_cache
        if cache.numel() == 0:
            return self.forward_mla(layer, q_nope, q_pe, latent, k_pe, kv_b_weight, meta)
        ops = self.ops
        self._store_mla_rows(layer, latent, k_pe, meta.slot_mapping)
        index_scales = layer.index_scales  # an FP8 cache: e4m3 keys with a scale each
        ops.store_index_keys(index_k, index_cache, meta.slot_mapping, index_scales=index_scales)
        topk_indices = ops.index_topk(
            index_q, index_weights, index_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens,
            meta.max_seqlen_q, topk=layer.index_topk, scale=layer.index_scale, max_seqlen_k=meta.max_seqlen_k,
            index_scales=index_scales,
        )  # fmt: skip  # [T, topk] logical key positions, -1 = none
        capturing = q_nope.is_cuda and torch.cuda.is_current_stream_capturing()
        if layer.record_selection and not capturing:
            layer.last_topk_indices = topk_indices  # for the inspector: one layer, eager steps only
        w_uk, w_uv = _mla_up_projections(layer, kv_b_weight)
        q_abs = _absorb_query(q_nope, q_pe, w_uk)
        o_latent = ops.sparse_mla_attention(
            q_abs, cache, meta.block_table, meta.cu_seqlens_q, topk_indices, meta.seq_lens,
            kv_lora_rank=layer.kv_lora_rank, scale=layer.scale, kv_scale=layer.kv_scale,
        )  # fmt: skip
        return _expand_output(o_latent, w_uv)

    def _store_mla_rows(
        self, layer: MLAAttention, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Each token's row [latent | k_pe] into the layer's cache, in one launch
        (`concat_and_cache_mla`); on an FP8 cache's calibration step, its scale measured first."""
        if layer.calibrate_kv_scales:
            measure_kv_scale(torch.cat((latent, k_pe), dim=-1), layer.kv_scale, K_SCALE_RANGE)
        self.ops.concat_and_cache_mla(latent, k_pe, layer.kv_cache, slot_mapping, kv_scale=layer.kv_scale)

    def _mla_attend(
        self,
        layer: MLAAttention,
        q: torch.Tensor,
        cache: torch.Tensor,
        plan: AttentionPlan,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        ops, rank, scale, kv_scale = self.mla_ops, layer.kv_lora_rank, layer.scale, layer.kv_scale
        if plan.mode in ("decode", "cascade"):  # a shared prefix is no cheaper: one row serves all heads
            return ops.mla_decode_attention(
                q, cache, meta.block_table, meta.seq_lens, kv_lora_rank=rank, scale=scale,
                num_splits=plan.decode, max_seqlen_k=meta.max_seqlen_k, kv_scale=kv_scale,
            )  # fmt: skip
        if plan.mode == "paged":
            return ops.mla_paged_attention(
                q, cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens, meta.max_seqlen_q,
                kv_lora_rank=rank, scale=scale, num_splits=plan.paged, max_seqlen_k=meta.max_seqlen_k,
                kv_scale=kv_scale,
            )  # fmt: skip
        nd = plan.num_decodes
        out = q.new_empty(q.shape[0], q.shape[1], rank)
        ops.mla_decode_attention(
            q[:nd], cache, meta.block_table[:nd], meta.seq_lens[:nd], kv_lora_rank=rank, scale=scale,
            num_splits=plan.decode, max_seqlen_k=meta.max_seqlen_k, out=out[:nd], kv_scale=kv_scale,
        )  # fmt: skip
        if nd < meta.seq_lens.shape[0]:
            ops.mla_paged_attention(
                q[nd:], cache, meta.block_table[nd:], plan.rest_cu_seqlens_q, meta.seq_lens[nd:],
                meta.max_seqlen_q, kv_lora_rank=rank, scale=scale, num_splits=plan.paged,
                max_seqlen_k=meta.max_seqlen_k, out=out[nd:], kv_scale=kv_scale,
            )  # fmt: skip
        return out


def _mla_up_projections(layer: MLAAttention, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H (Dn + Dv), L] as each head's W_UK [H, Dn, L] and W_UV [H, Dv, L] (views)."""
    dn, dv = layer.qk_nope_head_dim, layer.v_head_dim
    w_kv_b = kv_b_weight.view(layer.num_heads, dn + dv, layer.kv_lora_rank)
    return w_kv_b[:, :dn], w_kv_b[:, dn:]


def _absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[q_nope_h W_UK_h | q_pe_h] for every head: q_nope [T, H, Dn], q_pe [T, H, Dr] -> [T, H, L + Dr]."""
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
    return torch.cat((q_latent, q_pe), dim=-1)


def _expand_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Each head's latent output through its W_UV: [T, H, L] -> [T, H, Dv]."""
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
