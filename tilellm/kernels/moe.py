"""Fused mixture-of-experts layer (the routed experts of DeepSeek-V2/V3, Qwen3-MoE) in Triton.

The Triton kernels land in this module next; `check_fused_moe` (the input checks shared with the
PyTorch twin in `tilellm.kernels.reference.moe`) is here already.
"""

from __future__ import annotations

import torch

from tilellm.kernels import validation

# ----------------------------------------------------------------------------------------------
# Input checks (shared with the PyTorch twin)
# ----------------------------------------------------------------------------------------------


def check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, out, name: str = "fused_moe") -> None:
    """Shapes, dtypes and devices of `fused_moe`'s arguments; expert ids in range under deep checks.

    Layouts: hidden_states [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K].
    """
    _check_tensor(name, "hidden_states", hidden_states, 2, "[T, H]")
    _check_tensor(name, "w13", w13, 3, "[E, 2 * I, H]")
    _check_tensor(name, "w2", w2, 3, "[E, H, I]")
    _check_tensor(name, "topk_weights", topk_weights, 2, "[T, K]")
    _check_tensor(name, "topk_ids", topk_ids, 2, "[T, K]")
    _check_dtypes(name, hidden_states, w13, w2, topk_weights, topk_ids)
    _check_devices(name, hidden_states, w13, w2, topk_weights, topk_ids)
    _check_shapes(name, hidden_states, w13, w2, topk_weights, topk_ids)
    T, H = hidden_states.shape
    if out is not None:
        validation.check_out(name, out, (T, H), hidden_states.dtype, hidden_states.device)
    if topk_ids.numel() and validation.deep_checks_enabled(topk_ids):
        _check_ids_in_range(name, topk_ids, w13.shape[0])


def _check_tensor(name, arg, t, ndim, layout) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {arg} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: {arg} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_dtypes(name, hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    if hidden_states.dtype not in validation.FLOAT_DTYPES:
        raise ValueError(
            f"{name}: hidden_states must be float16, bfloat16 or float32, got {hidden_states.dtype}"
        )
    for arg, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden_states.dtype:
            raise ValueError(
                f"{name}: {arg} dtype {w.dtype} differs from hidden_states dtype {hidden_states.dtype}"
            )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"{name}: topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: topk_ids must be int32 or int64, got {topk_ids.dtype}")


def _check_devices(name, hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    others = {"w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    for arg, t in others.items():
        if t.device != hidden_states.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but hidden_states is on {hidden_states.device}")


def _check_shapes(name, hidden_states, w13, w2, topk_weights, topk_ids) -> None:
    T, H = hidden_states.shape
    E, two_i, w13_h = w13.shape
    if E < 1:
        raise ValueError(f"{name}: w13 [E, 2 * I, H] needs at least one expert, got shape {tuple(w13.shape)}")
    if two_i < 2 or two_i % 2:
        raise ValueError(
            f"{name}: w13 [E, 2 * I, H] must have an even, positive dim 1 (gate rows then up rows), "
            f"got shape {tuple(w13.shape)}"
        )
    if w13_h != H:
        raise ValueError(f"{name}: w13 [E, 2 * I, H] has H = {w13_h}, but hidden_states [T, H] has H = {H}")
    expected_w2 = (E, H, two_i // 2)
    if tuple(w2.shape) != expected_w2:
        raise ValueError(
            f"{name}: w2 must be [E, H, I] = {expected_w2} (E, I from w13 [E, 2 * I, H], H from hidden_states), "
            f"got {tuple(w2.shape)}"
        )
    if topk_ids.shape[0] != T:
        raise ValueError(
            f"{name}: topk_ids [T, K] must have T = {T} rows (one per token), got {topk_ids.shape[0]}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"{name}: topk_weights [T, K] shape {tuple(topk_weights.shape)} must equal topk_ids shape "
            f"{tuple(topk_ids.shape)}"
        )


def _check_ids_in_range(name, topk_ids, num_experts) -> None:
    ids = topk_ids.cpu().long()
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        t, k = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name}: topk_ids[{t}, {k}] = {int(ids[t, k])} is out of range [0, {num_experts}) (E from w13)"
        )
