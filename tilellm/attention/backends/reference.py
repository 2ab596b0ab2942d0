"""The PyTorch reference backend: `tilellm.kernels.reference`, the twin of every kernel (the CPU
default: exact fp32, the oracle's precision)."""

from __future__ import annotations

import tilellm.kernels.reference as reference_ops
import tilellm.kernels.reference.fused as reference_fused_ops
import tilellm.kernels.reference.mla as reference_mla_ops
from tilellm.attention.backends.base import AttentionBackend


class ReferenceBackend(AttentionBackend):
    """No plan beyond the mode: the twins need no tiles or split-KV segments."""

    name = "reference"
    ops = reference_ops
    mla_ops = reference_mla_ops
    fused_ops = reference_fused_ops
