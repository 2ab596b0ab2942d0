"""Decode steps of requests sharing a cached prefix use cascade attention, with unchanged tokens."""

from __future__ import annotations

import numpy as np
import pytest

import tilellm.worker.step_inputs as metadata
from tests.conftest import DEVICE
from tests.engine.conftest import hf_greedy
from tilellm import LLM, SamplingParams


def test_shared_prefix_len():
    bs = 16
    table = np.array([[5, 6, 7, 8, 1], [5, 6, 7, 9, 2], [5, 6, 7, 8, 3]] * 3, dtype=np.int32)
    seq_lens = np.full(table.shape[0], 5 * bs, dtype=np.int64)
    old = metadata.CASCADE_MIN_PREFIX
    try:
        metadata.CASCADE_MIN_PREFIX = 16
        assert metadata.shared_prefix_len(table, seq_lens, bs) == 3 * bs  # column 3 differs
        # a request's last key is never in the shared prefix
        assert metadata.shared_prefix_len(table, np.minimum(seq_lens, 2 * bs + 1), bs) == 2 * bs
        assert metadata.shared_prefix_len(table[:4], seq_lens[:4], bs) == 0  # too few requests
        metadata.CASCADE_MIN_PREFIX = 4 * bs
        assert metadata.shared_prefix_len(table, seq_lens, bs) == 0  # too short to pay
    finally:
        metadata.CASCADE_MIN_PREFIX = old


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cascade_decode_tokens_match_transformers(tiny_qwen3, backend, monkeypatch):
    import tilellm.kernels as tk
    import tilellm.kernels.reference as ref

    ops = tk if backend == "triton" else ref
    calls = []
    real = ops.cascade_decode_attention
    monkeypatch.setattr(ops, "cascade_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    # A 5-block shared prefix under a lowered length threshold (the thresholds themselves are
    # test_shared_prefix_len's): the engine path is the same as for a 256-key prefix, and the
    # interpreter's prefill and cascade passes cost a fraction of 17 blocks'.
    monkeypatch.setattr(metadata, "CASCADE_MIN_PREFIX", 64)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 380, 5 * 16).tolist()
    prompts = [shared + rng.integers(0, 380, 3).tolist() for _ in range(metadata.CASCADE_MIN_REQUESTS + 1)]
    # Triton runs on the GPU when there is one (the interpreter's CPU tensors otherwise); there the
    # cascade kernel runs inside the captured cascade graphs.
    device = DEVICE if backend == "triton" else "cpu"
    llm = LLM(tiny_qwen3, device=device, num_kv_blocks=64, attention_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls, "no decode step used cascade attention"
    assert got == hf_greedy(tiny_qwen3, prompts, 3)


@pytest.mark.gpu
def test_cascade_graphs_match_eager_and_transformers(tiny_qwen3):
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 380, 17 * 16).tolist()
    prompts = [shared + rng.integers(0, 380, 2).tolist() for _ in range(metadata.CASCADE_MIN_REQUESTS + 3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    graphs = LLM(tiny_qwen3, num_kv_blocks=256)
    assert graphs.llm_engine.runner.cascade_graphs, "no cascade decode graphs were captured"
    with_graphs = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert graphs.llm_engine.runner.host_times.get("graph.steps", 0) > 0
    del graphs
    eager = LLM(tiny_qwen3, num_kv_blocks=256, enforce_eager=True)
    without = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert with_graphs == without == hf_greedy(tiny_qwen3, prompts, 4)
