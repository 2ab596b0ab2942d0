"""Files shipped inside the package: the embedded default model.

`tiny-arith/` is a 3-layer Qwen3 (about 0.7 M parameters, character-level tokenizer) trained by
`tools/train_tiny_model.py` to add multi-digit numbers; see its README.md. It lets `tilellm demo`,
`tilellm generate` and the tests run offline without downloading anything.

`tiny-copy/` is a 4-layer Qwen3 (about 1.0 M parameters, the same tokenizer) trained by
`tools/train_copy_model.py` to rewrite a record with one field changed: its answers copy the
prompt, so speculative decoding by prompt lookup accepts most drafts (`tilellm demo --speculative`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "tiny-arith"
COPY_MODEL_NAME = "tiny-copy"


def default_model_path() -> Path:
    """Directory of the embedded model (a Hugging Face directory: config.json, model.safetensors, ...)."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL_NAME


def copy_model_path() -> Path:
    """Directory of the embedded record-editing model (speculative decoding's demo)."""
    return Path(__file__).resolve().parent / COPY_MODEL_NAME


def demo_metadata(model_dir: str | Path | None = None) -> dict[str, Any]:
    """The task and measured accuracy recorded next to the model (`tilellm_demo.json`)."""
    path = Path(model_dir) if model_dir is not None else default_model_path()
    return json.loads((path / "tilellm_demo.json").read_text())
