"""The Hopper backend (H100/H200): the Triton backend, with `tilellm.kernels.hopper`'s Gluon
kernels (FlashAttention-3's schedule) for long prefill batches and paged prompt chunks, and
`tilellm.kernels.decode_fp8`'s for decode over an FP8 cache (and verification over one, opt-in:
`config.fp8_verify_kernel`)."""

from __future__ import annotations

from tilellm.attention.backends.base import AttentionSpec
from tilellm.attention.backends.triton import TritonBackend
from tilellm.kernels.config import prefill_config


class HopperBackend(TritonBackend):
    """Where `plan_paged` / `prefill_config` pick `hopper.py` or `decode_fp8.py`, the step runs
    it; 16-bit decode, split-KV chunks, cascade and verification batches stay on `paged.py`
    (FP8 verification: `decode_fp8.py` with `TILELLM_FP8_VERIFY=gluon`)."""

    name = "hopper"
    allow_gluon = True

    def prefill_kernel(self, spec: AttentionSpec, max_seqlen_q: int) -> str:
        if spec.kv_lora_rank:  # MLA's expanded heads (192 / 128) run the portable kernel
            return "triton"
        return prefill_config(spec.head_dim, spec.dtype, max_seqlen_q).kernel
