"""Greedy tokens of the engine == `transformers` generate (fp32, CPU) on tiny random checkpoints.

One batch holds prompts with shared prefixes and lengths 1, around block boundaries and beyond;
it runs twice on the same engine, so that the second pass reads the prefix cache. The same
tokens must come out under every engine configuration that changes how the work is cut up.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.conftest import hf_greedy
from tilellm import LLM, SamplingParams

MAX_TOKENS = 10


def _prompts(vocab: int = 380) -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, 40).tolist()
    own = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    return [
        [int(rng.integers(0, vocab))],  # length 1
        shared[:16],  # exactly one block
        shared[:17],  # one block + 1
        shared[:32] + own(3),  # shared prefix, then its own tokens
        shared[:33] + own(20),  # beyond
        shared + own(9),
        own(31),
    ]


_EXPECTED: dict[str, list[list[int]]] = {}


def expected(model_dir: str) -> list[list[int]]:
    if model_dir not in _EXPECTED:
        _EXPECTED[model_dir] = hf_greedy(model_dir, _prompts(), MAX_TOKENS)
    return _EXPECTED[model_dir]


def run_twice(model_dir: str, prompts=None, **llm_kwargs) -> tuple[LLM, list, list]:
    prompts = prompts or _prompts()
    async_scheduling = llm_kwargs.pop("async_scheduling", False)
    llm = LLM(model_dir, **llm_kwargs)
    llm.llm_engine.async_scheduling = async_scheduling
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return llm, first, second


CONFIGS = {
    "default": dict(num_kv_blocks=64),
    "no_prefix_cache": dict(num_kv_blocks=64, enable_prefix_caching=False),
    "block_size_1": dict(num_kv_blocks=1024, block_size=1),
    "tiny_pool_preempts": dict(num_kv_blocks=8, max_num_seqs=8),  # 128 tokens for 7 prompts + outputs
    "chunked_prefill": dict(num_kv_blocks=64, max_num_batched_tokens=13),
    "few_seqs": dict(num_kv_blocks=64, max_num_seqs=2),
    # Step N+1 launched before step N's tokens are read (the CUDA default), with preemption.
    "async_tiny_pool": dict(num_kv_blocks=8, max_num_seqs=8, async_scheduling=True),
    "async_chunked": dict(num_kv_blocks=64, max_num_batched_tokens=13, async_scheduling=True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_qwen3_greedy_matches_hf(tiny_qwen3, config):
    llm, first, second = run_twice(tiny_qwen3, **CONFIGS[config])
    want = expected(tiny_qwen3)
    assert first == want
    assert second == want
    stats = llm.llm_engine.get_stats()
    if config == "tiny_pool_preempts":
        assert stats.num_preemptions > 0
    if config in ("default", "block_size_1"):
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("config", ["default", "chunked_prefill", "tiny_pool_preempts"])
def test_llama_greedy_matches_hf(tiny_llama, config):
    _, first, second = run_twice(tiny_llama, **CONFIGS[config])
    want = expected(tiny_llama)
    assert first == want and second == want


def _counted(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


def test_triton_backend_greedy_matches_hf(tiny_qwen3):
    """The Triton kernels under the interpreter (CPU): a small batch, cached + chunked steps included."""
    prompts = _prompts()[:4]
    want = expected(tiny_qwen3)[:4]
    llm = LLM(tiny_qwen3, num_kv_blocks=32, attention_backend="triton", max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == [w[:4] for w in want]
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


def test_unfused_ops_beside_triton_attention_match_hf(tiny_qwen3, monkeypatch):
    """`fused_ops_backend="reference"`: Triton attention with the unfused PyTorch RMSNorm, SiLU-and-mul
    and rotary (what `bench throughput --compare-fused` times) gives the same greedy tokens."""
    import tilellm.kernels.reference.fused as unfused

    prompts = _prompts()[:3]
    want = expected(tiny_qwen3)[:3]
    import tilellm.kernels as triton_ops

    llm = LLM(tiny_qwen3, num_kv_blocks=32, attention_backend="triton", fused_ops_backend="reference")
    model = llm.llm_engine.runner.model
    assert model.model.layers[0].mlp.act_fn.ops is unfused
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    stores: list = []
    monkeypatch.setattr(triton_ops, "store_kvcache", _counted(triton_ops.store_kvcache, stores))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [w[:4] for w in want]
    # the rotary is the twin's, the store stays the backend's kernel (capturable in graphs)
    assert stores and len(stores) % len(model.attention_layers()) == 0
    if llm.llm_engine.runner.device.type == "cuda":
        assert llm.llm_engine.runner.decode_graphs, "decode graphs were not captured"
    with pytest.raises(ValueError, match="fused_ops_backend"):
        LLM(tiny_qwen3, fused_ops_backend="cuda-graphs")


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_gemv_keeps_the_greedy_tokens(tiny_qwen3, monkeypatch, max_num_seqs):
    """`TILELLM_GEMV=1` (forced here on the CPU too, the kernels under the interpreter): an fp16
    engine decoding one sequence at a time, or two, runs its norms, linear layers, gate-up with
    SiLU-and-mul and LM head through `gemv.py` on its decode steps, and gives the tokens of the
    same engine without it, each step's top log-probabilities within a few roundings. (fp16: in
    bf16 this random model's near-ties, top two within 0.03, flip with the sums' order.)"""
    from tilellm.kernels import skinny
    from tilellm.models.layers import linear as linear_layers

    prompts = [_prompts()[2], _prompts()[4]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    kwargs = dict(num_kv_blocks=32, max_num_seqs=max_num_seqs, dtype="float16", attention_backend="triton")

    def run():
        outputs = LLM(tiny_qwen3, fused_ops_backend="triton", **kwargs).generate(
            prompts, params, use_tqdm=False
        )
        return [o.outputs[0] for o in outputs]

    want = run()
    monkeypatch.setenv("TILELLM_GEMV", "1")
    monkeypatch.setattr(
        linear_layers, "gemv_enabled", lambda device, rows, dtype: 0 < rows <= 8 and dtype == torch.float16
    )
    launches: list = []  # the rows of each launch
    real = skinny.launch_gemv
    monkeypatch.setattr(skinny, "launch_gemv", lambda x, *a: launches.append(x.shape[0]) or real(x, *a))
    got = run()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for step_got, step_want in zip(g.logprobs, w.logprobs):
            for token, logprob in step_want.items():
                assert abs(step_got[token].logprob - logprob.logprob) < 0.02, (token, step_got, step_want)
    # at least, per decode step: each of the 2 layers' norm+qkv, o_proj, norm+gate-up+SiLU and
    # down_proj, and the LM head (4 decode steps a prompt, both prompts' together with two
    # sequences, the rows kernel: the first token comes from the prefill), at the step's rows (a
    # prefill's LM head and, on a GPU, the engine's warm-up add launches of other sizes)
    assert launches.count(max_num_seqs) >= 2 * 4 * (2 * 4 + 1) // max_num_seqs, launches


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_rotary_and_store_in_one_launch_or_two_agree(tiny_qwen3, monkeypatch, kv_cache_dtype):
    """`TILELLM_ROPE_STORE`: the default rotates q and k in the launch that stores K/V (no
    `store_kvcache` launch once the pool exists, the FP8 cache's calibration step aside); two
    launches give the same tokens, logprobs and cache bits. Triton kernels, chunked and cached steps."""
    import tilellm.kernels as triton_ops
    from tilellm.kernels.config import rope_store_fused

    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    runs = {}
    for mode in ("separate", "fused"):
        monkeypatch.setenv("TILELLM_ROPE_STORE", mode)
        rope_store_fused.cache_clear()
        llm = LLM(
            tiny_qwen3, num_kv_blocks=32, attention_backend="triton", max_num_batched_tokens=24,
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        store, calls = triton_ops.store_kvcache, []
        monkeypatch.setattr(triton_ops, "store_kvcache", _counted(store, calls))
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]  # the second: cached
        monkeypatch.setattr(triton_ops, "store_kvcache", store)
        tokens = [[o.outputs[0].token_ids for o in out] for out in outs]
        logprobs = [[o.outputs[0].cumulative_logprob for o in out] for out in outs]
        runs[mode] = (tokens, logprobs, llm.llm_engine.runner.kv_cache.clone(), len(calls))
    rope_store_fused.cache_clear()
    (sep_tokens, sep_lp, sep_cache, sep_calls), (tokens, lp, cache, calls) = runs["separate"], runs["fused"]
    assert tokens == sep_tokens and lp == sep_lp
    assert tokens[0] == [w[:4] for w in expected(tiny_qwen3)[:4]]
    assert torch.equal(cache.view(torch.uint8), sep_cache.view(torch.uint8))
    if llm.llm_engine.runner.device.type == "cuda":
        assert llm.llm_engine.runner.decode_graphs, "decode graphs were not captured"
    layers = len(llm.llm_engine.runner.model.attention_layers())
    assert sep_calls > 0 and sep_calls % layers == 0
    # the FP8 cache measures its scales on the rotated keys of its first step, then stores them
    assert calls == (layers if kv_cache_dtype == "fp8" else 0)
