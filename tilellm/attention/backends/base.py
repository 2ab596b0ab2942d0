"""The attention backend interface: `plan` once per step, `forward` once per layer.

A backend owns one implementation of the attention layer's kernels (`ops`: a module with the
functions of `tilellm.kernels`, or their PyTorch twins). Its `plan(metadata)` decides, from what
the host knows, how every layer of the step runs: the mode (prefill, cascade decode, decode,
paged, or a mixed step's decode + paged halves), the paged kernels' `PagedPlan`s (which kernel,
how many split-KV segments). `forward(layer, q, k, v, metadata)` stores the step's K/V and runs
what the plan says, with no planning of its own; a CUDA graph captures the plan with the kernels.

New attention families (MLA's latent cache, sparse top-k) are further backends with their own
`AttentionSpec` fields and plans.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tilellm.attention.metadata import AttentionMetadata, BatchKind
from tilellm.kernels.schedule import PagedPlan

if TYPE_CHECKING:
    from tilellm.models.layers.attention import Attention


@dataclass(frozen=True)
class AttentionSpec:
    """The attention shape every layer of a model shares (what a plan depends on)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int


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
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D] -> o [T, Hq, D], as `meta.plan` says.

        The engine installs planned metadata; metadata installed without a plan (tests, tools)
        is planned here, for this layer, on every call.
        """
        ops, plan = self.ops, meta.plan
        if plan is None:
            plan = self.plan(meta, layer.spec(q.dtype)).plan
        assert plan is not None
        k_cache, v_cache, scale = layer.k_cache, layer.v_cache, layer.scale
        if k_cache.numel() == 0:
            # Profiling pass before the pool exists: plain causal prefill over this step's K/V.
            if plan.mode != "prefill":
                raise RuntimeError("KV cache not bound: only PREFILL steps can run without it")
            return ops.prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale=scale)
        ops.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if plan.mode == "prefill":
            return ops.prefill_attention(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, scale=scale)
        if plan.mode == "cascade":
            # Requests share their first blocks: read the shared keys once for the whole batch.
            return ops.cascade_decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.cascade_prefix_len, scale=scale
            )
        if plan.mode == "decode":
            return ops.decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale=scale,
                num_splits=plan.decode, max_seqlen_k=meta.max_seqlen_k,
            )  # fmt: skip
        if plan.mode == "paged":
            return ops.paged_attention(
                q, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens, meta.max_seqlen_q,
                scale=scale, num_splits=plan.paged, max_seqlen_k=meta.max_seqlen_k,
            )  # fmt: skip
        # A mixed step: its leading one-token requests through the decode kernel (a query tile of
        # one token's heads), the others (prompt chunks, verification) through the paged kernel,
        # whose larger query tiles one-token rows would leave almost empty.
        nd = plan.num_decodes
        out = torch.empty_like(q)
        ops.decode_attention(
            q[:nd], k_cache, v_cache, meta.block_table[:nd], meta.seq_lens[:nd], scale=scale,
            num_splits=plan.decode, max_seqlen_k=meta.max_seqlen_k, out=out[:nd],
        )  # fmt: skip
        if nd < meta.seq_lens.shape[0]:
            ops.paged_attention(
                q[nd:], k_cache, v_cache, meta.block_table[nd:], plan.rest_cu_seqlens_q, meta.seq_lens[nd:],
                meta.max_seqlen_q, scale=scale, num_splits=plan.paged, max_seqlen_k=meta.max_seqlen_k,
                out=out[nd:],
            )  # fmt: skip
        return out
