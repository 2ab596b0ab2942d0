"""Acceptance of drafts under sampling: rejection sampling (Leviathan et al., 2023).

A draft token x drawn from the proposer's distribution q is accepted with probability
min(1, p(x) / q(x)), p being the target's distribution at that position (after temperature and
the request's top-k / top-p / min-p: exactly what a step without speculation samples from);
when rejected, the token is drawn from the residual max(p - q, 0), normalised. Either way the
token is distributed as p. After the last accepted draft token the sampler's own draw (from p)
follows.

Point-mass proposals (n-gram lookup, a greedy draft) need no code of their own: q(x) = 1, so x is
accepted with probability p(x) and the residual is p without x, which is what the Gumbel-max draw
of the ordinary sampler gives when it is compared with the draft: it equals x with probability
p(x), and otherwise it is distributed as p conditioned on not being x. With the same noise as a
step without speculation (keyed by the seed and the token's index), a seeded request then emits
the same tokens with speculation on or off.

Uniforms come from the sampler's counter-based hash with stream keys of their own, so every
decision is reproducible from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tilellm.kernels.sampling import device_row_keys, gumbel_noise, uniform_noise

ACCEPT_STREAM = 0x27D4EB2F  # xor-ed into a request's seed key
RESIDUAL_STREAM = 0x165667B1


@dataclass
class DraftVerification:
    """The draft tokens a verification step checks against full proposal distributions.

    rows: [M] int64, the logits row at which each draft token is checked (the row of the
    position before it); token_ids: [M] int64; probs: [M, V] float32, q of each (rows of
    greedy requests are ignored: they accept on equality with the argmax)."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    probs: torch.Tensor


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    seed_keys: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """[M] tokens: the draft token where accepted, else a draw from the residual.

    target_probs, draft_probs: [M, V] float32; draft_ids, seed_keys, steps: [M] int64."""
    px = target_probs.gather(1, draft_ids[:, None])[:, 0]
    qx = draft_probs.gather(1, draft_ids[:, None])[:, 0]
    u = uniform_noise(device_row_keys(seed_keys ^ ACCEPT_STREAM, steps))
    accept = u * qx < px  # u < p(x) / q(x), without dividing by a zero q
    residual = (target_probs - draft_probs).clamp_min_(0)
    # p == q everywhere leaves no residual, and then x is always accepted.
    noise = gumbel_noise(device_row_keys(seed_keys ^ RESIDUAL_STREAM, steps), target_probs.shape[1])
    recovered = (residual.log() + noise).argmax(dim=-1)
    return torch.where(accept, draft_ids, recovered)
