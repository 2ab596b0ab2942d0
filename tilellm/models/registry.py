"""Architecture name (config.json's `architectures`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under tilellm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`; ValueError naming it and the supported ones if unknown."""
    if architecture not in _MODELS:
        supported = ", ".join(supported_architectures())
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {supported}")
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"tilellm.models.{module_name}")
    return getattr(module, class_name)
