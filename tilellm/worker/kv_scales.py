"""The dequantization scales of a model's FP8 KV cache: one fp32 scale per layer's K and V
(MLA's latent rows: one), and binding them with the cache to the attention layers.

    scales = KVScales(model.attention_layers(), num_caches=2, device=device, name="the model")
    bind_kv_cache(layers, kv_cache, scales)  # each layer: its K / V cache views and scale views
    with scales.measuring():                 # around every real forward: the first one measures
        model(...)
    scales.log_once()                        # after that step: one line with the measured range

The scales live in device memory ([num_layers, num_caches]) so that CUDA graphs captured at
start-up replay with the values set later. They come from the checkpoint when every layer ships
them (`Attention.checkpoint_kv_scales`); else every layer measures its own on the first real step
(warm-up and capture run before it and leave them at 1): `AttentionBackend.forward` sets them from
that step's K and V before storing them (`fp8.measure_kv_scale`). The target model and a draft
model each hold one (the draft's cache has its own values).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


class KVScales:
    """The FP8 cache's scales of `layers` (see the module docstring); `name` is what the log
    lines call the model ("the model", "the draft model")."""

    def __init__(self, layers: Sequence[Any], num_caches: int, device: torch.device, name: str = "the model"):
        self.layers = layers
        self.name = name
        self.values = torch.ones(len(layers), num_caches, device=device)
        self.names = ("k",) if num_caches == 1 else ("k", "v")  # MLA: the latent rows'
        shipped = [layer.checkpoint_kv_scales for layer in layers]
        self.pending = False  # measured on the next real forward
        self._logged = True
        if all(all(n in s for n in self.names) for s in shipped):
            self.values.copy_(torch.tensor([[s[n] for n in self.names] for s in shipped]))
            logger.info("FP8 KV cache scales of %s from the checkpoint (%d layers)", name, len(layers))
            return
        if any(shipped):
            have = sum(all(n in s for n in self.names) for s in shipped)
            logger.warning(
                "the checkpoint of %s ships KV cache scales for %d of %d layers: measuring them all "
                "on the first prompt instead", name, have, len(layers),
            )  # fmt: skip
        self.pending = True

    def measuring(self) -> contextlib.AbstractContextManager:
        """Around a real forward: the first one (scales still pending) has every layer set its
        scales from the values it stores; the others run as they are. Every tensor-parallel rank
        does it for its own heads."""
        return self._measure() if self.pending else contextlib.nullcontext()

    @contextlib.contextmanager
    def _measure(self) -> Iterator[None]:
        for layer in self.layers:
            layer.calibrate_kv_scales = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer.calibrate_kv_scales = False
            self.pending = False
            self._logged = False

    def log_once(self) -> None:
        """Say, once, the scales the first step measured (one host read, after that step)."""
        if self.pending or self._logged:
            return
        self._logged = True
        lo, hi = self.values.amin(0).tolist(), self.values.amax(0).tolist()
        names = ("latent rows",) if len(self.names) == 1 else ("K", "V")
        logger.info(
            "FP8 KV cache scales of %s measured on the first prompt: %s",
            self.name,
            ", ".join(f"{n} {a:.3g}..{b:.3g}" for n, a, b in zip(names, lo, hi)),
        )


def bind_kv_cache(layers: Sequence[Any], kv_cache: torch.Tensor, scales: KVScales | None = None) -> None:
    """Layer i's caches (`kv_cache[:, i]`), and with an FP8 cache its scales (views of
    `scales.values[i]`)."""
    for i, layer in enumerate(layers):
        views = scales.values[i].split(1) if scales is not None else ()
        layer.bind_kv_cache(*kv_cache[:, i], *views)
