"""Attention kernels in Triton and Gluon. Each has a PyTorch twin in `tilellm.kernels.reference`.

- `store_kvcache`: this step's K/V into their slots of the paged cache (slot -1 = skip);
  `concat_and_cache_mla`: MLA's rows [latent | k_pe] from their two parts.
- `prefill_attention`: packed varlen causal prefill over this step's contiguous K/V.
- `paged_attention`: any mix of prefix-cached/chunked prefill, verification and decode, K/V read
  through the block table, with split-KV segments when the batch cannot fill the GPU.
- `decode_attention`: one query per request (the q_len = 1 case of `paged_attention`).
- `cascade_decode_attention`: decode for requests sharing a prefix: the prefix read once for all.
- `sparse_attention`: each query attends to its own top-k logical positions only.
- `merge_attention_states`: combine split-KV partial outputs by their log-sum-exp.
- `mla_decode_attention`, `mla_paged_attention` (`mla.py`): DeepSeek's latent attention in the
  absorbed form over a paged cache of one row per token shared by every query head.
- `index_topk`, `store_index_keys` (`indexer.py`): DeepSeek-V3.2's lightning indexer: every
  causal key scored through the block table, the top-k per query token by an exact radix select;
  its keys stored as they are, or in e4m3 with a scale per key.
- `sparse_mla_attention` (`sparse_mla.py`): MLA over each query token's selected latent rows only.
- `fused_moe` (`moe.py`): the routed experts of an MoE layer, tokens sorted by expert into
  grouped GEMMs (gate/up with SiLU-and-mul, then down weighted by the router); FP8 experts too.
- `per_token_group_quant_fp8`, `w8a8_block_fp8_matmul` (`fp8_gemm.py`): FP8 linear layers,
  activations quantized per token and 128-channel group, then the block-scaled W8A8 GEMM;
  `w8a8_block_fp8_linear`: both in one kernel (decode steps of a few tokens).

Every kernel over the KV cache also reads an FP8 (e4m3) cache, with `k_scale` / `v_scale` (MLA:
`kv_scale`) in device memory: the store quantizes, attention dequantizes in registers (`fp8.py`).

On H100/H200 GPUs, long causal prefill batches and paged prompt chunks run `hopper.py` instead:
the same tile walk in Gluon, with FlashAttention-3's producer warp, async warpgroup MMA and
ping-pong consumers (`config.prefill_config`, `config.paged_uses_gluon` decide; everything else,
and every other GPU and the CPU interpreter, runs the Triton kernels). There too, decode over an
FP8 cache runs `decode_fp8.py` and `w8a8_block_fp8_matmul` of 1024 tokens or more
`fp8_gemm_hopper.py`, both in Gluon.

Every Triton kernel here launches through `launch.FastLaunch`: once a binary is compiled for a call's
argument specialisation, a launch skips the rest of `JITFunction.run`'s host work (21 of the 31
us a launch of a 34-argument kernel cost on an H200's host); a call site that passes a launch key
(the attention, store, merge and element-wise wrappers) skips Triton's argument binder as well.

`tilellm.kernels.schedule` reports, for a batch, the launch grid, the tiles each program visits
(full / diagonal / skipped) and the split-KV plan, for whichever of the two kernels would run.
"""

from tilellm.kernels.fp8_gemm import per_token_group_quant_fp8, w8a8_block_fp8_linear, w8a8_block_fp8_matmul
from tilellm.kernels.indexer import index_topk, store_index_keys
from tilellm.kernels.merge import merge_attention_states
from tilellm.kernels.mla import mla_decode_attention, mla_paged_attention
from tilellm.kernels.moe import fused_moe
from tilellm.kernels.paged import cascade_decode_attention, decode_attention, paged_attention
from tilellm.kernels.prefill import prefill_attention
from tilellm.kernels.sparse import sparse_attention
from tilellm.kernels.sparse_mla import sparse_mla_attention
from tilellm.kernels.store import concat_and_cache_mla, store_kvcache

__all__ = [
    "store_kvcache",
    "concat_and_cache_mla",
    "prefill_attention",
    "paged_attention",
    "decode_attention",
    "cascade_decode_attention",
    "sparse_attention",
    "merge_attention_states",
    "mla_decode_attention",
    "mla_paged_attention",
    "fused_moe",
    "index_topk",
    "store_index_keys",
    "sparse_mla_attention",
    "per_token_group_quant_fp8",
    "w8a8_block_fp8_linear",
    "w8a8_block_fp8_matmul",
]
