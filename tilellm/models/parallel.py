"""Tensor-parallel helpers: how a dimension is split across ranks, and the collectives.

Layers receive `tp_rank, tp_size` explicitly. Collectives run on torch.distributed's default
process group (the tensor-parallel workers) and only when `tp_size > 1`, so single-device
inference never touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming `what` when it does not divide evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"need tp_size >= 1 and 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}"
        )


@dataclass(frozen=True)
class KVHeadPartition:
    """Which KV heads a rank holds. With fewer KV heads than ranks, each head is replicated on
    `tp_size // total` consecutive ranks (rank r holds head r // replicas)."""

    num_heads: int  # KV heads on this rank
    first_head: int  # index of this rank's first KV head in the checkpoint
    replicas: int  # ranks holding each KV head


def partition_kv_heads(total_kv_heads: int, tp_rank: int, tp_size: int) -> KVHeadPartition:
    check_tp(tp_rank, tp_size)
    if total_kv_heads >= tp_size:
        per_rank = divide(total_kv_heads, tp_size, "num_key_value_heads")
        return KVHeadPartition(num_heads=per_rank, first_head=tp_rank * per_rank, replicas=1)
    replicas = divide(tp_size, total_kv_heads, "tensor_parallel_size (replicating KV heads)")
    return KVHeadPartition(num_heads=1, first_head=tp_rank // replicas, replicas=replicas)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum of x over the tensor-parallel ranks (in place); identity when tp_size == 1."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (rank order); identity when tp_size == 1."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
