"""FP8 (e4m3) weights for linear layers and experts: checkpoints that ship them, and online quantization.

Checkpoint format (DeepSeek-V3, Qwen3-*-FP8): config.json carries

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

and each quantized linear `X` has `X.weight` e4m3 [N, K] and `X.weight_scale_inv` fp32
[ceil(N / bn), ceil(K / bk)], W ~ weight * the scale of its [bn, bk] block. Embeddings, norms,
the LM head, MoE routers, fp32 projections read raw (DeepSeek-V3.2's indexer `weights_proj`)
and the modules listed in `modules_to_not_convert` / `ignored_layers` keep the model dtype.

A layer switched to FP8 runs W8A8 with activations quantized on the fly, one scale per token
and bk-wide group of channels:

    x_q, x_s = per_token_group_quant_fp8(x, bk)                    # [M, K] e4m3, [M, K / bk] fp32
    y = w8a8_block_fp8_matmul(x_q, weight, x_s, weight_scale_inv, [bn, bk], x.dtype)   # [M, N]

in one kernel for steps of a few tokens (`w8a8_block_fp8_linear(x, weight, weight_scale_inv, ...)`),
and through cuBLAS's block-scaled GEMM for steps of many (`scaled_mm_block_fp8`).

Per-tensor checkpoints (no `weight_block_size`: a scalar `X.weight_scale`, perhaps an
`X.input_scale`) are held in the same block form, blocks of 128 rows by 128 columns (fewer
columns when K is not a multiple of 128: `per_tensor_group`; fewer rows where a merged layer's
shards on this rank fall on blocks of 64, 32 or 16 rows only: `per_tensor_rows`), every block of
a shard holding that shard's scale. A merged layer (qkv_proj, gate_up_proj) whose shards carry
different scales keeps them block row by block row when every shard boundary falls on a block,
and otherwise has every shard requantized to the largest scale (as vLLM always does).
Activations are quantized dynamically per token and group in both cases, unless the checkpoint
says `"activation_scheme": "static"`.

Static activations (per-tensor checkpoints only, as in vLLM: a block checkpoint with a static
scheme is refused): each layer's calibrated `X.input_scale` is loaded, a merged layer keeps the
largest of its shards' (they all read the same input), and the layer quantizes its input by that
one scale, saturating past 448 * input_scale, instead of per token and group:

    x_q, s = scaled_fp8_quant(x, input_scale)                       # [M, K] e4m3, [1]
    y = w8a8_block_fp8_matmul(x_q, weight, s broadcast, weight_scale_inv, [bn, bk], x.dtype)

(or `w8a8_block_fp8_linear(x, ..., input_scale=input_scale)` in one kernel for few tokens; for
many, where torch runs it, `scaled_mm_fp8(x_q, weight, None, input_scale * each row's weight
scale)`: one activation scale and one weight scale per row leave the sum, so cuBLAS's plain FP8
GEMM applies them after it, tensor-wise when every row shares one scale, else row-wise). MoE
experts take the largest input scale over their experts, one for the gate/up input and one for
the down input (vLLM's a1_scale / a2_scale).

Online quantization (`quantization="fp8"` on a bf16 / fp16 / fp32 checkpoint): the layers load
in the model dtype and each weight is quantized in [128, 128] blocks once loading is done.

`load_model` calls, in order: the model built on the meta device, `apply_fp8` (the layers'
parameters switched), allocation (`tilellm_dtype` params in e4m3, `keep_fp32` scales in fp32),
loading, then every module's `process_weights_after_loading(dtype)` (online quantization,
per-tensor scales to blocks, MLA's dequantized `kv_b_proj`).
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8
from tilellm.kernels.fp8_gemv import fp8_gemv_fuses_norm, fp8_gemv_linear, fp8_gemv_quantizes_x, fp8_gemv_runs
from tilellm.kernels.reference.fp8_gemm import dequantize_fp8_block, quantize_fp8_block
from tilellm.models.layers.linear import (
    UNQUANTIZED,
    LayerInput,
    LinearBase,
    LinearMethod,
    NormedActivation,
    QuantizedActivation,
    input_scale_param,
    is_block_aligned,
    reduce_input_scale,
)
from tilellm.models.layers.moe import FusedMoE
from tilellm.models.layers.ops import resolve_fp8_gemm_ops, runs_kernels

SUPPORTED_QUANTIZATION = ("fp8",)
DEFAULT_BLOCK_SIZE = (128, 128)  # online quantization's, and per-tensor checkpoints' where K allows


@dataclass(frozen=True)
class Fp8Config:
    """What a checkpoint's `quantization_config` (quant_method "fp8") says.

    weight_block_size: (bn, bk) of one `weight_scale_inv` entry; None for per-tensor scales.
    activation_scheme: "dynamic" (activations quantized per token and group) or "static" (per
    layer by the checkpoint's `input_scale`; per-tensor weights only).
    ignored_layers: checkpoint module names kept in the model dtype (`modules_to_not_convert`
    and `ignored_layers`; an entry matches a module it names or any module inside it).
    """

    weight_block_size: tuple[int, int] | None = DEFAULT_BLOCK_SIZE
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, raw_config: dict) -> Fp8Config | None:
        """config.json's dict -> its FP8 config, None when it has no `quantization_config`."""
        qc = raw_config.get("quantization_config")
        if qc is None:
            return None
        if not isinstance(qc, dict):
            raise ValueError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method not in SUPPORTED_QUANTIZATION:
            raise ValueError(
                f"quantization_config.quant_method {method!r} is not supported; "
                f"supported: {', '.join(repr(m) for m in SUPPORTED_QUANTIZATION)}"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported; FP8 weights must be e4m3")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"quantization_config.activation_scheme must be 'dynamic' or 'static', got {scheme!r}"
            )
        block = qc.get("weight_block_size")
        if block is not None:
            ok = isinstance(block, list | tuple) and len(block) == 2
            if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block):
                raise ValueError(
                    "quantization_config.weight_block_size must be [bn, bk], two positive ints, "
                    f"got {block!r}"
                )
            block = (int(block[0]), int(block[1]))
            if scheme == "static":
                raise ValueError(
                    "quantization_config: activation_scheme 'static' is only supported with per-tensor "
                    "weight scales; a block-quantized checkpoint (weight_block_size) must use "
                    "activation_scheme 'dynamic'"
                )
        ignored: list[str] = []
        for key in ("modules_to_not_convert", "ignored_layers"):
            names = qc.get(key) or []
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"quantization_config.{key} must be a list of module names, got {names!r}")
            ignored += names
        return cls(weight_block_size=block, activation_scheme=scheme, ignored_layers=tuple(ignored))

    @property
    def static_activations(self) -> bool:
        """Whether layers quantize their inputs by the checkpoint's calibrated `input_scale`."""
        return self.activation_scheme == "static"

    def is_ignored(self, name: str) -> bool:
        """Whether checkpoint module `name` stays unquantized (an entry names it or a parent)."""
        return any(f".{entry}." in f".{name}." for entry in self.ignored_layers)

    def layer_block_size(self, layer: LinearBase) -> tuple[int, int]:
        """The (bn, bk) a linear layer holds its scales in: the checkpoint's block, or for
        per-tensor scales `per_tensor_rows(layer)` rows by `per_tensor_group(K)`."""
        if self.weight_block_size is not None:
            return self.weight_block_size
        return per_tensor_rows(layer), per_tensor_group(layer.in_features)

    def experts_block_size(self, hidden_size: int, intermediate_per_rank: int) -> tuple[int, int]:
        """The (bn, bk) of a FusedMoE's block scales: the checkpoint's, or for per-tensor scales
        square blocks that divide both H and I (the experts' scales split I in whole blocks)."""
        if self.weight_block_size is not None:
            return self.weight_block_size
        b = per_tensor_group(math.gcd(hidden_size, intermediate_per_rank))
        return b, b


