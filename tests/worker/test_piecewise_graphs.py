"""Piecewise CUDA graphs (`tilellm.worker.piecewise_graphs`) and the break they rely on
(`tilellm.attention.graph_break`).

On CPU: the buckets, and that every model breaks exactly at its attention calls, on [T, ...]
tensors only, with the same result as an unbroken forward. On a GPU: engines with piecewise
graphs give the greedy tokens of engines without them (prefill, chunked and mixed steps, padded
token counts, MLA, MoE, sparse attention, an FP8 cache, speculative verification, prompt logprobs).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import (  # noqa: F401  (the tiny checkpoints, used by name)
    tiny_deepseek_v2,
    tiny_deepseek_v32,
    tiny_llama,
    tiny_qwen3,
    tiny_qwen3_moe,
)
from tests.engine.test_greedy_vs_hf import _prompts, expected
from tilellm import LLM, SamplingParams
from tilellm.attention import attention_context
from tilellm.attention.graph_break import attention_call, breaking_graphs_at_attention
from tilellm.worker.piecewise_graphs import LINEAR_STEP, piecewise_sizes


@pytest.mark.parametrize("budget", [1, 13, 16, 100, 2048, 8192, 16384, 20000])
def test_sizes_cover_every_token_count(budget):
    sizes = piecewise_sizes(budget)
    assert sizes == sorted(set(sizes)) and sizes[-1] == budget
    for n in range(1, budget + 1, max(1, budget // 997)):
        bucket = next(s for s in sizes if s >= n)
        # padding at most doubles the small steps and adds less than LINEAR_STEP to the large
        assert bucket <= max(2 * n, 16) or bucket < n + LINEAR_STEP


def test_attention_call_outside_a_capture_is_the_call():
    assert attention_call(lambda a, b: a * b, torch.tensor(3.0), torch.tensor(4.0)).item() == 12.0


def test_one_capture_at_a_time():
    with breaking_graphs_at_attention(lambda fn, args: fn(*args)):
        with pytest.raises(RuntimeError, match="already in progress"):
            with breaking_graphs_at_attention(lambda fn, args: fn(*args)):
                pass
    assert attention_call(lambda: torch.tensor(1.0)).item() == 1.0  # the splitter is gone


@pytest.mark.parametrize(
    "model", ["tiny_qwen3", "tiny_llama", "tiny_deepseek_v2", "tiny_qwen3_moe", "tiny_deepseek_v32"]
)
def test_every_model_breaks_at_its_attention_calls(request, model):
    """A forward under a splitter calls it once per layer with [T, ...] inputs, and a splitter that
    runs the call eagerly (what a capture does between two pieces) leaves the output unchanged."""
    llm = LLM(request.getfixturevalue(model), device="cpu", num_kv_blocks=16)
    runner = llm.llm_engine.runner
    lens = [5, 9]
    x = runner._synthetic_inputs(lens, lens)
    calls = []

    def split(fn, inputs):
        calls.append([t.shape for t in inputs])
        return fn(*inputs)

    with torch.inference_mode():
        plain = runner._forward_hidden(x, x.input_ids, x.positions)
        with breaking_graphs_at_attention(split):
            broken = runner._forward_hidden(x, x.input_ids, x.positions)
    assert len(calls) == len(runner.model.attention_layers())
    assert all(shape[0] == sum(lens) for shapes in calls for shape in shapes)
    torch.testing.assert_close(broken, plain, rtol=0, atol=0)


def test_a_step_runs_the_plan_installed_at_call_time(request):
    """The recorded call reads the metadata installed when it runs, not the capture's."""
    llm = LLM(request.getfixturevalue("tiny_qwen3"), device="cpu", num_kv_blocks=16)
    runner = llm.llm_engine.runner
    a, b = runner._synthetic_inputs([4], [4]), runner._synthetic_inputs([2, 2], [2, 2])
    ids = torch.tensor([11, 5, 42, 7])  # distinct tokens: distinct values to attend over
    recorded = []
    with torch.inference_mode():
        with breaking_graphs_at_attention(lambda fn, args: recorded.append((fn, args)) or fn(*args)):
            runner._forward_hidden(a, ids, a.positions)
        fn, args = recorded[0]
        with attention_context(runner._plan(a)):
            one = fn(*args)
        with attention_context(runner._plan(b)):
            two = fn(*args)  # two requests of 2: the last two tokens no longer see the first two
    torch.testing.assert_close(one[:2], two[:2])
    assert not torch.allclose(one[2:], two[2:])


# -- GPU --------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _pair(model_dir: str, **kwargs) -> tuple[LLM, LLM]:
    args = dict(device="cuda", num_kv_blocks=64, max_num_batched_tokens=48, **kwargs)
    return LLM(model_dir, **args), LLM(model_dir, cudagraph_mode="full_decode_only", **args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model", ["tiny_qwen3", "tiny_llama", "tiny_deepseek_v2", "tiny_qwen3_moe", "tiny_deepseek_v32"]
)
def test_gpu_piecewise_steps_match_hf(request, model):
    """A 48-token budget: buckets 16, 32, 48; the prompts' prefill and chunked steps are padded
    to them, and their mixed steps run the decode and paged kernels between the pieces."""
    model_dir = request.getfixturevalue(model)
    llm, eager = _pair(model_dir, dtype="float32")
    runner = llm.llm_engine.runner
    assert sorted(runner.piecewise_graphs.buckets) == [16, 32, 48], "capture failed (see the log)"
    assert not eager.llm_engine.runner.piecewise_graphs
    want = expected(model_dir)
    for _ in range(2):  # the second time through the prefix cache
        assert _tokens(llm, _prompts()) == want
    assert _tokens(eager, _prompts()) == want
    assert runner.graph_replays["piecewise"] > 0
    assert eager.llm_engine.runner.graph_replays["piecewise"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype="bfloat16"),
        dict(dtype="bfloat16", kv_cache_dtype="fp8"),  # the scales measured in a piecewise step
        dict(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
        dict(dtype="float32", enable_prefix_caching=False, max_num_seqs=3),
    ],
)
def test_gpu_piecewise_matches_decode_only_graphs(request, kwargs):
    llm, eager = _pair(request.getfixturevalue("tiny_qwen3"), **kwargs)
    assert llm.llm_engine.runner.piecewise_graphs
    prompts = _prompts() + [[7, 8, 9] * 10]  # repetitive: n-gram drafts are found
    got, ref = _tokens(llm, prompts), _tokens(eager, prompts)
    if kwargs["dtype"] == "float32":
        assert got == ref
    else:  # bf16: the padded token count may pick other GEMM tiles; tokens agree nearly always
        agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
        assert agree >= 0.9 * sum(len(r) for r in ref)
    assert llm.llm_engine.runner.graph_replays["piecewise"] > 0


@pytest.mark.gpu
def test_gpu_piecewise_prompt_logprobs(request):
    """Prompt logprobs read every row of a piecewise step's hidden states."""
    llm, eager = _pair(request.getfixturevalue("tiny_qwen3"), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    prompts = _prompts()[3:6]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert px.keys() == py.keys()
            for t in px:
                assert abs(px[t].logprob - py[t].logprob) < 1e-4
