"""Tensor-parallel linear and embedding layers (Megatron/vLLM layout).

Each layer takes `tp_rank, tp_size` (default 0, 1) and holds only its rank's shard. Loading goes
through the layer's `weight_loader(param, src, shard_id=None)`, where `src` is a checkpoint tensor
or a lazy `safetensors` slice (anything with `get_shape()` or `.shape` that can be sliced): a rank
reads only the rows/columns it owns.

- ColumnParallelLinear: W [out, in] split by output rows; no communication (optionally gather).
- MergedColumnParallelLinear: several column-parallel outputs in one matmul (gate_up_proj);
  each checkpoint matrix is a shard_id 0, 1, ...
- QKVParallelLinear: q/k/v in one matmul (qkv_proj), split by heads; shard_id "q", "k", "v".
  KV heads are replicated when there are fewer KV heads than ranks.
- ReplicatedLinear: the whole W on every rank (small projections such as MLA's down-projections).
- RowParallelLinear: W split by input columns; partial sums all-reduced, then the bias added.
- VocabParallelEmbedding: vocab rows split across ranks; out-of-range ids give 0, then all-reduce.
- ParallelLMHead: vocab-split logits, all-gathered along the vocab dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tilellm.models.parallel import all_gather_last_dim, all_reduce, check_tp, divide, partition_kv_heads

WeightSource = Any  # torch.Tensor or a safetensors slice (`safe_open(...).get_slice(name)`)


def source_shape(src: WeightSource) -> tuple[int, ...]:
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def read_slice(src: WeightSource, dim: int, start: int, length: int) -> torch.Tensor:
    """src narrowed to [start, start + length) along dim 0 or 1, read from disk only for that part."""
    index = (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
    return torch.as_tensor(src[index])


def read_all(src: WeightSource) -> torch.Tensor:
    return torch.as_tensor(src[:]) if len(source_shape(src)) > 0 else torch.as_tensor(src[()])


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, src: WeightSource, shard_id: Any = None) -> None:
    """Replicated parameter (norm weights, ...): the whole checkpoint tensor."""
    if shard_id is not None:
        raise ValueError(f"unexpected shard_id {shard_id!r} for a replicated parameter")
    copy_checked(param, read_all(src), "replicated parameter")


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _LinearBase(nn.Module):
    """y = x W^T (+ b) with this rank's W [out_per_rank, in_per_rank]."""

    # the shard ids each parameter is loaded from (one checkpoint tensor per id)
    shard_ids: tuple = (None,)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_features, out_features  # this rank's sizes
        self.weight = _new_param(out_features, in_features)
        self.bias = _new_param(out_features) if bias else None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}"
        )


class ColumnParallelLinear(_LinearBase):
    """Output features split across ranks: rank r holds rows [r*out/tp, (r+1)*out/tp) of W."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        gather_output: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__(input_size, divide(output_size, tp_size, "output size"), bias, tp_rank, tp_size)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        n = param.shape[0]
        copy_checked(param, read_slice(src, 0, self.tp_rank * n, n), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return all_gather_last_dim(y, self.tp_size) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several checkpoint matrices concatenated (e.g. [gate | up])."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        # per-rank widths, checked to divide evenly
        shard_sizes = [divide(s, tp_size, f"output size {i}") for i, s in enumerate(output_sizes)]
        super().__init__(input_size, sum(output_sizes), bias, tp_rank=tp_rank, tp_size=tp_size)
        self.output_sizes, self.shard_sizes = list(output_sizes), shard_sizes
        self.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shard_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in 0..{len(self.shard_sizes) - 1}")
        n = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        copy_checked(param.narrow(0, offset, n), read_slice(src, 0, self.tp_rank * n, n), f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """[q | k | v] projections in one matmul, split by heads. Output per rank:
    [num_heads * head_dim | num_kv_heads * head_dim | num_kv_heads * head_dim]."""

    shard_ids = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        kv_part = partition_kv_heads(total_num_kv_heads, tp_rank, tp_size)
        per_rank_out = (num_heads + 2 * kv_part.num_heads) * head_dim
        super().__init__(hidden_size, per_rank_out * tp_size, bias, tp_rank=tp_rank, tp_size=tp_size)
        self.head_dim, self.num_heads, self.kv_part = head_dim, num_heads, kv_part
        self.num_kv_heads = kv_part.num_heads
        self.q_size = num_heads * head_dim
        self.kv_size = kv_part.num_heads * head_dim

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, n, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            n, start = self.kv_size, self.kv_part.first_head * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(param.narrow(0, offset, n), read_slice(src, 0, start, n), f"shard {shard_id!r}")


class ReplicatedLinear(_LinearBase):
    """y = x W^T (+ b) with the whole W on every rank; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, 0, 1)

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"ReplicatedLinear takes no shard_id, got {shard_id!r}")
        copy_checked(param, read_all(src), "ReplicatedLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_LinearBase):
    """Input features split across ranks: rank r holds columns [r*in/tp, (r+1)*in/tp) of W.
    The bias (replicated) is added once, after the all-reduce of the partial products."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        reduce_results: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__(divide(input_size, tp_size, "input size"), output_size, bias, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard_id, got {shard_id!r}")
        if param is self.bias:
            copy_checked(param, read_all(src), "bias")
            return
        n = param.shape[1]
        copy_checked(param, read_slice(src, 1, self.tp_rank * n, n), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_results:
            y = all_reduce(y, self.tp_size)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocab rows: rank r holds ids [r*V_r, (r+1)*V_r), V_r = ceil(V/tp).
    The last rank's rows past the vocab are zero padding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = _new_param(self.rows_per_rank, embedding_dim)

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        shape = source_shape(src)
        if shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor has shape {shape}, "
                f"expected {(self.num_embeddings, self.embedding_dim)}"
            )
        n = self.vocab_end - self.vocab_start
        copy_checked(param[:n], read_slice(src, 0, self.vocab_start, n), type(self).__name__)
        with torch.no_grad():
            param[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.tp_size)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """LM head with the vocab split like VocabParallelEmbedding (so tied weights shard alike).

    forward(hidden [N, H]) -> logits [N, V] in the weight dtype (each rank gets the full vocab).
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits, self.tp_size)[..., : self.num_embeddings]
        return logits