def per_tensor_rows(layer: LinearBase) -> int:
    """The block height of a per-tensor layer on this rank: the largest of 128, 64, 32 and 16
    rows on which every shard of its rows starts and ends (or ends at the matrix's end), so that
    each shard keeps its own scale; 128 when none does (the shards are then requantized to the
    largest scale). The choice depends on this rank's shards only, and every aligned choice holds
    the checkpoint's values exactly, so one rank and several hold the same weights wherever some
    height fits. The cost: below 128 rows the layer runs the Triton GEMM with tiles at most that
    wide and never cuBLAS's block-scaled GEMM (which needs 128 x 128 blocks; a static layer's
    `scaled_mm_fp8` reads one scale per row and is unaffected); that happens only where a merged
    layer's shards on a rank are not multiples of 128 rows (small models at high TP)."""
    layouts = [layer.shard_layout(sid) for sid in layer.shard_ids]
    for rows in (128, 64, 32, 16):
        if all(
            lay.dim == 1 or is_block_aligned(lay.dst_start, lay.size, layer.out_features, rows)
            for lay in layouts
        ):
            return rows
    return DEFAULT_BLOCK_SIZE[0]


def per_tensor_group(k: int) -> int:
    """The activation group width of a per-tensor layer of `k` inputs (any width dividing k holds
    its one scale): 128, else the largest power of two >= 32 dividing k (what the Triton GEMM
    takes), else the whole k."""
    for width in (128, 64, 32):
        if k % width == 0:
            return width
    return k


