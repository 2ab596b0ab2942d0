"""The engine under programmatic dependent launch (`TILELLM_PDL=1`, Hopper only): greedy tokens
equal to transformers' with the decode path's kernels launched with PDL and the linear layers of
small steps on `skinny_linear`, under decode CUDA graphs (the PDL edges are captured), chunked
prefill, async scheduling and preemption."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_greedy_vs_hf import CONFIGS, expected, run_twice
from tilellm.kernels import pdl
from tilellm.models.layers import linear as linear_layers

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs sm_90 or newer")


@pytest.fixture
def pdl_on(monkeypatch):
    pdl._pdl_enabled.cache_clear()
    monkeypatch.setenv("TILELLM_PDL", "1")
    yield
    pdl._pdl_enabled.cache_clear()


@pytest.mark.parametrize("config", ["default", "chunked_prefill", "async_chunked", "tiny_pool_preempts"])
def test_qwen3_greedy_matches_hf_under_pdl(tiny_qwen3, config, pdl_on, monkeypatch):
    calls = []
    real = linear_layers.skinny_linear
    monkeypatch.setattr(linear_layers, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    llm, first, second = run_twice(tiny_qwen3, **CONFIGS[config])
    assert pdl.pdl_enabled(torch.device("cuda"))
    assert calls, "no linear layer ran skinny_linear"
    assert sum(llm.llm_engine.runner.graph_replays.values()) > 0, "no decode step replayed a CUDA graph"
    want = expected(tiny_qwen3)
    assert first == want and second == want
