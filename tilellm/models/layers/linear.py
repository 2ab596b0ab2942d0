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

A linear layer's `quant_method` holds and applies its weight (vLLM's pattern): `LinearMethod`
(the plain weight, `F.linear`) unless `tilellm.models.quantization` switched the layer to FP8
(an e4m3 `weight` and fp32 block scales `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]). Every
layer says where each checkpoint tensor lands (`shard_layout`), and the loader places the
weight, the bias and the block scales by it: q/k/v and gate/up offsets and tensor-parallel
slices in rows, or in blocks of bn rows for the scales (RowParallelLinear's columns in blocks of
bk), every shard on whole blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tilellm.kernels.fused import rms_norm as fused_rms_norm
from tilellm.kernels.gemv import gemv_enabled, gemv_fuses_norm
from tilellm.kernels.pdl import pdl_enabled
from tilellm.kernels.skinny import (
    SKINNY_MAX_ROWS,
    skinny_linear,
    skinny_linear_silu_and_mul,
    skinny_rms_norm_linear,
)
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
    """dst <- src, shapes equal. An FP8 tensor goes only into an FP8 parameter and back: a cast
    either way would drop its scales silently."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    if (dst.dtype == torch.float8_e4m3fn) != (src.dtype == torch.float8_e4m3fn):
        raise ValueError(
            f"{what}: checkpoint tensor is {src.dtype} but the parameter is {dst.dtype} (is the layer "
            "missing from, or wrongly in, quantization_config's modules_to_not_convert?)"
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


# -- where a checkpoint tensor lands ----------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """Where one checkpoint tensor of a linear layer lands in this rank's weight: `size` rows
    (dim 0) or columns (dim 1), read from `src_start` of a checkpoint tensor that has `src_size`
    of them, written at `dst_start`. A block-scale tensor takes the same layout in block units."""

    dim: int
    dst_start: int
    src_start: int
    size: int
    src_size: int


def is_block_aligned(start: int, size: int, extent: int, block: int) -> bool:
    """Whether rows [start, start + size) of a matrix of `extent` rows are whole blocks of `block`
    rows: they start on a block and end on one or at the matrix's end (whose block may be partial)."""
    return start % block == 0 and (size % block == 0 or start + size == extent)


def block_span(
    start: int, size: int, extent: int, block: int, what: str, axis: str = "rows"
) -> tuple[int, int]:
    """Rows (or columns: `axis`) [start, start + size) of a matrix of `extent` -> (first block,
    number of blocks) of `block` each; a ValueError naming `what` unless `is_block_aligned`."""
    if not is_block_aligned(start, size, extent, block):
        raise ValueError(
            f"{what}: its {size} {axis} at {start} (of {extent}) are not aligned to the FP8 block of "
            f"{block}; every shard must start on a block and end on one or at the matrix's end"
        )
    return start // block, -(-size // block)


def _check_extent(src: WeightSource, layout: ShardLayout, what: str) -> None:
    shape = source_shape(src)
    if len(shape) <= layout.dim or shape[layout.dim] != layout.src_size:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {shape}, expected {layout.src_size} along dim {layout.dim}"
        )


def check_input_scale_value(value: torch.Tensor, what: str) -> float:
    """A checkpoint's `input_scale` tensor -> its one value, which must be positive and finite."""
    if value.numel() != 1:
        raise ValueError(f"{what}: input_scale must hold one number, got shape {tuple(value.shape)}")
    v = float(value.reshape(()).float())
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{what}: input_scale must be a positive finite number, got {v}")
    return v


def input_scale_param(*shape: int, device: torch.device) -> nn.Parameter:
    """A static activation scale to be loaded (fp32; `is_input_scale` tells the dummy filler)."""
    p = nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)
    p.keep_fp32 = True  # type: ignore[attr-defined]
    p.is_input_scale = True  # type: ignore[attr-defined]
    return p


def reduce_input_scale(scale: torch.Tensor) -> nn.Parameter:
    """Per-shard (or per-expert) static input scales -> their largest, [1] fp32: the shards of a
    merged layer (the experts of a MoE layer) read the same input, quantized once (vLLM's rule)."""
    return nn.Parameter(scale.detach().amax().reshape(1).float(), requires_grad=False)


# -- how a layer holds and applies its weight ------------------------------------------------


@dataclass(frozen=True)
class QuantizedActivation:
    """A linear layer's input already quantized to FP8 per token and group by the op before it
    (`RMSNorm.forward(..., quant_for=layer)`, `SiluAndMul.forward(..., quant_for=layer)`):
    x_q [T, K] float8_e4m3fn, x_s [T, K / group] float32 in the layout the layer asked for
    (`LinearBase.input_group_quant`: strides (1, T) when `column_major_scales`), and the dtype of
    the unquantized input, which the layer's output takes."""

    x_q: torch.Tensor
    x_s: torch.Tensor
    column_major_scales: bool
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.x_q.shape


@dataclass(frozen=True)
class NormedActivation:
    """A linear layer's input as the RMSNorm before it left it, not yet normalised: the layer runs
    the norm in its own launch (`skinny_rms_norm_linear`), on the steps where it says it can
    (`LinearMethod.takes_normed_input`: one row in 16 bits on a CUDA device, up to
    `gemv.GEMV_MAX_ROWS` with `TILELLM_GEMV=1`, or a few tokens under PDL).

    x [T, H] and, when the norm adds the residual stream first, residual [T, H] and residual_out
    [T, H], which the layer's launch fills with x + residual (the norm returned it to the decoder
    already; it is read only by later launches on the same stream). norm_weight [H], eps: the
    norm's."""

    x: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def normalised(self) -> torch.Tensor:
        """The norm in a launch of its own (residual_out filled), for a layer that takes it after
        all: rms_norm(x + residual) [T, H]."""
        if self.residual is None:
            return fused_rms_norm(self.x, self.norm_weight, self.eps)
        y, h = fused_rms_norm(self.x, self.norm_weight, self.eps, residual=self.residual)
        self.residual_out.copy_(h)
        return y


# what a linear layer takes as its input: the activation itself, quantized, or not yet normalised
LayerInput = torch.Tensor | QuantizedActivation | NormedActivation


class LinearMethod:
    """How a linear layer holds and applies its weight (vLLM's `LinearMethodBase`). This one: the
    plain `weight` [out, in] in the model dtype; `tilellm.models.quantization.Fp8LinearMethod`
    holds it in FP8 with block scales (`weight_scale_inv`)."""

    # (bn, bk): the weight's block of one `weight_scale_inv` entry; None when it has no scales
    block_size: tuple[int, int] | None = None

    def apply(self, layer: LinearBase, x: LayerInput, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> x W^T (+ bias) [..., out]: this rank's part, before any collective.

        cuBLAS, except `skinny_linear` on steps of up to `gemv_max_rows` tokens in 16 bits on a
        CUDA device (one, or up to `GEMV_MAX_ROWS` with `TILELLM_GEMV=1`: `gemv.py`'s kernels,
        each program of which loads its weight tile at once) and on steps of up to
        `SKINNY_MAX_ROWS` tokens under programmatic dependent launch (`TILELLM_PDL=1`: it streams
        the weight while the kernel before runs; cuBLAS's kernels do not take part in PDL); there
        a `NormedActivation` is normalised in the same launch (`skinny_rms_norm_linear`)."""
        y = self._apply_skinny(layer, x, bias, silu_and_mul=False)
        if y is not None:
            return y
        if isinstance(x, NormedActivation):  # (a step that runs cuBLAS after all)
            x = x.normalised()
        return F.linear(x, layer.weight, bias)

    def apply_silu_and_mul(
        self, layer: LinearBase, x: LayerInput, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(gate) * up of a merged [gate | up] layer in one launch, [..., out / 2]: the same
        bits as `apply` then `silu_and_mul`; or None where this step has no such launch (then the
        caller runs the two). Served where `apply` runs `skinny_linear` (`gemv.py`, or PDL)."""
        return self._apply_skinny(layer, x, bias, silu_and_mul=True)

    def takes_normed_input(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether this layer runs the RMSNorm before it in its own launch for input x [T, H]
        (the norm then hands it a `NormedActivation`): where `apply` runs `skinny_linear`, on
        `gemv.py`'s kernels where a row fits their tile (`gemv_fuses_norm`)."""
        kernel = self._row_kernel(layer, x)
        if kernel == "gemv":  # (where its tile cannot, skinny.py's kernel takes the norm under PDL)
            rows = x.numel() // max(1, x.shape[-1])
            return gemv_fuses_norm(rows, x.shape[-1]) or pdl_enabled(x.device)
        return kernel == "skinny"

    def _apply_skinny(
        self, layer: LinearBase, x: LayerInput, bias: torch.Tensor | None, silu_and_mul: bool
    ) -> torch.Tensor | None:
        """The step on `skinny.py`'s kernel (the norm of a `NormedActivation` and, with
        `silu_and_mul`, the activation in the same launch), or None where it runs cuBLAS."""
        if isinstance(x, QuantizedActivation):
            return None
        t = x.x if isinstance(x, NormedActivation) else x
        if self._row_kernel(layer, t) is None:
            return None
        if isinstance(x, NormedActivation):
            out = skinny_rms_norm_linear(
                x.x, x.norm_weight, x.eps, layer.weight, bias, residual=x.residual,
                residual_out=x.residual_out, silu_and_mul=silu_and_mul,
            )  # fmt: skip
            return out if x.residual is None else out[0]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = (skinny_linear_silu_and_mul if silu_and_mul else skinny_linear)(x2, layer.weight, bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def _row_kernel(layer: LinearBase, x: torch.Tensor) -> str | None:
        """Which of `skinny.py`'s wrappers' kernels a step on input x [..., in] runs, the weight
        in x's dtype: "gemv" for up to `gemv_max_rows` rows in 16 bits on a CUDA device (one
        unless `TILELLM_GEMV` says otherwise), "skinny" for up to SKINNY_MAX_ROWS rows under PDL;
        None: cuBLAS."""
        if x.dtype != layer.weight.dtype:
            return None
        rows = x.numel() // max(1, x.shape[-1])
        if gemv_enabled(x.device, rows, x.dtype):
            return "gemv"
        return "skinny" if rows <= SKINNY_MAX_ROWS and pdl_enabled(x.device) else None

    def input_group_quant(self, layer: LinearBase, num_tokens: int) -> tuple[int, bool] | None:
        """(group_size, column_major_scales) where a step of `num_tokens` tokens quantizes this
        layer's input per token and group in a launch of its own, which the op before it can
        take over (handing `apply` a `QuantizedActivation`); else None. A 16/32-bit layer: None."""
        return None

    def process_weights_after_loading(self, layer: LinearBase, dtype: torch.dtype) -> None:
        """Runs once every checkpoint tensor has been loaded; `dtype` is the model's."""


UNQUANTIZED = LinearMethod()


class LinearBase(nn.Module):
    """y = x W^T (+ b) with this rank's W [out_per_rank, in_per_rank].

    `shard_layout(shard_id)` says where each checkpoint tensor lands; `weight_loader` follows it
    for the weight and the bias and, for an FP8 layer, for `weight_scale_inv` in block units.
    """

    # the shard ids each parameter is loaded from (one checkpoint tensor per id)
    shard_ids: tuple = (None,)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_features, out_features  # this rank's sizes
        self.weight = _new_param(out_features, in_features)
        self.bias = _new_param(out_features) if bias else None
        self.quant_method: LinearMethod = UNQUANTIZED
        # per-tensor FP8 checkpoints: shard id -> (its layout, its scalar weight_scale), until the
        # quant method turns them into block scales after loading
        self.per_tensor_scales: dict[Any, tuple[ShardLayout, float]] = {}

    def shard_layout(self, shard_id: Any = None) -> ShardLayout:
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        layout = self.shard_layout(shard_id)
        what = type(self).__name__ if shard_id is None else f"shard {shard_id!r}"
        if param is self.bias and layout.dim == 1:  # a row-parallel layer's bias is whole on every rank
            copy_checked(param, read_all(src), "bias")
            return
        if param is getattr(self, "weight_scale_inv", None):
            self._load_weight_scale(param, src, layout, shard_id, what)
            return
        if param is getattr(self, "input_scale", None):  # a static activation scale, one per shard
            value = check_input_scale_value(read_all(src), what)
            with torch.no_grad():
                param[self.shard_ids.index(shard_id)] = value
            return
        _check_extent(src, layout, what)
        dst = param.narrow(layout.dim, layout.dst_start, layout.size)
        copy_checked(dst, read_slice(src, layout.dim, layout.src_start, layout.size), what)

    def _load_weight_scale(
        self, param: nn.Parameter, src: WeightSource, layout: ShardLayout, shard_id: Any, what: str
    ) -> None:
        """A block checkpoint's `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]: the blocks of this
        shard's rows (columns), which must fall on whole blocks; a per-tensor checkpoint's scalar
        `weight_scale`: kept for `process_weights_after_loading`."""
        shape = source_shape(src)
        what = f"{what} weight scale"
        if len(shape) <= 1 and math.prod(shape) == 1:
            self.per_tensor_scales[shard_id] = (layout, float(read_all(src).reshape(())))
            return
        bn, bk = self.quant_method.block_size  # type: ignore[misc]  # set with weight_scale_inv
        dim, block = layout.dim, (bn, bk)[layout.dim]
        extent = (self.out_features, self.in_features)[dim]
        axis = ("rows", "columns")[dim]
        dst_first, count = block_span(layout.dst_start, layout.size, extent, block, what, axis)
        src_first, _ = block_span(layout.src_start, layout.size, layout.src_size, block, what, axis)
        expected = list(param.shape)
        expected[dim] = -(-layout.src_size // block)
        if shape != tuple(expected):
            raise ValueError(
                f"{what}: checkpoint tensor has shape {shape}, expected {tuple(expected)} "
                f"(one scale per [{bn}, {bk}] block)"
            )
        copy_checked(param.narrow(dim, dst_first, count), read_slice(src, dim, src_first, count), what)

    def check_block_alignment(self, block_size: tuple[int, int], name: str) -> None:
        """A ValueError naming layer `name` and the shard when a shard of a block-scaled checkpoint
        would split a scale block (checked when the model is built, before anything is read)."""
        for sid in self.shard_ids:
            layout = self.shard_layout(sid)
            block, axis = block_size[layout.dim], ("rows", "columns")[layout.dim]
            what = f"{name}" if sid is None else f"{name} shard {sid!r}"
            extent = (self.out_features, self.in_features)[layout.dim]
            block_span(layout.dst_start, layout.size, extent, block, f"{what} (this rank's weight)", axis)
            block_span(layout.src_start, layout.size, layout.src_size, block, f"{what} (checkpoint)", axis)

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.quant_method.process_weights_after_loading(self, dtype)

    def input_group_quant(self, num_tokens: int) -> tuple[int, bool] | None:
        """(group_size, column_major_scales) where the op before this layer may hand it its input
        quantized (`QuantizedActivation`) for a step of `num_tokens` tokens, else None
        (`LinearMethod.input_group_quant`)."""
        return self.quant_method.input_group_quant(self, num_tokens)

    def extra_repr(self) -> str:
        quant = "" if self.quant_method is UNQUANTIZED else f", quant={self.quant_method}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}{quant}"
        )


class ColumnParallelLinear(LinearBase):
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

    def shard_layout(self, shard_id: Any = None) -> ShardLayout:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        n = self.out_features
        return ShardLayout(0, 0, self.tp_rank * n, n, n * self.tp_size)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
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

    def shard_layout(self, shard_id: Any = None) -> ShardLayout:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shard_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs shard_id in 0..{len(self.shard_sizes) - 1}")
        n = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        return ShardLayout(0, offset, self.tp_rank * n, n, self.output_sizes[shard_id])


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
        self.total_num_kv_heads = total_num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = kv_part.num_heads * head_dim

    def shard_layout(self, shard_id: Any = None) -> ShardLayout:
        if shard_id == "q":
            return ShardLayout(0, 0, self.tp_rank * self.q_size, self.q_size, self.q_size * self.tp_size)
        if shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start, total = self.kv_part.first_head * self.head_dim, self.total_num_kv_heads * self.head_dim
            return ShardLayout(0, offset, start, self.kv_size, total)
        raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")


class ReplicatedLinear(LinearBase):
    """y = x W^T (+ b) with the whole W on every rank; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, 0, 1)

    def shard_layout(self, shard_id: Any = None) -> ShardLayout:
        if shard_id is not None:
            raise ValueError(f"ReplicatedLinear takes no shard_id, got {shard_id!r}")
        return ShardLayout(0, 0, 0, self.out_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class RowParallelLinear(LinearBase):
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

    def shard_layout(self, shard_id: Any = None) -> ShardLayout:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard_id, got {shard_id!r}")
        k = self.in_features
        return ShardLayout(1, 0, self.tp_rank * k, k, k * self.tp_size)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self._reduce(self.quant_method.apply(self, x, None))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product -> the layer's output: all-reduced, then the bias added; or,
        with `reduce_results=False`, this rank's partial sum, which carries the bias on rank 0
        only (the caller's all-reduce then adds it once)."""
        if self.reduce_results:
            y = all_reduce(y, self.tp_size)
        elif self.tp_rank != 0:
            return y
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
    One-row steps (and up to `GEMV_MAX_ROWS` rows with `TILELLM_GEMV=1`) run `gemv.py`'s kernels
    where linear layers do (`gemv_enabled`).
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0] if hidden.dim() == 2 and hidden.stride(-1) == 1 else 0
        if hidden.dtype == self.weight.dtype and gemv_enabled(hidden.device, rows, hidden.dtype):
            logits = skinny_linear(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits, self.tp_size)[..., : self.num_embeddings]
        return logits
