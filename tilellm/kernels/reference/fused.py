"""PyTorch twins of the fused element-wise ops in `tilellm.kernels.fused` (same signatures).

All three compute in fp32 and return the input dtype. Validation is shared with the Triton
versions, so both raise the same `ValueError` on the same bad input.
"""

from __future__ import annotations

import torch

import tilellm.kernels.reference as reference_kernels
from tilellm.kernels import validation

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> None:
    _check_float("x", x)
    _check_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(f"rms_norm: x must be [N, H], got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm: weight must be [H={x.shape[1]}], got shape {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device} but x is on {x.device}")
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be > 0, got {eps}")
    if residual is not None:
        _check_float("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"rms_norm: residual ({residual.dtype}, {residual.device}) must match x ({x.dtype}, {x.device})"
            )


def check_silu_and_mul(x: torch.Tensor) -> None:
    _check_float("x", x)
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(
            f"silu_and_mul: x must be [N, 2*I] with an even last dim, got shape {tuple(x.shape)}"
        )


def check_apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    _check_float("q", q)
    _check_float("k", k)
    _check_float("cos_sin_cache", cos_sin_cache)
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"apply_rotary: q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(
            f"apply_rotary: k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in T or D"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"apply_rotary: q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if d % 2 != 0:
        raise ValueError(f"apply_rotary: head_dim must be even, got {d}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d:
        raise ValueError(
            f"apply_rotary: cos_sin_cache must be [max_pos, D={d}], got {tuple(cos_sin_cache.shape)}"
        )
    if positions.dim() != 1 or positions.shape[0] != t:
        raise ValueError(f"apply_rotary: positions must be [T={t}], got shape {tuple(positions.shape)}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"apply_rotary: positions must be int32 or int64, got {positions.dtype}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("apply_rotary: pass both q_norm_weight and k_norm_weight, or neither")
    devices = {"k": k, "positions": positions, "cos_sin_cache": cos_sin_cache}
    if q_norm_weight is not None:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            _check_float(name, w)
            if w.shape != (d,):
                raise ValueError(f"apply_rotary: {name} must be [D={d}], got shape {tuple(w.shape)}")
            devices[name] = w
        if not eps > 0:
            raise ValueError(f"apply_rotary: eps must be > 0, got {eps}")
    for name, other in devices.items():
        if other.device != q.device:
            raise ValueError(f"apply_rotary: {name} is on {other.device} but q is on {q.device}")
    if t > 0 and validation.deep_checks_enabled(positions):
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(
                f"apply_rotary: positions must lie in [0, {cos_sin_cache.shape[0]}) (the cache length), "
                f"got min {lo} max {hi}"
            )


def _check_group_quant(name: str, k: int, group_size: int, eps: float, eps_name: str = "eps") -> None:
    """The quantization arguments of a fused op whose k-wide output is quantized per token and
    group, as `per_token_group_quant_fp8` takes them."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"{name}: group_size must be a positive int, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"{name}: the {k} quantized channels must be a multiple of group_size {group_size}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{name}: {eps_name} must be a positive number, got {eps!r}")


def check_silu_and_mul_quant(x: torch.Tensor, group_size: int, eps: float) -> None:
    """x [N, 2I] = [gate | up] with I a multiple of group_size (`silu_and_mul`'s output as
    `per_token_group_quant_fp8` takes it)."""
    check_silu_and_mul(x)
    _check_group_quant("silu_and_mul_per_token_group_quant_fp8", x.shape[1] // 2, group_size, eps)


def check_rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    group_size: int,
    quant_eps: float,
) -> None:
    """`rms_norm`'s arguments, with H a multiple of group_size, a power of two (the kernel views
    a row as whole groups)."""
    name = "rms_norm_per_token_group_quant_fp8"
    check_rms_norm(x, weight, eps, residual)
    _check_group_quant(name, x.shape[1], group_size, quant_eps, "quant_eps")
    if group_size & (group_size - 1):
        raise ValueError(f"{name}: group_size must be a power of two, got {group_size}")


def check_rotary_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    """Whether `apply_rotary` also stores: none of its cache arguments given (False), or all of
    v, k_cache, v_cache and slot_mapping, as `store_kvcache` takes them (an FP8 cache's scales
    optional)."""
    given = {"v": v, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    missing = [name for name, t in given.items() if t is None]
    if len(missing) == len(given):
        return False
    if missing:
        raise ValueError(
            f"apply_rotary: storing into the KV cache needs v, k_cache, v_cache and slot_mapping; "
            f"{', '.join(missing)} missing"
        )
    validation.check_store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return True


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim of x [N, H].

    With `residual`: residual = x + residual (rounded to x.dtype, as an unfused model would),
    then y = norm(residual); returns (y, residual).
    """
    check_rms_norm(x, weight, eps, residual)
    if residual is not None:
        residual = (x.float() + residual.float()).to(x.dtype)
        x = residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    y = y.to(x.dtype)
    return y if residual is None else (y, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up, [N, I]."""
    check_silu_and_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def rms_norm_per_token_group_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    *,
    residual: torch.Tensor | None = None,
    quant_eps: float = 1e-10,
    column_major_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] -> per_token_group_quant_fp8(rms_norm(x, weight, eps, residual=residual), ...):
    (x_q [N, H] float8_e4m3fn, x_s [N, H // group_size] float32), plus the new residual when
    `residual` is given."""
    check_rms_norm_quant(x, weight, eps, residual, group_size, quant_eps)
    normed = rms_norm(x, weight, eps, residual=residual)
    y, res_out = normed if residual is not None else (normed, None)
    x_q, x_s = reference_kernels.per_token_group_quant_fp8(
        y, group_size, eps=quant_eps, column_major_scales=column_major_scales
    )
    return (x_q, x_s) if res_out is None else (x_q, x_s, res_out)


def silu_and_mul_per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int, *, eps: float = 1e-10, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, 2I] = [gate | up] -> per_token_group_quant_fp8(silu_and_mul(x), group_size, ...):
    (x_q [N, I] float8_e4m3fn, x_s [N, I // group_size] float32)."""
    check_silu_and_mul_quant(x, group_size, eps)
    return reference_kernels.per_token_group_quant_fp8(
        silu_and_mul(x), group_size, eps=eps, column_major_scales=column_major_scales
    )


def interleaved_to_halves(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[0, 2, ..., d - 2, 1, 3, ..., d - 1]: the index that puts interleaved rotary pairs (x0, x1),
    (x2, x3), ... into the NeoX halves [evens | odds]."""
    return torch.cat((torch.arange(0, d, 2, device=device), torch.arange(1, d, 2, device=device)))


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX / HF "rotate_half" rotary embedding on q [T, Hq, D] and k [T, Hkv, D].

    cos_sin_cache [max_pos, D]: row p = [cos(p * f_0..f_{D/2-1}) | sin(p * f_0..f_{D/2-1})].
    With x = [x1 | x2] (halves of D): out = [x1 cos - x2 sin | x2 cos + x1 sin]. Returns new tensors.
    With q_norm_weight and k_norm_weight [D] (Qwen3), each head is first RMS-normalised over D
    and scaled by its weight (no rounding in between).
    With v, k_cache, v_cache and slot_mapping: then `store_kvcache(k_rotated, v, k_cache, v_cache,
    slot_mapping, k_scale=k_scale, v_scale=v_scale)`.
    `interleaved`: the dims in pairs (x0, x1), (x2, x3), ...: q, k and the norm weights permuted
    to [evens | odds] first (the outputs keep that layout).
    """
    check_apply_rotary(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
    store = check_rotary_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if interleaved:
        perm = interleaved_to_halves(q.shape[-1], q.device)
        q, k = q[..., perm], k[..., perm]
        if q_norm_weight is not None and k_norm_weight is not None:
            q_norm_weight, k_norm_weight = q_norm_weight[perm], k_norm_weight[perm]
    half = q.shape[-1] // 2
    cs = cos_sin_cache.float()[positions.long()]  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        xf = x.float()
        if w is not None:
            xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()
        x1, x2 = xf.split(half, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    q_out, k_out = rotate(q, q_norm_weight), rotate(k, k_norm_weight)
    if store:
        reference_kernels.store_kvcache(
            k_out, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
        )
    return q_out, k_out
