"""The engine under programmatic dependent launch (`TILELLM_PDL=1`, Hopper only): greedy tokens
equal to transformers' with the decode path's kernels launched with PDL and the linear layers of
small steps on `skinny.py`'s kernel (the decoder's norms and the MLP's SiLU-and-mul in the layers'
launches), under decode CUDA graphs (the PDL edges are captured), chunked prefill, async
scheduling and preemption. On the CPU, the same layer choices forced (the kernels then run under
the interpreter, without PDL), on Qwen3 and on DeepSeek-V3 (MLA, MoE's shared experts)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_greedy_vs_hf import CONFIGS, _prompts, expected, run_twice
from tilellm import LLM, SamplingParams
from tilellm.kernels import pdl
from tilellm.models.layers import linear as linear_layers

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs sm_90 or newer")


@pytest.fixture
def pdl_on(monkeypatch):
    pdl._pdl_enabled.cache_clear()
    monkeypatch.setenv("TILELLM_PDL", "1")
    yield
    pdl._pdl_enabled.cache_clear()


def _count_skinny_calls(monkeypatch) -> dict[str, int]:
    """Calls of the two skinny entry points the linear layers use, counted as they run."""
    calls = {"skinny_linear": 0, "skinny_rms_norm_linear": 0}
    for name in calls:
        real = getattr(linear_layers, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(linear_layers, name, counted)
    return calls


@needs_hopper
@pytest.mark.parametrize("config", ["default", "chunked_prefill", "async_chunked", "tiny_pool_preempts"])
def test_qwen3_greedy_matches_hf_under_pdl(tiny_qwen3, config, pdl_on, monkeypatch):
    calls = _count_skinny_calls(monkeypatch)
    llm, first, second = run_twice(tiny_qwen3, **CONFIGS[config])
    assert pdl.pdl_enabled(torch.device("cuda"))
    assert calls["skinny_linear"], "no linear layer ran skinny_linear"
    assert calls["skinny_rms_norm_linear"], "no norm ran in its layer's launch"
    assert sum(llm.llm_engine.runner.graph_replays.values()) > 0, "no decode step replayed a CUDA graph"
    want = expected(tiny_qwen3)
    assert first == want and second == want


@pytest.fixture
def pdl_rows(monkeypatch):
    """TILELLM_PDL unset and TILELLM_PDL_ROWS=256: launches of up to 256 rows take part."""
    monkeypatch.delenv("TILELLM_PDL", raising=False)
    monkeypatch.setenv("TILELLM_PDL_ROWS", "256")
    pdl._pdl_enabled.cache_clear()
    pdl._rows_bound.cache_clear()
    yield
    pdl._pdl_enabled.cache_clear()
    pdl._rows_bound.cache_clear()


@needs_hopper
@pytest.mark.parametrize("config", ["default", "async_chunked", "tiny_pool_preempts"])
def test_qwen3_greedy_matches_hf_with_pdl_beside_cublas(tiny_qwen3, config, pdl_rows, monkeypatch):
    """`TILELLM_PDL_ROWS=256`: the Triton kernels of steps of several rows launch with PDL while
    those steps' linear layers stay on cuBLAS (whose kernels do not take part): the tokens stay
    transformers', in decode graphs too."""
    asked: list[tuple[int | None, bool]] = []
    real = pdl.pdl_enabled

    def spied(device, rows=None):
        on = real(device, rows)
        asked.append((rows, on))
        return on

    monkeypatch.setattr(pdl, "pdl_enabled", spied)
    llm, first, second = run_twice(tiny_qwen3, **CONFIGS[config])
    several = [on for rows, on in asked if rows is not None and rows > 1]
    assert any(several), "no launch of several rows took part"
    assert not real(torch.device("cuda")), "the linear layers must keep cuBLAS (TILELLM_PDL is unset)"
    assert sum(llm.llm_engine.runner.graph_replays.values()) > 0, "no decode step replayed a CUDA graph"
    want = expected(tiny_qwen3)
    assert first == want and second == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the test above")
def test_qwen3_greedy_matches_hf_with_the_pdl_layers_on_the_cpu(tiny_qwen3, monkeypatch):
    """The linear layers' PDL choices forced on the CPU: steps of up to 16 tokens run the norm,
    the layer and the MLP's activation in `skinny.py`'s launches (with the kernel ops, which hand
    their norm and activation to the layers; the reference ops keep theirs); the tokens stay
    transformers'."""
    monkeypatch.setattr(linear_layers, "pdl_enabled", lambda device: True)
    calls = _count_skinny_calls(monkeypatch)
    _, first, second = run_twice(tiny_qwen3, fused_ops_backend="triton", **CONFIGS["chunked_prefill"])
    assert calls["skinny_linear"] and calls["skinny_rms_norm_linear"]
    want = expected(tiny_qwen3)
    assert first == want and second == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the test above")
def test_deepseek_v3_greedy_matches_hf_with_the_pdl_layers_on_the_cpu(tiny_deepseek_v3, monkeypatch):
    """The same on DeepSeek-V3's shape: MLA's q latent norm runs in q_b_proj's launch, the block's
    input norm in fused_qkv_a_proj's, the shared experts' gate-up with its SiLU-and-mul."""
    monkeypatch.setattr(linear_layers, "pdl_enabled", lambda device: True)
    calls = _count_skinny_calls(monkeypatch)
    prompts = _prompts()[:4]
    want = [w[:4] for w in expected(tiny_deepseek_v3)[:4]]
    llm = LLM(tiny_deepseek_v3, num_kv_blocks=32, max_num_batched_tokens=13, fused_ops_backend="triton")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls["skinny_linear"] and calls["skinny_rms_norm_linear"]
    assert got == want
