"""Mixture of experts: the router that picks each token's experts, and the experts themselves.

    weights, ids = select_experts(router_logits, router_config, correction_bias)  # [T, K] each
    y = FusedMoE(...)(x, weights, ids)                                             # [T, H]

`select_experts` covers the routers of DeepSeek-V2 (softmax, optionally limited to the best
groups by their best expert), DeepSeek-V3 (sigmoid plus a load-balancing bias for the choice
only, groups ranked by their two best experts) and Qwen3-MoE (softmax, top-k, renormalised).
`FusedMoE` holds every expert's gate/up and down matrices as two stacked tensors and runs them
through one fused kernel (`tilellm.kernels.moe`, or its PyTorch twin on CPU). `MoEBlock` is the
layer a decoder uses: router + routed experts (+ shared experts), with one all-reduce.

Tensor parallelism splits each expert's intermediate dimension across ranks (as the dense MLP's):
every rank routes every token, computes its slice of every expert and the partial sums are
all-reduced once, together with the shared experts'.

FP8 experts (DeepSeek-V3's checkpoints, or `--quantization fp8` of a bf16 one): the stacked
matrices in float8_e4m3fn with one fp32 scale per [bn, bk] block beside each
(`w13_weight_scale_inv`, `w2_weight_scale_inv`), run by the fused kernel's block-scaled W8A8
path. `FusedMoE.enable_fp8` declares them before loading, `FusedMoE.quantize_weights_fp8`
converts loaded bf16 experts. A per-tensor checkpoint with static activations also gives each
expert's matrices an `input_scale`; the layer quantizes the experts' input by the largest of
gate's and up's over its experts, and the down projection's input by the largest of down's.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tilellm.kernels.fp8 import FP8_DTYPE, is_fp8
from tilellm.kernels.moe import check_block_shape
from tilellm.kernels.reference.fp8_gemm import quantize_fp8_block
from tilellm.models.layers.linear import (
    WeightSource,
    check_input_scale_value,
    copy_checked,
    input_scale_param,
    read_all,
    read_slice,
    reduce_input_scale,
    source_shape,
)
from tilellm.models.layers.mlp import GatedMLP
from tilellm.models.parallel import all_reduce, check_tp, divide


@dataclass(frozen=True)
class RouterConfig:
    """How a router turns its logits into each token's `top_k` experts and their weights."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid": expert scores from the router logits
    num_groups: int = 1  # experts in `num_groups` equal groups; only the best `topk_groups` compete
    topk_groups: int = 1
    group_score: str = "max"  # a group's rank: its best expert ("max") or two best ("top2_sum")
    renormalize: bool = False  # weights divided by their sum over the chosen experts
    scaling_factor: float = 1.0  # routed_scaling_factor, applied last
    correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (choice only, not weights)
    fp32_gate: bool = False  # the gate's weight kept in float32 (DeepSeek's, as transformers keeps it)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring function {self.scoring!r}; use softmax or sigmoid")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in 1..n_routed_experts ({self.num_experts})"
            )
        if self.num_experts % self.num_groups != 0:
            raise ValueError(
                f"n_routed_experts ({self.num_experts}) is not divisible by n_group ({self.num_groups})"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group ({self.topk_groups}) must be in 1..n_group ({self.num_groups})")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) is more than the experts of topk_group "
                f"({self.topk_groups}) groups of {self.num_experts // self.num_groups}"
            )


