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
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tilellm.models.layers.linear import WeightSource, copy_checked, read_slice
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
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_per_rank = divide(intermediate_size, tp_size, "moe_intermediate_size")
        self.tp_rank, self.tp_size, self.ops = tp_rank, tp_size, ops
        i_r = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i_r, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i_r), requires_grad=False)

    def param_shard_ids(self, name: str) -> tuple[Any, ...]:
        """The (expert, matrix) shards that fill parameter `name` (the loader checks all arrive)."""
        names = ("gate_proj", "up_proj") if name == "w13_weight" else ("down_proj",)
        return tuple((e, n) for e in range(self.num_experts) for n in names)

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(
                f"FusedMoE needs shard_id (expert in 0..{self.num_experts - 1}, matrix), got {shard_id!r}"
            )
        expert, matrix = shard_id
        i_r, start = self.intermediate_per_rank, self.tp_rank * self.intermediate_per_rank
        what = f"expert {expert} {matrix}"
        if matrix == "down_proj":
            copy_checked(param[expert], read_slice(src, 1, start, i_r), what)
        elif matrix in ("gate_proj", "up_proj"):
            offset = 0 if matrix == "gate_proj" else i_r
            copy_checked(param[expert, offset : offset + i_r], read_slice(src, 0, start, i_r), what)
        else:
            raise ValueError(f"FusedMoE has no matrix {matrix!r}")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate_per_rank={self.intermediate_per_rank}, tp={self.tp_rank}/{self.tp_size}"
        )


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