def resolve_quantization(raw_config: dict, quantization: str | None) -> tuple[Fp8Config | None, bool]:
    """(FP8 config or None, online) for config.json's dict and the `quantization` argument.

    None: what the checkpoint says (an FP8 checkpoint loads as FP8, any other unquantized).
    "fp8": the checkpoint's FP8 config, or online quantization of a bf16 / fp16 / fp32 checkpoint
    in [128, 128] blocks (online = True).
    """
    if quantization is not None and quantization not in SUPPORTED_QUANTIZATION:
        choices = ", ".join(repr(q) for q in (None, *SUPPORTED_QUANTIZATION))
        raise ValueError(f"quantization={quantization!r} is not supported; choose one of {choices}")
    checkpoint = Fp8Config.from_config(raw_config)
    if checkpoint is not None:
        return checkpoint, False
    if quantization == "fp8":
        return Fp8Config(weight_block_size=DEFAULT_BLOCK_SIZE), True
    return None, False


def _fp8_param(*shape: int, device: torch.device) -> nn.Parameter:
    """An e4m3 parameter, built in any dtype: the loader allocates it in its `tilellm_dtype`."""
    p = nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)
    p.tilellm_dtype = FP8_DTYPE  # type: ignore[attr-defined]
    return p


def _fp32_param(*shape: int, device: torch.device) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)
    p.keep_fp32 = True  # type: ignore[attr-defined]
    return p


# The static input scale that benchmarks' dummy weights get (`load_format="dummy"`): inputs up to
# 16 in magnitude fit, about what RMSNorm's output over N(0, 0.02) weights reaches.
DUMMY_INPUT_SCALE = 16.0 / FP8_MAX


logger = logging.getLogger(__name__)

# From this many tokens torch's scaled_mm. cuBLAS's block-scaled GEMM at 256 tokens measured 20%
# faster than the Triton kernel over Qwen3-8B's four layers and level on Qwen3-0.6B's, at 64 slower
# on both. Static layers' `scaled_mm_fp8` takes the same threshold, not yet measured for it
# (`benchmarks/fp8_gemm.py` times it at every size).
SCALED_MM_MIN_TOKENS = 256
# Up to this many tokens the Triton GEMM quantizes its input as it loads it (one launch, no x_q
# round trip). Against quantization then the unsplit GEMM it measured faster over the four layers
# of Qwen3-0.6B and of 8B at 1 and 16 tokens (7 of 8 layers at 1 token, 5 of 8 at 16:
# docs/benchmarks.md, G1); against quantization then the split GEMM it is not measured yet.
IN_GEMM_QUANT_MAX_TOKENS = 16


