"""FP8 (e4m3) values in kernels: the cast every quantizing kernel uses, and the format's constants.

e4m3 (`torch.float8_e4m3fn`, Triton's `tl.float8e4nv`) holds 3 mantissa bits and magnitudes up
to 448, with no infinities. A quantized tensor is `x_q = clamp(x / scale, -448, 448)` rounded to
nearest even, and `x ~ x_q * scale`: a KV cache keeps one fp32 scale per K and per V tensor of
a layer; weights keep one per 128 x 128 block (`weight_scale_inv`), activations one per token
and 128-wide group of channels.

Every kernel casts through `to_fp8` below: it saturates first (out-of-range values become
+-448, as the GPU's `cvt.rn.satfinite` does; torch's cast would give NaN), and under Triton's
CPU interpreter it rounds explicitly, because the interpreter's own fp32 -> e4m3 conversion
drops the carry when rounding up crosses a power of two and flushes some subnormals (about 7%
of random values come out wrong). The PyTorch twins quantize with `quantize_fp8`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import interpreting

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

FP8_MAX_C = tl.constexpr(FP8_MAX)  # for kernels: they read globals only as constexprs
_INTERPRETING = tl.constexpr(interpreting())


@triton.jit
def _round_to_e4m3_grid(x):
    """fp32 x rounded (to nearest even) onto e4m3's grid: 3 mantissa bits above 2^-6, steps of
    2^-9 below. Exact in fp32: the grid step is a power of two and |x / step| < 16."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals share the smallest normal binade's step
    step = (((exponent - 3) + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    # 1.5 * 2^23: adding and removing it rounds to an integer, to nearest even (fp32 addition)
    rounded = ((tl.abs(x) / step + 12582912.0) - 12582912.0) * step
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign of -0 too


@triton.jit
def to_fp8(x):
    """x (any float, already divided by its scale) -> e4m3, saturated to +-448, nearest even."""
    x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX_C), FP8_MAX_C)
    if _INTERPRETING:
        x = _round_to_e4m3_grid(x)
    return x.to(tl.float8e4nv)


@triton.jit
def to_cache(x, scale_ptr, QUANTIZE: tl.constexpr):
    """Values as a KV cache stores them: for an FP8 cache (QUANTIZE), e4m3 of x / scale, the
    scale read from device memory (a CUDA graph replays with its current value) and the division
    IEEE-rounded (`tl.div_rn`: torch's exact division); otherwise x unchanged."""
    if QUANTIZE:
        x = to_fp8(tl.div_rn(x.to(tl.float32), tl.load(scale_ptr)))
    return x


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def unit_scale(device: torch.device) -> torch.Tensor:
    """A [1] float32 tensor holding 1.0 on `device`: the scale of an FP8 cache given none."""
    if device not in _UNIT_SCALES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made inside a capture, its fill would run only on replays
            raise ValueError(
                "an FP8 cache read inside a CUDA graph capture needs its scales: pass k_scale / v_scale "
                "(kv_scale for MLA), or call once before capturing"
            )
        _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _UNIT_SCALES[device]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """PyTorch twin of `to_fp8(x / scale)`: e4m3 values of x / scale, saturated to +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x_q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """x_q * scale in `dtype` (fp32 product, then cast)."""
    return (x_q.float() * scale).to(dtype)


# An FP8 cache without scales in its checkpoint measures them on its first prompt, as vLLM's
# `calculate_kv_scales` does, with vLLM's ranges: scale = amax / 200 for K and amax / 100 for
# V, so that values up to 2.2x (K) and 4.5x (V) the first prompt's largest still fit in +-448.
# e4m3's relative precision is the same in every binade, so the headroom costs precision only
# for values near the subnormal range (below 2^-6 x scale).
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def measure_kv_scale(x: torch.Tensor, scale: torch.Tensor, value_range: float) -> None:
    """scale[0] = max(amax |x|, 1e-6) / value_range, on the device (no host sync)."""
    with torch.no_grad():
        scale.copy_(x.detach().abs().amax().float().clamp(min=1e-6).reshape(1) / value_range)


def dequantized_rows(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered cache rows in fp32: an FP8 cache's times its scale (None = 1.0), others as they are
    (the twins' reading of every cache)."""
    rows = stored.float()
    if is_fp8(stored) and scale is not None:
        rows = rows * scale.reshape(())  # one element, whatever its shape
    return rows


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for `kv_cache_dtype` "auto" (the model's) | "fp8" | "fp8_e4m3"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")


@triton.jit
def quantize_groups(x, eps):
    """x [BLOCK_M, BLOCK_G] fp32, one group of each row (lanes past the group 0) -> (q e4m3
    [BLOCK_M, BLOCK_G], s [BLOCK_M] fp32): s = max(amax |x|, eps) / 448, q = to_fp8(x / s), both
    divisions IEEE-rounded (`tl.div_rn`: Triton's `/` on fp32 is approximate on the GPU), so they
    match the PyTorch twin bit for bit."""
    amax = tl.max(tl.abs(x), axis=1)  # lanes past the group are 0: they never raise the max
    s = tl.div_rn(tl.maximum(amax, eps), FP8_MAX_C)
    return to_fp8(tl.div_rn(x, s[:, None])), s
