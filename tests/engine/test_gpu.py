"""The CUDA paths of the runner: CUDA graphs, pool sizing, async scheduling, the fused sampler.

Skipped without a GPU. fp32 keeps the engine and the `transformers` oracle on the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import hf_greedy
from tests.engine.test_greedy_vs_hf import MAX_TOKENS, _prompts
from tilellm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(enforce_eager=True),
        dict(),  # CUDA graphs for decode steps
        dict(num_kv_blocks=8, max_num_seqs=8),  # preemption, with graphs and async scheduling
        dict(max_num_batched_tokens=13),  # chunked prefill: mixed steps between graph steps
    ],
)
def test_cuda_greedy_matches_hf(tiny_qwen3, kwargs):
    want = hf_greedy(tiny_qwen3, _prompts(), MAX_TOKENS)
    llm = LLM(tiny_qwen3, device="cuda", dtype="float32", **{"num_kv_blocks": 64, **kwargs})
    engine = llm.llm_engine
    assert engine.async_scheduling  # LLM turns it on on CUDA
    if not kwargs.get("enforce_eager"):
        assert engine.runner.graphs, "CUDA graph capture failed (see the log)"
    assert _tokens(llm, _prompts()) == want
    assert _tokens(llm, _prompts()) == want  # again, through the prefix cache


def test_pool_sized_from_free_memory(tiny_qwen3):
    free, total = torch.cuda.mem_get_info()
    llm = LLM(tiny_qwen3, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=16)
    runner = llm.llm_engine.runner
    pool_bytes = runner.num_kv_blocks * runner.block_bytes
    assert runner.num_kv_blocks > 0 and pool_bytes <= 0.3 * total
    assert llm.llm_engine.max_model_len == 512  # the model's limit, not capped by the pool
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_with_graphs(tiny_qwen3, dtype):
    llm = LLM(tiny_qwen3, device="cuda", dtype=dtype, num_kv_blocks=128, max_num_seqs=32)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True, seed=3)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = llm.generate(["Hello"] + ["The moon"] * 19, [params] + [others] * 19, use_tqdm=False)
    b = llm.generate(["Hello", "Once"], [params, others], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in a)
    assert len({tuple(o.outputs[0].token_ids) for o in a[1:]}) > 1  # unseeded rows differ
    if dtype == "float32":  # bf16 logits depend on the batch shape too much to compare draws
        assert b[0].outputs[0].token_ids == a[0].outputs[0].token_ids  # seeded: batch-independent
    assert llm.llm_engine.runner.graphs


@pytest.mark.parametrize("num_short", [70, 140])
def test_short_and_long_context_graphs_match_eager(tmp_path, num_short):
    """With max_model_len >= 2 * MIN_KEYS_PER_SPLIT the decode graphs of batches that fill the
    GPU split the KV range, and a second graph per bucket runs while contexts are short: without
    split-KV where the batch has SMALL_BATCH_SPLIT_BELOW programs per SM or more, in short
    segments below that (70 and 140 requests of the tiny model's 2 KV heads: 140 and 280
    programs, on either side of a bound of 2 on 132 SMs); the smallest batches split short
    contexts in their one graph. Every
    graph gives the eager engine's greedy tokens: short prompts replay the short graphs, a prompt
    past the split threshold replays the splitting ones (its batch's longest context decides), and
    a single short prompt replays its bucket's plain graph, split into short segments."""
    from tilellm.kernels.schedule import MIN_CONTEXT_TO_SPLIT, SMALL_BATCH_SPLIT_BELOW
    from tilellm.testing import make_tiny_model

    model = str(make_tiny_model(tmp_path / "m", seed=4, max_position_embeddings=4 * MIN_CONTEXT_TO_SPLIT))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 300, (num_short,), generator=g)
    short = [torch.randint(0, 300, (int(n),), generator=g).tolist() for n in lengths]
    long = [torch.randint(0, 300, (MIN_CONTEXT_TO_SPLIT + 7,), generator=g).tolist()]
    single = [torch.randint(0, 300, (700,), generator=g).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(llm: LLM, prompts) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = LLM(model, device="cuda", dtype="float32", num_kv_blocks=4096, enforce_eager=True)
    want_short, want_long, want_single = run(eager, short), run(eager, short + long), run(eager, single)
    del eager
    llm = LLM(model, device="cuda", dtype="float32", num_kv_blocks=4096, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    assert runner.short_graphs and set(runner.short_graphs) <= set(runner.graphs)
    assert 1 not in runner.short_graphs and runner.decode_splits(1, 700) > 1
    bucket = runner.decode_graphs.bucket(num_short)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    few_per_sm = 2 * bucket < SMALL_BATCH_SPLIT_BELOW * sms  # (2 KV heads: 2 programs a request)
    assert bucket in runner.short_graphs
    assert (runner.decode_splits(bucket, MIN_CONTEXT_TO_SPLIT - 1) > 1) == few_per_sm
    assert run(llm, short) == want_short
    # (a step of only part of the batch, between its prefill chunks, may replay a small bucket's plain graph)
    assert runner.graph_replays["short"] > runner.graph_replays["plain"]
    assert run(llm, single) == want_single
    assert runner.graph_replays["plain"] > 0
    plain = runner.graph_replays["plain"]
    assert run(llm, short + long) == want_long
    assert runner.graph_replays["plain"] > plain
