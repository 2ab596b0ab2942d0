"""PyTorch twins of `tilellm.kernels.fp8_gemm`: block-scaled FP8 (e4m3) W8A8 GEMM, vLLM's names.

DeepSeek-V3 / Qwen3-FP8 checkpoints store each linear weight W [N, K] as e4m3 values with one
fp32 `weight_scale_inv` per [bn, bk] = [128, 128] block (W ~ w_q * scale_inv, edge blocks may
be partial), and quantize activations on the fly with one scale per token and bk-wide group of
channels. With j the k-block index (channels [j * bk, (j + 1) * bk)):

    x_s[m, j] = max(amax_{k in j} |x[m, k]|, eps) / 448,    x_q[m, k] = e4m3(x[m, k] / x_s[m, j])
    C[m, n]   = sum_j a_s[m, j] * b_s[n // bn, j] * sum_{k in j} a[m, k] * b[n, k]

The inner sums are exact products of e4m3 values added in fp32; the scaled sum over k-blocks
runs in fp32 and is rounded once to the output dtype.

Static activations (per-tensor checkpoints with `activation_scheme: "static"`): the layer's
calibrated `input_scale` s replaces every x_s[m, j], so x_q = e4m3(x / s), saturated at +-448
(`scaled_fp8_quant(x, s)`, vLLM's name), and the same GEMM runs with a_s = s broadcast. With one
activation scale and one weight scale per output row (a per-tensor checkpoint's shards), the
scales leave the sum: C[m, n] = s_a * s_b[n] * sum_k a[m, k] * b[n, k] (`scaled_mm_fp8`, the
product `torch._scaled_mm` computes).

The checks (`check_*`) are shared with the Triton kernels, so both raise the same `ValueError`s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tilellm.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WEIGHT_SCALE_EPS = 1e-12  # the floor of a weight block's amax (an all-zero block keeps scale > 0)


# ----------------------------------------------------------------------------------------------
# Checks shared with the Triton kernels
# ----------------------------------------------------------------------------------------------


def check_block_size(name: str, block_size: Sequence[int]) -> tuple[int, int]:
    """block_size = [bn, bk], two positive ints -> (bn, bk)."""
    ok = isinstance(block_size, (list, tuple)) and len(block_size) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block_size):
        raise ValueError(f"{name}: block_size must be [bn, bk], two positive ints, got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _check_2d(name: str, arg: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {arg} must be a tensor {layout}, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name}: {arg} must be 2-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " / ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: {arg} must be {allowed}, got {t.dtype}")


def check_per_token_group_quant(x: torch.Tensor, group_size: int, eps: float) -> None:
    name = "per_token_group_quant_fp8"
    _check_2d(name, "x", x, FLOAT_DTYPES, "[M, K]")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"{name}: group_size must be a positive int, got {group_size!r}")
    if x.shape[1] % group_size:
        raise ValueError(
            f"{name}: K = x.shape[1] = {x.shape[1]} must be a multiple of group_size {group_size}"
        )
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name}: x's last dim must be contiguous, got strides {tuple(x.stride())}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{name}: eps must be a positive number, got {eps!r}")


def check_input_scale(name: str, x: torch.Tensor, scale: torch.Tensor) -> None:
    """A static activation scale: one float32 element on x's device (its value is not read here:
    that would sync with the device; loading checks it is positive and finite)."""
    if not isinstance(scale, torch.Tensor):
        raise ValueError(
            f"{name}: the input scale must be a float32 tensor of one element, got {type(scale).__name__}"
        )
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(
            f"{name}: the input scale must be a float32 tensor of one element, "
            f"got {scale.dtype} of shape {tuple(scale.shape)}"
        )
    if scale.device != x.device:
        raise ValueError(f"{name}: the input scale is on {scale.device} but x is on {x.device}")


def check_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None) -> None:
    name = "scaled_fp8_quant"
    _check_2d(name, "x", x, FLOAT_DTYPES, "[M, K]")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name}: x's last dim must be contiguous, got strides {tuple(x.stride())}")
    if scale is not None:
        check_input_scale(name, x, scale)


def check_block_fp8_matmul(
    name: str,
    a: torch.Tensor,
    b: torch.Tensor,
    a_s: torch.Tensor | None,
    b_s: torch.Tensor,
    block_size: Sequence[int],
    output_dtype: torch.dtype,
) -> tuple[int, int]:
    """The checks of `w8a8_block_fp8_matmul` (and of its other paths, under their `name`) -> (bn, bk).

    a_s None: a holds unquantized activations (`w8a8_block_fp8_linear`), a contiguous last dim.
    """
    bn, bk = check_block_size(name, block_size)
    if a_s is None:
        _check_2d(name, "x", a, FLOAT_DTYPES, "[M, K]")
        if a.shape[1] > 1 and a.stride(1) != 1:
            raise ValueError(f"{name}: x's last dim must be contiguous, got strides {tuple(a.stride())}")
    else:
        _check_2d(name, "a", a, (FP8_DTYPE,), "[M, K]")
        _check_2d(name, "a_s", a_s, (torch.float32,), "[M, K // bk]")
    _check_2d(name, "b", b, (FP8_DTYPE,), "[N, K]")
    _check_2d(name, "b_s", b_s, (torch.float32,), "[ceil(N / bn), K // bk]")
    (M, K), N = a.shape, b.shape[0]
    if b.shape[1] != K:
        raise ValueError(
            f"{name}: a [M, K] and b [N, K] must share K, got a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if K % bk:
        raise ValueError(f"{name}: K = {K} must be a multiple of the block size bk = {bk}")
    if a_s is not None and tuple(a_s.shape) != (M, K // bk):
        raise ValueError(f"{name}: a_s must be [M, K // bk] = {[M, K // bk]}, got {list(a_s.shape)}")
    b_s_shape = (-(-N // bn), K // bk)
    if tuple(b_s.shape) != b_s_shape:
        raise ValueError(
            f"{name}: b_s must be [ceil(N / bn), K // bk] = {list(b_s_shape)}, got {list(b_s.shape)}"
        )
    devices = {t.device for t in (a, b, a_s, b_s) if t is not None}
    if len(devices) != 1:
        names = "x, b and b_s" if a_s is None else "a, b, a_s and b_s"
        raise ValueError(f"{name}: {names} must be on one device, got {sorted(map(str, devices))}")
    if output_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: output_dtype must be float32 / float16 / bfloat16, got {output_dtype}")
    return bn, bk


def check_scaled_mm_fp8(
    name: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor,
    output_dtype: torch.dtype,
) -> None:
    """The checks of `scaled_mm_fp8`: a [M, K] and b [N, K] e4m3 with unit last-dim strides,
    scale_a None or one float32 element, scale_b float32 of 1 or N elements, one device."""
    _check_2d(name, "a", a, (FP8_DTYPE,), "[M, K]")
    _check_2d(name, "b", b, (FP8_DTYPE,), "[N, K]")
    if b.shape[1] != a.shape[1]:
        raise ValueError(
            f"{name}: a [M, K] and b [N, K] must share K, got a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    for arg, t in (("a", a), ("b", b)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: {arg}'s last dim must be contiguous, got strides {tuple(t.stride())}")
    if scale_a is not None:
        check_input_scale(name, a, scale_a)
    N = b.shape[0]
    if (
        not isinstance(scale_b, torch.Tensor)
        or scale_b.dtype != torch.float32
        or scale_b.numel() not in (1, N)
    ):
        got = (
            f"{scale_b.dtype} of shape {tuple(scale_b.shape)}"
            if isinstance(scale_b, torch.Tensor)
            else scale_b
        )
        raise ValueError(f"{name}: scale_b must be float32 of 1 or N = {N} elements, got {got}")
    if len({a.device, b.device, scale_b.device}) != 1:
        raise ValueError(
            f"{name}: a, b and scale_b must be on one device, got {a.device}, {b.device}, {scale_b.device}"
        )
    if output_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: output_dtype must be float32 / float16 / bfloat16, got {output_dtype}")


# ----------------------------------------------------------------------------------------------
# Twins
# ----------------------------------------------------------------------------------------------


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, *, eps: float = 1e-10, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32/float16/bfloat16 -> (x_q [M, K] float8_e4m3fn, x_s [M, K // group_size] float32).

    One scale per row and group of `group_size` consecutive channels:
    x_s = max(amax |x_group|, eps) / 448 and x_q = e4m3(x_group / x_s), so x ~ x_q * x_s.
    `column_major_scales`: x_s with strides (1, M) (the layout cuBLAS's block-scaled GEMM reads).
    """
    check_per_token_group_quant(x, group_size, eps)
    M, K = x.shape
    groups = x.float().reshape(M, K // group_size, group_size)
    x_s = _div_exact(groups.abs().amax(dim=-1).clamp(min=eps), FP8_MAX)  # [M, G]
    x_q = quantize_fp8(groups, x_s[..., None]).reshape(M, K)
    return x_q, (x_s.t().contiguous().t() if column_major_scales else x_s)


def dynamic_per_tensor_scale(x: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """[1] float32 max(amax |x|, eps) / 448, on x's device (no host sync): the scale
    `scaled_fp8_quant` computes when given none (the Triton path shares it)."""
    if x.numel() == 0:  # an empty x: the scale of an all-zero one
        amax = torch.zeros(1, dtype=torch.float32, device=x.device).clamp(min=eps)
    else:
        amax = x.detach().abs().amax().float().clamp(min=eps).reshape(1)
    return _div_exact(amax, FP8_MAX)


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32/float16/bfloat16 -> (x_q [M, K] float8_e4m3fn, scale [1] float32).

    One scale for the whole tensor: `scale` (a static, calibrated one: a checkpoint's
    `input_scale`), or when None max(amax |x|, 1e-10) / 448. x_q = e4m3(x / scale), saturated at
    +-448 (values past 448 * scale are clipped, as static quantization intends).
    """
    check_scaled_fp8_quant(x, scale)
    scale = dynamic_per_tensor_scale(x) if scale is None else scale.reshape(1)
    return quantize_fp8(x, scale), scale


def broadcast_input_scale(scale: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """A static input scale as the [rows, groups] a_s of the block GEMM (a view: strides (0, 0))."""
    return scale.reshape(1, 1).expand(rows, groups)


def scaled_mm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor,
    output_dtype: torch.dtype = torch.bfloat16,
    *,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """C [M, N] = (a @ b^T) * scale_a * scale_b, in fp32, rounded once to `output_dtype`
    (`use_fast_accum`, the tensor cores' accumulation on the GPU, changes nothing here).

    a [M, K] e4m3 activations with scale_a (one float32 element: the whole tensor's scale; None
    when it is already folded into scale_b); b [N, K] e4m3 weight with scale_b float32 of one
    element (the tensor's) or N (one per output row).
    """
    check_scaled_mm_fp8("scaled_mm_fp8", a, b, scale_a, scale_b, output_dtype)
    c = a.float() @ b.float().T
    if scale_a is not None:
        c = c * scale_a.reshape(1, 1)
    return (c * scale_b.reshape(1, -1)).to(output_dtype)


def w8a8_block_fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_s: torch.Tensor,
    b_s: torch.Tensor,
    block_size: list[int],
    output_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """C [M, N] = (a * a_s) @ (b * b_s)^T, block-scaled, in `output_dtype`.

    a [M, K] e4m3 activations with a_s [M, K // bk] fp32 (one scale per token and k-block);
    b [N, K] e4m3 weight with b_s [ceil(N / bn), K // bk] fp32 (one per [bn, bk] block);
    block_size = [bn, bk]. Each k-block's exact fp8 dot is scaled by a_s[m, j] * b_s[n // bn, j]
    and added to an fp32 accumulator, which is rounded once to `output_dtype`.
    """
    bn, bk = check_block_fp8_matmul("w8a8_block_fp8_matmul", a, b, a_s, b_s, block_size, output_dtype)
    (M, K), N = a.shape, b.shape[0]
    b_s_rows = b_s.repeat_interleave(bn, dim=0)[:N]  # [N, K // bk]: each weight row's scales
    acc = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    # One k-block at a time, as the kernel walks it (and so that no [K // bk, M, N] tensor exists).
    for j in range(K // bk):
        cols = slice(j * bk, (j + 1) * bk)
        partial = a[:, cols].float() @ b[:, cols].float().T  # [M, N]
        acc += partial * (a_s[:, j, None] * b_s_rows[None, :, j])
    return acc.to(output_dtype)


def w8a8_block_fp8_linear(
    x: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    block_size: list[int],
    output_dtype: torch.dtype | None = None,
    *,
    eps: float = 1e-10,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """C [M, N] = `w8a8_block_fp8_matmul(*per_token_group_quant_fp8(x, bk), b, b_s, ...)`.

    x [M, K] float32/float16/bfloat16, quantized per token and bk-wide group, or with
    `input_scale` (one float32 element: static activations) as `scaled_fp8_quant(x, input_scale)`;
    b [N, K] e4m3 with b_s [ceil(N / bn), K // bk] fp32; C in `output_dtype` (default x's dtype).
    """
    name = "w8a8_block_fp8_linear"
    output_dtype = x.dtype if output_dtype is None else output_dtype
    bn, bk = check_block_fp8_matmul(name, x, b, None, b_s, block_size, output_dtype)
    if input_scale is not None:
        check_input_scale(name, x, input_scale)
        x_q, scale = scaled_fp8_quant(x, input_scale)
        x_s = broadcast_input_scale(scale, x.shape[0], x.shape[1] // bk)
    else:
        x_q, x_s = per_token_group_quant_fp8(x, bk, eps=eps)  # checks eps
    return w8a8_block_fp8_matmul(x_q, b, x_s, b_s, [bn, bk], output_dtype)


def _div_exact(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor rounded once (IEEE), as the kernels' `tl.div_rn`: on CUDA, torch divides by a
    Python number as a product with its rounded reciprocal, which is one ulp off at times."""
    return t / torch.full_like(t, divisor)


def _expand_block_scales(scale: torch.Tensor, shape: torch.Size, bn: int, bk: int) -> torch.Tensor:
    """[ceil(N / bn), ceil(K / bk)] block scales -> [N, K], one per element."""
    N, K = shape
    return scale.repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]


def quantize_fp8_block(w: torch.Tensor, block_size: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (w_q [N, K] float8_e4m3fn, scale_inv [ceil(N / bn), ceil(K / bk)] float32).

    DeepSeek-V3's `weight_scale_inv`: per [bn, bk] block (partial at the edges),
    scale_inv = max(amax |w_block|, 1e-12) / 448 and w_q = e4m3(w_block / scale_inv).
    """
    name = "quantize_fp8_block"
    bn, bk = check_block_size(name, block_size)
    _check_2d(name, "w", w, FLOAT_DTYPES, "[N, K]")
    N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()  # zero padding never raises an amax
    amax = padded.abs().view(nb, bn, kb, bk).amax(dim=(1, 3))
    scale_inv = _div_exact(amax.clamp(min=WEIGHT_SCALE_EPS), FP8_MAX)
    w_q = quantize_fp8(w.float(), _expand_block_scales(scale_inv, w.shape, bn, bk))
    return w_q, scale_inv


def dequantize_fp8_block(
    w_q: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """w_q [N, K] e4m3 with scale_inv [ceil(N / bn), ceil(K / bk)] fp32 -> w_q * scale_inv [N, K] in `dtype`."""
    name = "dequantize_fp8_block"
    bn, bk = check_block_size(name, block_size)
    _check_2d(name, "w_q", w_q, (FP8_DTYPE,), "[N, K]")
    N, K = w_q.shape
    _check_2d(name, "scale_inv", scale_inv, (torch.float32,), "[ceil(N / bn), ceil(K / bk)]")
    if tuple(scale_inv.shape) != (-(-N // bn), -(-K // bk)):
        expected = [-(-N // bn), -(-K // bk)]
        raise ValueError(
            f"{name}: scale_inv must be [ceil(N / bn), ceil(K / bk)] = {expected}, got {list(scale_inv.shape)}"
        )
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype must be float32 / float16 / bfloat16, got {dtype}")
    return (w_q.float() * _expand_block_scales(scale_inv, w_q.shape, bn, bk)).to(dtype)
