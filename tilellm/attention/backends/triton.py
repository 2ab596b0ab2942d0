"""The portable Triton backend: `tilellm.kernels` (`prefill.py`, `paged.py`) on any GPU, and
under Triton's interpreter on CPU."""

from __future__ import annotations

import tilellm.kernels as triton_ops
import tilellm.kernels.fused as triton_fused_ops
import tilellm.kernels.mla as triton_mla_ops
from tilellm.attention.backends.base import AttentionBackend, AttentionSpec
from tilellm.kernels.mla import MlaPlan, plan_mla
from tilellm.kernels.schedule import PagedPlan, plan_paged


class TritonBackend(AttentionBackend):
    """Plans with `tilellm.kernels.schedule.plan_paged` once per step; every layer reuses it."""

    name = "triton"
    ops = triton_ops
    mla_ops = triton_mla_ops
    fused_ops = triton_fused_ops
    allow_gluon = False

    def plan_paged(
        self,
        spec: AttentionSpec,
        num_requests: int,
        max_seqlen_q: int,
        num_tokens: int,
        max_seqlen_k: int,
        *,
        is_decode: bool,
    ) -> PagedPlan | MlaPlan:
        s = spec
        if s.kv_lora_rank:
            return plan_mla(
                num_requests, s.num_heads, max_seqlen_q, max_seqlen_k, s.dtype, s.block_size,
                kv_lora_rank=s.kv_lora_rank, rope_dim=s.head_dim - s.kv_lora_rank, cache_dtype=s.cache_dtype,
            )  # fmt: skip
        return plan_paged(
            num_requests, s.num_heads, s.num_kv_heads, s.head_dim, s.dtype, s.block_size, max_seqlen_q,
            num_tokens=num_tokens, max_seqlen_k=max_seqlen_k, is_decode=is_decode,
            allow_gluon=self.allow_gluon, kv_fp8=s.fp8_cache,  # FP8 pages: Triton's kernel, its own rule
        )  # fmt: skip
