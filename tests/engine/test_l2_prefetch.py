"""The engine with each decoder layer's later weights prefetched into L2 by its rotary launch
(`TILELLM_L2_PREFETCH=1`, `tilellm.kernels.prefetch`): the tables bound at load, the launches
asking for them, and greedy tokens equal to transformers'. On the CPU the binding is forced (the
rotary launch there plans no prefetch); on Hopper the prefetch runs, in decode graphs too."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_greedy_vs_hf import CONFIGS, expected, run_twice
from tilellm.kernels import fused
from tilellm.models import llama
from tilellm.models.layers.attention import Attention

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _spy_rotary(monkeypatch) -> list[tuple[bool, bool]]:
    """(a table was given, the launch prefetches) for every rotary launch planned."""
    planned: list[tuple[bool, bool]] = []
    real_check, real_plan = fused.check_l2_prefetch_table, fused._plan_rotary
    given: list[bool] = []

    def check(table, device):
        given.append(table is not None)
        return real_check(table, device)

    def plan(*args, **kwargs):
        launch = real_plan(*args, **kwargs)
        planned.append((given[-1], launch.prefetch))
        return launch

    monkeypatch.setattr(fused, "check_l2_prefetch_table", check)
    monkeypatch.setattr(fused, "_plan_rotary", plan)
    fused._ROTARY_REMEMBERED.clear()
    return planned


def _tables(llm) -> list[torch.Tensor]:
    model = llm.llm_engine.runner.model
    return [m.l2_prefetch for m in model.modules() if isinstance(m, Attention) and m.l2_prefetch is not None]


def _table_bytes(llm, mode: str) -> list[int]:
    """What each layer's table should cover: o_proj, gate-up and down_proj, and in the "next"
    mode the next layer's qkv projection (the last layer: none)."""
    layers = list(llm.llm_engine.runner.model.model.layers)

    def nbytes(w):
        return w.numel() * w.element_size() // 16 * 16

    want = []
    for i, layer in enumerate(layers):
        weights = [layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
        if mode == "next" and i + 1 < len(layers):
            weights.append(layers[i + 1].self_attn.qkv_proj.weight)
        want.append(sum(nbytes(w) for w in weights))
    return want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the test below")
@pytest.mark.parametrize("mode", ["1", "next"])
def test_tables_bound_and_tokens_kept_on_the_cpu(tiny_qwen3, mode, monkeypatch):
    monkeypatch.setattr(llama, "l2_prefetch_mode", lambda device: mode)
    planned = _spy_rotary(monkeypatch)
    llm, first, second = run_twice(tiny_qwen3, attention_backend="triton", **CONFIGS["default"])
    tables = _tables(llm)
    assert [int(t[1].sum()) for t in tables] == _table_bytes(llm, mode)
    assert any(given for given, _ in planned), "no rotary launch was handed its layer's table"
    assert not any(on for _, on in planned), "a CPU launch planned the bulk prefetch"
    want = expected(tiny_qwen3)
    assert first == want and second == want


def test_no_tables_unless_asked(tiny_qwen3, monkeypatch):
    from tilellm import LLM

    monkeypatch.delenv("TILELLM_L2_PREFETCH", raising=False)
    llm = LLM(tiny_qwen3, num_kv_blocks=16)
    assert _tables(llm) == []


@pytest.mark.skipif(not HOPPER, reason="the bulk L2 prefetch needs sm_90 or newer")
@pytest.mark.parametrize(
    ("mode", "config"),
    [("1", "default"), ("1", "async_chunked"), ("1", "tiny_pool_preempts"), ("next", "default")],
)
def test_qwen3_greedy_matches_hf_with_l2_prefetch(tiny_qwen3, mode, config, monkeypatch):
    monkeypatch.setenv("TILELLM_L2_PREFETCH", mode)
    planned = _spy_rotary(monkeypatch)
    llm, first, second = run_twice(tiny_qwen3, **CONFIGS[config])
    assert [int(t[1].sum()) for t in _tables(llm)] == _table_bytes(llm, mode)
    assert any(on for _, on in planned), "no rotary launch prefetched"
    assert sum(llm.llm_engine.runner.graph_replays.values()) > 0, "no decode step replayed a CUDA graph"
    want = expected(tiny_qwen3)
    assert first == want and second == want
