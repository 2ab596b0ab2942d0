"""The KV pool: how many blocks fit, and the one allocation every layer's cache is a view of.

One K and one V cache per layer, `[num_blocks, block_size, Hkv, D]`, views into one zeroed
tensor `[2, num_layers, num_blocks, block_size, Hkv, D]`; MLA models have one latent cache per
layer, `[1, num_layers, num_blocks, block_size, 1, kv_lora_rank + rope dims]`. Zeroed so that
padding rows, which read key 0 of block 0, never meet NaN garbage, and so that the Gluon
kernels' whole-page copies past a request's last key read finite values.

Sizing. On CUDA: the memory left after a profiling forward at the largest step, times
`gpu_memory_utilization`, minus the CUDA graphs' reserve (`gpu_num_blocks`). On CPU: what
`max_num_seqs` requests of `max_model_len` tokens need, within a byte budget (`cpu_num_blocks`):
a small model gets a small pool, not a fixed size. `num_kv_blocks` overrides both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CPU_POOL_BUDGET_BYTES = 2 << 30  # at most this much host memory for the KV pool on CPU
GRAPH_RESERVE_BYTES = 512 << 20  # CUDA graph pool and allocator slack, kept out of the KV pool


@dataclass(frozen=True)
class KVSpec:
    """The shape of one rank's KV cache."""

    num_layers: int
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_caches: int = 2  # per layer: K and V, or MLA's one latent cache

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer and cache."""
        return (
            self.num_caches
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.dtype.itemsize
        )

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size


@dataclass(frozen=True)
class PooledSpec:
    """Caches that share one set of block ids (a model's K/V or latent rows, DeepSeek-V3.2's
    indexer keys, a draft model's K/V): a block id then costs a block in each, and the pool is
    sized by their sum."""

    specs: tuple[KVSpec, ...]

    @property
    def block_size(self) -> int:
        return self.specs[0].block_size

    @property
    def block_bytes(self) -> int:
        return sum(s.block_bytes for s in self.specs)


def cpu_num_blocks(spec: KVSpec | PooledSpec, max_model_len: int, max_num_seqs: int) -> int:
    """Blocks for `max_num_seqs` requests of `max_model_len` tokens each (every running request
    can reach its limit), capped by CPU_POOL_BUDGET_BYTES but never below one full-length request."""
    per_seq = -(-max_model_len // spec.block_size)
    budget = max(CPU_POOL_BUDGET_BYTES // spec.block_bytes, per_seq)
    return int(min(per_seq * max_num_seqs, budget))


def gpu_num_blocks(
    spec: KVSpec | PooledSpec,
    *,
    peak_activation_bytes: int,
    gpu_memory_utilization: float,
    graph_reserve_bytes: int,
) -> int:
    """Blocks that fit in `gpu_memory_utilization` of the device, from the memory in use now
    (weights, the CUDA context, other processes) and the profiled activation peak."""
    free, total = torch.cuda.mem_get_info()
    used = total - free
    budget = total * gpu_memory_utilization - used - peak_activation_bytes - graph_reserve_bytes
    num_blocks = int(budget // spec.block_bytes)
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache: {used / 2**30:.1f} GiB in use, activations peak at "
            f"{peak_activation_bytes / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs"
        )
    logger.info(
        "KV pool: %d blocks of %d tokens (%.1f GiB); activation peak %.2f GiB",
        num_blocks,
        spec.block_size,
        num_blocks * spec.block_bytes / 2**30,
        peak_activation_bytes / 2**30,
    )
    return num_blocks


def check_fits(pool_tokens: int, max_model_len: int, *, explicit: bool) -> int:
    """The max_model_len the engine runs with. A pool that cannot hold one request of an
    explicitly asked `max_model_len` is refused (outputs would be cut short silently); a model's
    default length is capped at the pool's tokens, and the log says so."""
    if max_model_len <= pool_tokens:
        return max_model_len
    if explicit:
        raise ValueError(
            f"max_model_len ({max_model_len}) is larger than the KV pool ({pool_tokens} tokens): "
            "lower max_model_len, or give the pool more room (num_kv_blocks, gpu_memory_utilization)"
        )
    logger.warning(
        "max_model_len capped at the KV pool's %d tokens (the model allows %d)", pool_tokens, max_model_len
    )
    return pool_tokens


def allocate_kv_pool(spec: KVSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """[num_caches, num_layers, num_blocks, block_size, Hkv, D], zeroed (see the module docstring)."""
    shape = (spec.num_caches, spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return torch.zeros(shape, dtype=spec.dtype, device=device)
