"""Model classes (Llama, Qwen2, Qwen3), their tensor-parallel layers and the checkpoint loader.

from tilellm.models import load_model, model_kv_spec
model, config = load_model(model_dir, dtype="auto", device="cuda")
num_layers, num_kv_heads, head_dim = model_kv_spec(config)
hidden = model(input_ids, positions)            # inside attention_context(step metadata)
logits = model.compute_logits(hidden[logits_indices])
"""

from tilellm.models.loader import load_model, model_kv_spec
from tilellm.models.registry import get_model_class, supported_architectures

__all__ = ["load_model", "model_kv_spec", "get_model_class", "supported_architectures"]
