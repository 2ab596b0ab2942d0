"""Default sampling values from a model's `generation_config.json`, as vLLM applies them.

    defaults = default_sampling_values(model_dir, "auto")   # {"temperature": 0.6, "top_p": 0.95, ...}

A request that does not set one of these fields gets the model's value (`LLM.generate` without
`sampling_params`, and every server request); what a request sets always wins. `source`: "auto"
reads the model directory's file, "vllm" uses none (the library's own defaults), any other value
is a directory holding a generation_config.json.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field (vLLM's list).
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def default_sampling_values(model_dir: str, source: str = "auto") -> dict[str, Any]:
    """SamplingParams keyword defaults from `source`'s generation_config.json (see the module
    docstring). ValueError naming `generation_config` when a given directory has no such file."""
    if source == "vllm":
        return {}
    directory = pathlib.Path(model_dir if source == "auto" else source)
    path = directory / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"generation_config: {path} does not exist (use auto, vllm or a directory)")
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"generation_config: {path} is not valid JSON ({e})") from None
    out = {
        field: raw[key]
        for key, field in _FIELDS.items()
        if isinstance(raw, dict) and raw.get(key) is not None
    }
    if out:
        logger.info("default sampling values from %s: %s", path, out)
    return out