def select_experts(
    router_logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (topk_weights [T, K] fp32, topk_ids [T, K] int32).

    On device tensors only (no host sync), so a decode step's router runs inside a CUDA graph.
    """
    scores = router_logits.softmax(dim=-1) if config.scoring == "softmax" else router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if config.num_groups > 1 and config.topk_groups < config.num_groups:
        grouped = choice.view(choice.shape[0], config.num_groups, -1)
        if config.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best_groups = group_scores.topk(config.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)
    topk_ids = choice.topk(config.top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if config.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.scaling_factor != 1.0:
        topk_weights = topk_weights * config.scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


class MoERouter(nn.Module):
    """The gate: logits = x W^T in fp32 (W [E, H], in fp32 itself with `fp32_gate`; DeepSeek-V3's
    correction bias [E] beside it)."""

    def __init__(self, hidden_size: int, config: RouterConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size), requires_grad=False)
        if config.fp32_gate:
            self.weight.keep_fp32 = True  # type: ignore[attr-defined]
        if config.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts), requires_grad=False)
            self.e_score_correction_bias.keep_fp32 = True  # type: ignore[attr-defined]  # ranks tie closely
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, K] fp32, topk_ids [T, K] int32)."""
        logits = F.linear(x.float(), self.weight.float())
        return select_experts(logits, self.config, self.e_score_correction_bias)


class FusedMoE(nn.Module):
    """The routed experts: w13 [E, 2 I_r, H] (each expert's [gate | up] rows of this rank) and
    w2 [E, H, I_r] (its down matrix's columns), I_r = intermediate / tp_size.

    forward(x [T, H], topk_weights [T, K], topk_ids [T, K]) -> [T, H], this rank's partial sum.
    Checkpoint tensors `experts.{e}.{gate,up,down}_proj.weight` load with shard id (e, name).
    After `enable_fp8(block_size)` (or `quantize_weights_fp8`) the two are float8_e4m3fn with
    block scales w13_weight_scale_inv [E, 2 I_r / bn, cdiv(H, bk)] and w2_weight_scale_inv
    [E, cdiv(H, bn), I_r / bk] (checkpoints' `...{gate,up,down}_proj.weight_scale_inv`, or a
    per-tensor `weight_scale`, with the same shard ids).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        ops: types.ModuleType,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts,
            hidden_size,
            intermediate_size,
        )
        self.intermediate_per_rank = divide(intermediate_size, tp_size, "moe_intermediate_size")
        self.tp_rank, self.tp_size, self.ops = tp_rank, tp_size, ops
        i_r = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i_r, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i_r), requires_grad=False)
        # [bn, bk] of the fp8 experts' block scales; None while the experts are in the model's dtype
        self.fp8_block_size: tuple[int, int] | None = None
        # static activations: w13_input_scale / w2_input_scale, per expert while loading, then [1]
        self.static_activations = False

    # -- FP8 experts --------------------------------------------------------------------------

    def enable_fp8(self, block_size: tuple[int, int], *, static_activations: bool = False) -> None:
        """Declare block-quantized FP8 experts before the parameters are materialised.

        w13_weight / w2_weight become float8_e4m3fn parameters of the same shapes (marked
        `tilellm_dtype` for the loader's materialiser) and the block scales
        w13_weight_scale_inv [E, 2 I_r / bn, cdiv(H, bk)] and w2_weight_scale_inv
        [E, cdiv(H, bn), I_r / bk] are added, in float32 (`keep_fp32`). block_size = (bn, bk),
        (128, 128) for DeepSeek-V3. static_activations: also the checkpoint's input scales,
        w13_input_scale [E, 2] (gate's, up's) and w2_input_scale [E] (down's), reduced to their
        largest ([1] each) once loaded.
        """
        bn, bk = self.check_fp8_block(block_size)
        E, H, i_r, dev = (
            self.num_experts,
            self.hidden_size,
            self.intermediate_per_rank,
            self.w13_weight.device,
        )
        self.w13_weight = _fp8_weight(torch.empty(E, 2 * i_r, H, dtype=FP8_DTYPE, device=dev))
        self.w2_weight = _fp8_weight(torch.empty(E, H, i_r, dtype=FP8_DTYPE, device=dev))
        self.w13_weight_scale_inv = _fp32_scale(torch.empty(E, 2 * i_r // bn, -(-H // bk), device=dev))
        self.w2_weight_scale_inv = _fp32_scale(torch.empty(E, -(-H // bn), i_r // bk, device=dev))
        self.fp8_block_size = (bn, bk)
        if static_activations:
            self.w13_input_scale = input_scale_param(E, 2, device=dev)
            self.w2_input_scale = input_scale_param(E, device=dev)
            self.static_activations = True

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        """Static activations: each input scale reduced to its largest over the experts (and
        over gate and up, which read the same input), as vLLM does."""
        if self.static_activations:  # idempotent: a [1] scale stays itself
            self.w13_input_scale = reduce_input_scale(self.w13_input_scale)
            self.w2_input_scale = reduce_input_scale(self.w2_input_scale)

    def quantize_weights_fp8(self, block_size: tuple[int, int]) -> None:
        """Online quantization: the loaded experts (in the model's dtype) -> float8_e4m3fn with
        block scales, replacing w13_weight / w2_weight and adding the scales as `enable_fp8`
        declares them. Each expert's matrix is quantized on its own (`quantize_fp8_block`: scale =
        its block's amax / 448), so at most one expert's copy in fp32 exists at a time."""
        if self.fp8_block_size is not None:
            raise ValueError(f"FusedMoE: the experts are already fp8 (block {list(self.fp8_block_size)})")
        bn, bk = self.check_fp8_block(block_size)
        w13_q, w13_s = _quantize_experts(self.w13_weight, (bn, bk))
        w2_q, w2_s = _quantize_experts(self.w2_weight, (bn, bk))
        self.w13_weight, self.w2_weight = _fp8_weight(w13_q), _fp8_weight(w2_q)
        self.w13_weight_scale_inv, self.w2_weight_scale_inv = _fp32_scale(w13_s), _fp32_scale(w2_s)
        self.fp8_block_size = (bn, bk)

    def check_fp8_block(self, block_size: tuple[int, int]) -> tuple[int, int]:
        """(bn, bk), checked against this rank's shapes: scales are sliced per rank in whole blocks
        and activations are quantized in groups of bk channels."""
        bn, bk = check_block_shape("FusedMoE", block_size)
        i_r = self.intermediate_per_rank
        if i_r % bn or i_r % bk:
            raise ValueError(
                f"FP8 experts: moe_intermediate_size ({self.intermediate_size}) / tensor_parallel_size "
                f"({self.tp_size}) = {i_r} must be a multiple of both sides of the block [{bn}, {bk}] "
                "(w13's scale rows and w2's scale columns are split per rank in whole blocks)"
            )
        if self.hidden_size % bk:
            raise ValueError(
                f"FP8 experts: hidden_size ({self.hidden_size}) must be a multiple of the block's bk = {bk} "
                "(activations are quantized per token in groups of bk channels)"
            )
        return bn, bk

    # -- loading ------------------------------------------------------------------------------

    def param_shard_ids(self, name: str) -> tuple[Any, ...]:
        """The (expert, matrix) shards that fill parameter `name` (the loader checks all arrive)."""
        if name in ("w13_weight", "w13_weight_scale_inv", "w13_input_scale"):
            names: tuple[str, ...] = ("gate_proj", "up_proj")
        elif name in ("w2_weight", "w2_weight_scale_inv", "w2_input_scale"):
            names = ("down_proj",)
        else:
            raise ValueError(f"FusedMoE has no parameter {name!r}")
        return tuple((e, n) for e in range(self.num_experts) for n in names)

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        """One checkpoint matrix of one expert (shard_id (e, "gate_proj" | "up_proj" | "down_proj"))
        into this rank's slice of `param`: a weight, or (fp8 experts) its block scales [rows / bn,
        cols / bk] or a per-tensor scale (0-d or one element), which fills the shard's blocks."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(
                f"FusedMoE needs shard_id (expert in 0..{self.num_experts - 1}, matrix), got {shard_id!r}"
            )
        expert, matrix = shard_id
        if matrix not in ("gate_proj", "up_proj", "down_proj"):
            raise ValueError(f"FusedMoE has no matrix {matrix!r}")
        if self.static_activations and (param is self.w13_input_scale or param is self.w2_input_scale):
            value = check_input_scale_value(read_all(src), f"expert {expert} {matrix}")
            with torch.no_grad():
                if matrix == "down_proj":
                    param[expert] = value
                else:
                    param[expert, 0 if matrix == "gate_proj" else 1] = value
        elif self.fp8_block_size is not None and (
            param is self.w13_weight_scale_inv or param is self.w2_weight_scale_inv
        ):
            self._load_scale(param, src, expert, matrix)
        else:
            self._load_weight(param, src, expert, matrix)

    def _load_weight(self, param: nn.Parameter, src: WeightSource, expert: int, matrix: str) -> None:
        i_r, start = self.intermediate_per_rank, self.tp_rank * self.intermediate_per_rank
        what = f"expert {expert} {matrix}"
        if matrix == "down_proj":
            dst, shard = param[expert], read_slice(src, 1, start, i_r)
        else:
            offset = 0 if matrix == "gate_proj" else i_r
            dst, shard = param[expert, offset : offset + i_r], read_slice(src, 0, start, i_r)
        if is_fp8(shard) != is_fp8(dst):
            # an fp8 copy into bf16 (or back) would drop the block scales without a word
            raise ValueError(
                f"{what}: checkpoint tensor is {shard.dtype} but the experts are {dst.dtype} "
                "(fp8 checkpoints need FusedMoE.enable_fp8 before loading)"
            )
        copy_checked(dst, shard, what)

    def _load_scale(self, param: nn.Parameter, src: WeightSource, expert: int, matrix: str) -> None:
        bn, bk = self.fp8_block_size
        if matrix == "down_proj":  # this rank's blocks of I are columns of the down scale
            dim, length = 1, self.intermediate_per_rank // bk
            dst = param[expert]
        else:  # gate's blocks of I first, then up's
            dim, length = 0, self.intermediate_per_rank // bn
            offset = 0 if matrix == "gate_proj" else length
            dst = param[expert, offset : offset + length]
        if math.prod(source_shape(src)) == 1:  # a per-tensor scale: every block of the shard has it
            with torch.no_grad():
                dst.fill_(float(read_all(src).reshape(())))
            return
        shard = read_slice(src, dim, self.tp_rank * length, length)
        copy_checked(dst, shard, f"expert {expert} {matrix} scale")

    # -- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.fp8_block_size is None:
            return self.ops.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        static = {}
        if self.static_activations:
            static = {"a1_scale": self.w13_input_scale, "a2_scale": self.w2_input_scale}
        return self.ops.fused_moe(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
            w13_scale=self.w13_weight_scale_inv, w2_scale=self.w2_weight_scale_inv,
            block_shape=self.fp8_block_size, **static,
        )  # fmt: skip

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_block_size is None else f", fp8_block={list(self.fp8_block_size)}"
        fp8 += ", static activations" if self.static_activations else ""
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate_per_rank={self.intermediate_per_rank}, tp={self.tp_rank}/{self.tp_size}{fp8}"
        )


def _fp8_weight(t: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.tilellm_dtype = FP8_DTYPE  # type: ignore[attr-defined]  # the materialiser allocates it so
    return p


def _fp32_scale(t: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(t.float(), requires_grad=False)
    p.keep_fp32 = True  # type: ignore[attr-defined]
    return p


def _quantize_experts(w: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (w_q [E, N, K] float8_e4m3fn, scale_inv [E, cdiv(N, bn), cdiv(K, bk)] float32)."""
    (E, N, K), (bn, bk) = w.shape, block_size
    w_q = torch.empty(E, N, K, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(E, -(-N // bn), -(-K // bk), dtype=torch.float32, device=w.device)
    for e in range(E):
        w_q[e], scale[e] = quantize_fp8_block(w[e], list(block_size))
    return w_q, scale


def quantize_experts_fp8(model: nn.Module, block_size: tuple[int, int]) -> None:
    """Online FP8 quantization of every `FusedMoE` of `model` whose experts are not fp8 yet."""
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.fp8_block_size is None:
            module.quantize_weights_fp8(block_size)


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared experts, always on): x [T, H] -> [T, H].

    Submodule names follow the checkpoints: `gate`, `experts`, `shared_experts`.
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        router: RouterConfig,
        moe_ops: types.ModuleType,
        fused_ops: types.ModuleType,
        *,
        shared_intermediate_size: int = 0,
        mlp_bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        self.tp_size = tp_size
        self.gate = MoERouter(hidden_size, router)
        self.experts = FusedMoE(
            router.num_experts, hidden_size, moe_intermediate_size, moe_ops, tp_rank, tp_size
        )
        self.shared_experts = None
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(
                hidden_size,
                shared_intermediate_size,
                mlp_bias,
                fused_ops,
                tp_rank,
                tp_size,
                reduce_results=False,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        y = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return all_reduce(y, self.tp_size)
