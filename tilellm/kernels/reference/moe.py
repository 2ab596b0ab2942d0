"""PyTorch twin of `tilellm.kernels.moe.fused_moe`: the routed experts of a mixture-of-experts layer.

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
    e = topk_ids[t, k]

A loop over the experts that received tokens, as transformers' `DeepseekV3Experts.forward` runs
it (experts in ascending order, each expert's rows added into the output with `index_add_`), but
in fp32 throughout; the result comes back in `hidden_states.dtype`. It reads the routing on the
host (one sync per call): it is the CPU oracle of the tests, not a path for CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilellm.kernels.moe import check_fused_moe


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts: hidden_states [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
    topk_weights [T, K] float32, topk_ids [T, K] int -> [T, H] in hidden_states.dtype (into `out` if given).
    """
    check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, out)
    T, H = hidden_states.shape
    E, I, K = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    acc = torch.zeros(T, H, dtype=torch.float32, device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1).long()  # pair p = t * K + k
    flat_weights = topk_weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, in token order
    counts = torch.bincount(flat_ids, minlength=E).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // K
        gate_up = hidden_states[tokens].float() @ w13[e].float().T  # [n, 2I]
        h = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # [n, I]
        y = (h @ w2[e].float().T) * flat_weights[pairs, None]  # [n, H]
        acc.index_add_(0, tokens, y)
    if out is None:
        return acc.to(hidden_states.dtype)
    return out.copy_(acc)
