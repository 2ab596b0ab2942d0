"""Fixtures for the tensor-parallel tests: tiny random checkpoints (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch

# Two cores shared by the driver and its worker: one thread each (workers copy the driver's count).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_qwen3_kv2(tmp_path_factory) -> str:
    from tilellm.testing import make_tiny_model

    path = tmp_path_factory.mktemp("qwen3_kv2")
    return str(make_tiny_model(path, "Qwen3ForCausalLM", num_kv_heads=2, seed=3))


@pytest.fixture(scope="session")
def tiny_llama_kv1(tmp_path_factory) -> str:
    from tilellm.testing import make_tiny_model

    path = tmp_path_factory.mktemp("llama_kv1")
    return str(make_tiny_model(path, "LlamaForCausalLM", num_kv_heads=1, tie_word_embeddings=False, seed=4))