class Fp8LinearMethod(LinearMethod):
    """A linear layer in FP8: `weight` e4m3 [N, K], `weight_scale_inv` fp32 [ceil(N / bn), K / bk],
    applied as W8A8 (module docstring). `ops`: the GEMM module (`resolve_fp8_gemm_ops`).

    online: the layer loads its weight in the model dtype and quantizes it after loading.
    per_tensor: the checkpoint has one scale per shard (no alignment of shards to blocks needed).
    static_activations: inputs quantized by the layer's `input_scale` ([1] fp32 once loaded; one
    entry per shard while loading) instead of per token and group.
    """

    def __init__(
        self,
        block_size: tuple[int, int],
        ops: types.ModuleType,
        *,
        online: bool,
        per_tensor: bool = False,
        static_activations: bool = False,
    ):
        if static_activations and (online or not per_tensor):
            raise ValueError("static activation scales need a per-tensor FP8 checkpoint")
        self.block_size = (int(block_size[0]), int(block_size[1]))
        self.ops, self.online, self.per_tensor = ops, online, per_tensor
        self.static_activations = static_activations
        # torch's scaled_mm for steps of many tokens, decided per layer once its weights are
        # loaded: cuBLAS's block-scaled GEMM (`scaled_mm_block_fp8`), where it measured faster than
        # the Triton kernel (H200: 1.5-1.6x bf16 at 4096 tokens on Qwen3-8B's layers, the Triton
        # kernel 0.86-0.95x); for static layers the per-tensor / per-row one (`scaled_mm_fp8`).
        self.use_scaled_mm = False

    def __repr__(self) -> str:
        bn, bk = self.block_size
        flags = ", online" * self.online + ", static" * self.static_activations
        return f"fp8[{bn}, {bk}]{flags}"

    def create_weights(self, layer: LinearBase, name: str) -> None:
        """Switch `layer` (named `name`, still on the meta device) to FP8 parameters."""
        bn, bk = self.block_size
        n, k = layer.out_features, layer.in_features
        if k % bk:
            raise ValueError(
                f"{name}: its {k} input features (per rank) are not a multiple of the FP8 block width "
                f"{bk}; activations are quantized in groups of {bk} channels"
            )
        if self.online:
            return  # weight_scale_inv is made with the weight's quantization, after loading
        if not self.per_tensor:
            layer.check_block_alignment(self.block_size, name)
        device = layer.weight.device
        layer.weight = _fp8_param(n, k, device=device)
        layer.weight_scale_inv = _fp32_param(-(-n // bn), k // bk, device=device)
        if self.static_activations:  # one per checkpoint shard until loaded, then their largest
            layer.input_scale = input_scale_param(len(layer.shard_ids), device=device)

    def _group_scaled_mm(self, num_tokens: int) -> bool:
        """Whether a dynamically quantized step of `num_tokens` runs cuBLAS's block-scaled GEMM
        (which reads column-major activation scales) rather than Triton's."""
        return self.use_scaled_mm and num_tokens >= SCALED_MM_MIN_TOKENS and num_tokens % 16 == 0

    def input_group_quant(self, layer: LinearBase, num_tokens: int) -> tuple[int, bool] | None:
        """(bk, whether cuBLAS's GEMM reads the scales: column-major) for the steps whose input
        `apply` quantizes in a launch of its own: dynamic scales, more than
        `IN_GEMM_QUANT_MAX_TOKENS` tokens (up to that the GEMM quantizes as it loads), or the
        steps `fp8_gemv.py` runs on a quantized x (`fp8_gemv_quantizes_x`). The op before the
        layer quantizes in its own launch then: RMSNorm, SiLU-and-mul."""
        if self.static_activations:
            return None
        if num_tokens <= IN_GEMM_QUANT_MAX_TOKENS:
            # `fp8_gemv.py` on rows it would not quantize itself: the op before quantizes them
            bk, k = self.block_size[1], layer.weight.shape[1]
            gemv = runs_kernels(self.ops) and fp8_gemv_runs(num_tokens, bk, layer.weight.device)
            return (bk, False) if gemv and not fp8_gemv_quantizes_x(num_tokens, k, bk) else None
        return self.block_size[1], self._group_scaled_mm(num_tokens)

    def _group_gemm(
        self, layer: LinearBase, x_q: torch.Tensor, x_s: torch.Tensor, scaled_mm: bool, dtype: torch.dtype
    ) -> torch.Tensor:
        """x_q [M, K] e4m3 with per-token-group scales x_s [M, K / bk] -> [M, N] in `dtype`."""
        y = None
        if scaled_mm:
            weight = getattr(layer, "scaled_mm_weight", layer.weight)  # whole blocks of rows
            y = self._scaled_mm(
                layer, self.ops.scaled_mm_block_fp8, x_q, weight, x_s, layer.weight_scale_inv,
                list(self.block_size), dtype,
            )  # fmt: skip
            if y is not None and weight is not layer.weight:
                y = y[:, : layer.weight.shape[0]]  # the padding rows' columns dropped
        if y is None:
            y = self.ops.w8a8_block_fp8_matmul(
                x_q, layer.weight, x_s, layer.weight_scale_inv, list(self.block_size), dtype
            )
        return y

    def _gemv(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether a step on input x [..., K] runs `fp8_gemv.py` (`w8a8_block_fp8_linear` sends it
        there too): the kernel ops and `fp8_gemv_runs` (one row on a CUDA device by default)."""
        rows = x.numel() // max(1, x.shape[-1])
        return runs_kernels(self.ops) and fp8_gemv_runs(rows, self.block_size[1], x.device)

    def takes_normed_input(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether the RMSNorm before this layer runs in its launch for input x [T, K]: where
        `fp8_gemv.py` runs the step and a row fits its tile; elsewhere the norm quantizes for the
        layer instead (`input_group_quant`), or runs alone."""
        return self._gemv_quantizes(layer, x) and fp8_gemv_fuses_norm(
            x.numel() // max(1, x.shape[-1]), x.shape[-1], self.block_size[1]
        )

    def _gemv_quantizes(self, layer: LinearBase, x: torch.Tensor) -> bool:
        """Whether `fp8_gemv.py` runs the step on input x [..., K] and quantizes x in its own
        programs (`fp8_gemv_quantizes_x`: one row), so the ops before and after fit its launch."""
        rows, k = x.numel() // max(1, x.shape[-1]), x.shape[-1]
        return self._gemv(layer, x) and fp8_gemv_quantizes_x(rows, k, self.block_size[1])

    def _apply_gemv(
        self, layer: LinearBase, x: NormedActivation | torch.Tensor, silu_and_mul: bool
    ) -> torch.Tensor:
        """The step through `fp8_gemv_linear` (with the norm of a `NormedActivation`, and SiLU-and-mul
        when asked), [..., N] in x's dtype."""
        scale = layer.input_scale if self.static_activations else None
        if isinstance(x, NormedActivation):
            y = fp8_gemv_linear(
                x.x, layer.weight, layer.weight_scale_inv, self.block_size, input_scale=scale,
                silu_and_mul=silu_and_mul, norm_weight=x.norm_weight, norm_eps=x.eps, residual=x.residual,
                residual_out=x.residual_out,
            )  # fmt: skip
            return y if x.residual is None else y[0]
        x2d = x.reshape(-1, x.shape[-1])
        w, w_s = layer.weight, layer.weight_scale_inv
        y = fp8_gemv_linear(x2d, w, w_s, self.block_size, input_scale=scale, silu_and_mul=silu_and_mul)
        return y.view(*x.shape[:-1], y.shape[-1])

    def apply_silu_and_mul(
        self, layer: LinearBase, x: LayerInput, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(gate) * up in the gate-up launch where `fp8_gemv.py` runs the step and quantizes x
        itself (no bias), else None (the caller runs the activation, which quantizes for down_proj
        where that layer asks: `input_group_quant`)."""
        if bias is not None or isinstance(x, QuantizedActivation):
            return None
        t = x.x if isinstance(x, NormedActivation) else x
        return self._apply_gemv(layer, x, silu_and_mul=True) if self._gemv_quantizes(layer, t) else None

    def apply(
        self, layer: LinearBase, x: torch.Tensor | QuantizedActivation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype: x quantized per token and bk-wide group (or by the
        layer's static `input_scale`), then the block-scaled FP8 GEMM (the scales applied in fp32,
        one rounding to x's dtype); static layers' many-token steps through `scaled_mm_fp8`. An
        input the op before quantized (`QuantizedActivation`, [T, K]) goes to the GEMM as it is."""
        if isinstance(x, QuantizedActivation):
            y = self._group_gemm(layer, x.x_q, x.x_s, x.column_major_scales, x.dtype)
            return y if bias is None else y + bias
        if isinstance(x, NormedActivation):  # (handed over where `takes_normed_input` said so)
            if self.takes_normed_input(layer, x.x):
                y = self._apply_gemv(layer, x, silu_and_mul=False)
                return y if bias is None else y + bias
            x = x.normalised()
        bn, bk = self.block_size
        x2d = x.reshape(-1, x.shape[-1])
        num_tokens = x2d.shape[0]
        static_scale = layer.input_scale if self.static_activations else None
        scaled_mm = self.use_scaled_mm and num_tokens >= SCALED_MM_MIN_TOKENS
        y = None
        if num_tokens <= IN_GEMM_QUANT_MAX_TOKENS:  # quantized as the GEMM loads it: one launch
            y = self.ops.w8a8_block_fp8_linear(
                x2d, layer.weight, layer.weight_scale_inv, [bn, bk], input_scale=static_scale
            )
        elif static_scale is not None:
            x_q, scale = self.ops.scaled_fp8_quant(x2d, static_scale)
            if scaled_mm:  # the input scale is folded into scaled_mm_scale_b
                y = self._scaled_mm(
                    layer, self.ops.scaled_mm_fp8, x_q, layer.weight, None, layer.scaled_mm_scale_b, x.dtype
                )
            if y is None:
                x_s = self.ops.broadcast_input_scale(scale, num_tokens, x2d.shape[1] // bk)
        else:
            scaled_mm = self._group_scaled_mm(num_tokens)
            x_q, x_s = self.ops.per_token_group_quant_fp8(x2d, bk, column_major_scales=scaled_mm)
            y = self._group_gemm(layer, x_q, x_s, scaled_mm, x.dtype)
        if y is None:  # static scales on Triton's GEMM
            y = self.ops.w8a8_block_fp8_matmul(
                x_q, layer.weight, x_s, layer.weight_scale_inv, [bn, bk], x.dtype
            )
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def _scaled_mm(
        self, layer: LinearBase, gemm: Callable[..., torch.Tensor], *args: Any
    ) -> torch.Tensor | None:
        """`gemm(*args)` (one of torch's scaled_mm paths), or None (and Triton's GEMM from then on)
        where it refuses."""
        try:
            return gemm(*args)
        except RuntimeError as e:  # a host-side refusal: no algorithm for this shape, another device
            logger.warning(
                "FP8 GEMM: torch's %s refused a %s of %s (%s); Triton's runs it",
                gemm.__name__, type(layer).__name__, tuple(layer.weight.shape), e,
            )  # fmt: skip
            self.use_scaled_mm = False
            return None

    def process_weights_after_loading(self, layer: LinearBase, dtype: torch.dtype) -> None:
        """Online: the loaded weight quantized in place (its block scales added). Per-tensor
        checkpoints: the shards' scalar scales turned into block scales; static activations: the
        shards' input scales reduced to their largest."""
        if self.static_activations:
            layer.input_scale = reduce_input_scale(layer.input_scale)
        if self.online:
            w_q, scale_inv = quantize_fp8_block(layer.weight.data, list(self.block_size))
            layer.weight = nn.Parameter(w_q, requires_grad=False)
            layer.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
        elif layer.per_tensor_scales:
            self._per_tensor_to_blocks(layer)
        if self.static_activations:
            self.use_scaled_mm = self._prepare_scaled_mm_fp8(layer, dtype)
        else:
            unavailable = getattr(self.ops, "scaled_mm_block_unavailable", None)
            n, bn = layer.weight.shape[0], self.block_size[0]
            rows = -(-n // bn) * bn  # whole blocks of rows, as cuBLAS's block-scaled GEMM takes them
            self.use_scaled_mm = unavailable is not None and (
                unavailable(layer.weight.device, list(self.block_size), rows) is None
            )
            if self.use_scaled_mm and rows != n:
                _pad_weight_rows(layer, rows)

    def _prepare_scaled_mm_fp8(self, layer: LinearBase, dtype: torch.dtype) -> bool:
        """A static layer's scales for `scaled_mm_fp8`, if it can run here: the input scale times
        each output row's weight scale (one number when every row shares it), in the buffer
        `scaled_mm_scale_b` [1] or [N]. The block scales stay the truth the Triton GEMM reads; a
        per-tensor checkpoint's are alike along each block row, so the first column gives every
        row's. A layer whose scales vary along a row (a checkpoint that ships block-shaped scales
        with a per-tensor config) keeps the block GEMM. The buffer is a product taken once: a
        caller who changes `input_scale` or the weight's scales afterwards runs this again."""
        unavailable = getattr(self.ops, "scaled_mm_fp8_unavailable", None)
        if unavailable is None:  # the PyTorch twins: the block GEMM's twin runs every step
            return False
        block_scales = layer.weight_scale_inv.data
        if not bool((block_scales == block_scales[:, :1]).all()):
            return False
        n, k = layer.weight.shape
        rows = block_scales[:, 0].repeat_interleave(self.block_size[0])[:n]
        per_row = bool((rows != rows[0]).any())
        if unavailable(layer.weight.device, dtype, n, k, per_row=per_row) is not None:
            return False
        scale_b = layer.input_scale.data.float() * (rows if per_row else rows[:1])
        layer.register_buffer("scaled_mm_scale_b", scale_b.contiguous(), persistent=False)
        return True

    def _per_tensor_to_blocks(self, layer: LinearBase) -> None:
        """Each shard's scalar weight_scale -> the block scales (module docstring): its own block
        rows when every shard boundary falls on a block, else all shards at the largest scale."""
        shards = layer.per_tensor_scales
        if len(shards) != len(layer.shard_ids):
            raise ValueError(
                f"{type(layer).__name__}: shards {sorted(map(repr, shards))} have per-tensor weight scales "
                f"and the others block scales; a layer's scales must all be of one kind"
            )
        bn = self.block_size[0]
        scale, n = layer.weight_scale_inv.data, layer.out_features
        values = list(shards.values())
        with torch.no_grad():
            if all(lay.dim == 1 or is_block_aligned(lay.dst_start, lay.size, n, bn) for lay, _ in values):
                for lay, s in values:
                    if lay.dim == 1:  # a row-parallel layer: its one shard covers every block
                        scale.fill_(s)
                    else:
                        scale[lay.dst_start // bn : -(-(lay.dst_start + lay.size) // bn)].fill_(s)
            else:
                top = max(s for _, s in values)
                for lay, s in values:
                    if s != top:  # one more rounding of these rows, onto the coarser grid of `top`
                        rows = layer.weight.data.narrow(0, lay.dst_start, lay.size)
                        rows.copy_(quantize_fp8(rows.float() * s, top))
                scale.fill_(top)
        shards.clear()


def _pad_weight_rows(layer: LinearBase, rows: int) -> None:
    """Hold an FP8 layer's weight [N, K] in a buffer of `rows` rows, the rows past N zero:
    `layer.scaled_mm_weight` [rows, K], which cuBLAS's block-scaled GEMM takes (N in whole
    128-row blocks; DeepSeek-V3's fused_qkv_a_proj has 1536 + 576 rows), and `layer.weight` its
    first N rows (the same values, which the Triton GEMM reads). The block scales already cover the
    last block whole; the padding rows' output columns are dropped."""
    w = layer.weight.data
    padded = torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
    padded[: w.shape[0]] = w
    layer.weight = nn.Parameter(padded[: w.shape[0]], requires_grad=False)
    layer.scaled_mm_weight = padded


def dequantize_linear_(layer: LinearBase, dtype: torch.dtype) -> None:
    """An FP8 layer back to a plain one in `dtype`: weight = weight * its block scales (for
    weights read raw rather than applied, such as MLA's absorbed `kv_b_proj`). No-op if plain."""
    if layer.quant_method is UNQUANTIZED:
        return
    block = list(layer.quant_method.block_size)  # type: ignore[arg-type]
    w = dequantize_fp8_block(layer.weight.data, layer.weight_scale_inv.data, block, dtype)
    layer.weight = nn.Parameter(w, requires_grad=False)
    del layer.weight_scale_inv
    if hasattr(layer, "input_scale"):  # a static scale: unused once the weight is read raw
        del layer.input_scale
    if hasattr(layer, "scaled_mm_scale_b"):
        del layer.scaled_mm_scale_b
    if hasattr(layer, "scaled_mm_weight"):
        del layer.scaled_mm_weight
    layer.quant_method = UNQUANTIZED


def _checkpoint_module_names(name: str, mapping: dict[str, tuple[str, Any]]) -> list[str]:
    """Module `name` -> the checkpoint modules merged into it (q/k/v_proj for a qkv_proj)."""
    prefix, _, leaf = name.rpartition(".")
    parts = [ckpt for ckpt, (packed, _) in mapping.items() if packed == leaf]
    return [f"{prefix}.{p}" if prefix else p for p in parts] or [name]


def _is_skipped(name: str, cfg: Fp8Config, mapping: dict[str, tuple[str, Any]]) -> bool:
    names = _checkpoint_module_names(name, mapping)
    ignored = [cfg.is_ignored(n) for n in names]
    if any(ignored) and not all(ignored):
        raise ValueError(
            f"{name} merges {names}, of which only some are in quantization_config's ignored modules; "
            "the parts of a merged layer must be quantized alike"
        )
    return all(ignored)


def apply_fp8(
    model: nn.Module,
    cfg: Fp8Config,
    *,
    online: bool,
    backend: str = "auto",
    device: torch.device | str = "cpu",
) -> None:
    """Switch every eligible linear layer of `model` (on the meta device, before allocation) to
    FP8, and every MoE expert layer (`FusedMoE.enable_fp8`). `backend`, `device`: which GEMM
    runs them (`resolve_fp8_gemm_ops`). online: quantize a model-dtype checkpoint after loading.

    Eligible: any tensor-parallel / replicated linear layer not in `cfg.ignored_layers` whose
    weight is not kept in fp32. A ValueError names the layer when its input width is not a
    multiple of the block width, or a shard of a block checkpoint would split a block.
    """
    ops = resolve_fp8_gemm_ops(backend, device)
    mapping = getattr(model, "packed_modules_mapping", {})
    per_tensor = cfg.weight_block_size is None
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            if getattr(module.weight, "keep_fp32", False) or _is_skipped(name, cfg, mapping):
                continue
            block = cfg.layer_block_size(module)
            method = Fp8LinearMethod(
                block, ops, online=online, per_tensor=per_tensor, static_activations=cfg.static_activations
            )
            method.create_weights(module, name)
            module.quant_method = method
        elif isinstance(module, FusedMoE) and not cfg.is_ignored(name):
            block = cfg.experts_block_size(module.hidden_size, module.intermediate_per_rank)
            if online:  # quantized after loading; its shapes checked now, before the weights are read
                module.check_fp8_block(block)
            else:
                module.enable_fp8(block, static_activations=cfg.static_activations)


def quantize_experts_online(model: nn.Module, cfg: Fp8Config) -> None:
    """Online quantization of the experts, after loading (the linear layers quantize themselves in
    `process_weights_after_loading`): every FusedMoE not in `cfg.ignored_layers`, in the
    config's blocks."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not cfg.is_ignored(name):
            module.quantize_weights_fp8(
                cfg.experts_block_size(module.hidden_size, module.intermediate_per_rank)
            )


def fill_dummy_fp8_(weight: torch.Tensor, scale_inv: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """Random FP8 weights that behave like N(0, std) quantized in 128 x 128 blocks (benchmarks'
    dummy weights): the amax of such a block is about 4 std, so every scale is 4 std / 448 and
    the values are N(0, std) / scale, saturated at +-448 (beyond 4 std: 6e-5 of them). Any
    leading dims (stacked experts) are filled alike; chunks of rows keep the fp32 draw small."""
    s = 4.0 * std / FP8_MAX
    scale_inv.fill_(s)
    rows = weight.view(-1, weight.shape[-1])
    chunk = max(1, (1 << 24) // max(1, weight.shape[-1]))  # 64 MB of fp32 at a time
    for i in range(0, rows.shape[0], chunk):
        part = rows[i : i + chunk]
        draw = torch.empty(part.shape, dtype=torch.float32, device=part.device).normal_(
            0.0, std, generator=gen
        )
        part.copy_(quantize_fp8(draw, s))
