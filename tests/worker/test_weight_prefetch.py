"""`WeightPrefetcher`: which weights a small step asks for in L2, and when; and the engine's greedy
tokens unchanged with prefetching on (Hopper), the prefetches captured into its decode graphs.

On the CPU the prefetch itself is a stand-in that records what it is given, so the order logic
is checked everywhere: the first watched forward records the layers' call order and asks for
nothing; later ones ask, at each layer, for the weights `distance` layers ahead (at the first
layer, for the first `distance + 1`); steps of more than `max_tokens` tokens ask for nothing;
outside `watching` no hook stays installed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.engine.test_greedy_vs_hf import CONFIGS, expected, run_twice
from tilellm.kernels.prefetch import prefetch_l2, prefetch_supported
from tilellm.worker.weight_prefetch import WeightPrefetcher, prefetch_distance

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


class Chain(nn.Module):
    """Linear layers called in an order other than their registration order: c, a, b, then a
    second time a (a layer called twice keeps its first place)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(self.c(x))))


def _watched(distance: int, max_tokens: int = 64):
    model, asked = Chain(), []
    prefetcher = WeightPrefetcher(
        model, (nn.Linear,), distance, max_tokens=max_tokens, issue=lambda ts: asked.append(list(ts))
    )
    return model, prefetcher, asked


def _names(model: nn.Module, asked: list[list[torch.Tensor]]) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(t)] for t in ts] for ts in asked]


def test_the_first_forward_records_the_call_order_and_asks_for_nothing():
    model, prefetcher, asked = _watched(1)
    with prefetcher.watching(num_tokens=1):
        model(torch.randn(1, 4))
    assert asked == []
    assert prefetcher.order == [model.c, model.a, model.b]


@pytest.mark.parametrize(
    ("distance", "want"),
    [
        # at c (first): c and a; at a: b; at b: nothing further; a's second call asks for b again
        (1, [["c.weight", "c.bias", "a.weight", "a.bias"], ["b.weight", "b.bias"], ["b.weight", "b.bias"]]),
        # at c: c, a, b; then nothing is two places ahead of a or b
        (2, [["c.weight", "c.bias", "a.weight", "a.bias", "b.weight", "b.bias"]]),
    ],
)
def test_each_layer_asks_for_the_weights_distance_layers_ahead(distance, want):
    model, prefetcher, asked = _watched(distance)
    x = torch.randn(2, 4)
    with prefetcher.watching(num_tokens=2):
        model(x)
    with prefetcher.watching(num_tokens=2):
        y = model(x)
    assert _names(model, asked) == want
    assert torch.equal(y, model(x))  # the hooks leave the forward's result alone


def test_steps_of_more_than_max_tokens_ask_for_nothing_and_no_hook_stays():
    model, prefetcher, asked = _watched(1, max_tokens=4)
    with prefetcher.watching(num_tokens=1):
        model(torch.randn(1, 4))
    with prefetcher.watching(num_tokens=5):
        model(torch.randn(5, 4))
    assert asked == []
    model(torch.randn(1, 4))
    assert asked == []
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_a_distance_below_one_is_refused():
    with pytest.raises(ValueError, match="distance must be >= 1"):
        WeightPrefetcher(Chain(), (nn.Linear,), 0)


@pytest.mark.parametrize(("raw", "want"), [(None, 0), ("0", 0), ("2", 2)])
def test_the_distance_comes_from_the_environment(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("TILELLM_WEIGHT_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("TILELLM_WEIGHT_PREFETCH", raw)
    assert prefetch_distance() == want


@pytest.mark.parametrize("raw", ["-1", "yes"])
def test_a_bad_distance_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("TILELLM_WEIGHT_PREFETCH", raw)
    with pytest.raises(ValueError, match="TILELLM_WEIGHT_PREFETCH"):
        prefetch_distance()


def test_prefetch_l2_does_nothing_where_it_cannot_prefetch():
    t = torch.randn(1000)
    assert not prefetch_supported(t.device)
    prefetch_l2(t)  # a CPU tensor: no launch, no error


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the L2 bulk prefetch needs sm_90 or newer")
def test_prefetch_l2_leaves_the_tensor_and_its_readers_alone():
    t = torch.randn(3 << 20, device="cuda")  # 12 MB, a ragged last chunk
    before = t.clone()
    prefetch_l2(t[: t.numel() - 3])  # a size that is not a multiple of 16 bytes
    torch.cuda.synchronize()
    assert torch.equal(t, before)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the L2 bulk prefetch needs sm_90 or newer")
@pytest.mark.parametrize("config", ["default", "async_chunked", "tiny_pool_preempts"])
def test_qwen3_greedy_matches_hf_with_weight_prefetch(tiny_qwen3, config, monkeypatch):
    monkeypatch.setenv("TILELLM_WEIGHT_PREFETCH", "1")
    llm, first, second = run_twice(tiny_qwen3, **CONFIGS[config])
    runner = llm.llm_engine.runner
    assert runner.weight_prefetch is not None and runner.weight_prefetch.order, "no order recorded"
    assert sum(runner.graph_replays.values()) > 0, "no decode step replayed a CUDA graph"
    want = expected(tiny_qwen3)
    assert first == want and second == want
