"""`kv_cache_dtype="fp8"`: an e4m3 KV cache with per-layer scales measured on the first prompt.

The Triton kernels and their PyTorch twins read the same FP8 cache, so the engine must give the
same tokens on either backend; the trained demo model must stay above its accuracy gate; the
pool holds 4x the tokens of an fp32 cache in the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilellm import LLM, SamplingParams
from tilellm.demo import run_demo


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 380, 33).tolist()
    return [shared[:17], shared + rng.integers(0, 380, 4).tolist()]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def test_fp8_cache_same_tokens_from_kernels_and_twins(tiny_qwen3):
    outs = {}
    for backend in ("reference", "triton"):
        # the PyTorch RMSNorm and rotary on both: the same K and V reach the caches
        llm = LLM(
            tiny_qwen3, kv_cache_dtype="fp8", attention_backend=backend, fused_ops_backend="reference",
            num_kv_blocks=32,
        )  # fmt: skip
        first = _greedy(llm)
        assert _greedy(llm) == first  # the second pass reads the prefix cache
        runner = llm.llm_engine.runner
        assert runner.kv_cache.dtype == torch.float8_e4m3fn
        scales = runner.kv_scales
        assert scales.shape == (2, 2) and bool(torch.all(scales > 0)) and bool(torch.all(scales != 1.0))
        outs[backend] = (first, scales)
    assert outs["triton"][0] == outs["reference"][0]
    # measured on the same prompt: layer 0's K and V are the same bits, later layers' differ by
    # the attention kernels' fp32 rounding
    assert torch.equal(outs["triton"][1][0], outs["reference"][1][0])
    torch.testing.assert_close(outs["triton"][1], outs["reference"][1], rtol=1e-5, atol=0)


def test_fp8_pool_holds_four_times_an_fp32_pool(tiny_qwen3):
    fp32 = LLM(tiny_qwen3, num_kv_blocks=16).llm_engine.runner
    fp8 = LLM(tiny_qwen3, num_kv_blocks=16, kv_cache_dtype="fp8_e4m3").llm_engine.runner
    assert fp32.kv_bytes_per_token == 4 * fp8.kv_bytes_per_token
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn and fp32.kv_cache.dtype == torch.float32


def test_bad_kv_cache_dtype_is_named(tiny_qwen3):
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got 'int8'"):
        LLM(tiny_qwen3, kv_cache_dtype="int8")


def test_demo_stays_above_its_gate_with_an_fp8_cache():
    res = run_demo(
        num_requests=24, arrivals_per_step=8, device="cpu", engine_kwargs={"kv_cache_dtype": "fp8"}
    )
    assert res.passed, f"accuracy {res.accuracy:.3f} below the gate {res.threshold}"


@pytest.mark.parametrize("model", ["tiny_deepseek_v2", "tiny_deepseek_v32"])
def test_fp8_latent_cache_same_tokens_from_kernels_and_twins(model, request):
    """MLA's latent rows (and DeepSeek-V3.2's sparse attention over them) from an FP8 cache; the
    indexer keys stay in the model's dtype."""
    model_dir = request.getfixturevalue(model)
    outs = []
    for backend in ("reference", "triton"):
        llm = LLM(
            model_dir, kv_cache_dtype="fp8", attention_backend=backend, fused_ops_backend="reference",
            num_kv_blocks=32,
        )  # fmt: skip
        outs.append(_greedy(llm))
        runner = llm.llm_engine.runner
        assert runner.kv_cache.dtype == torch.float8_e4m3fn and runner.kv_scales.shape[1] == 1
    assert outs[0] == outs[1]


def _with_kv_scales(src: str, dst, names: tuple[str, str]) -> str:
    """A copy of checkpoint `src` whose layers ship K and V cache scales under `names`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.{names[0]}"] = torch.tensor(0.05 + i)
        weights[f"model.layers.{i}.self_attn.{names[1]}"] = torch.tensor([0.25 + i])
    save_file(weights, f"{dst}/model.safetensors")
    return str(dst)


@pytest.mark.parametrize(
    "names",
    [
        ("k_scale", "v_scale"),
        ("attn.k_scale", "attn.v_scale"),
        ("k_proj.output_scale", "v_proj.output_scale"),
    ],
)
def test_checkpoint_kv_scales_are_used(tiny_qwen3, tmp_path, names):
    model_dir = _with_kv_scales(tiny_qwen3, tmp_path / "m", names)
    llm = LLM(model_dir, kv_cache_dtype="fp8", num_kv_blocks=16)
    runner = llm.llm_engine.runner
    want = torch.tensor([[0.05, 0.25], [1.05, 1.25]])
    assert torch.equal(runner.kv_scales, want) and not runner.kv_scales_pending
    _greedy(llm)
    assert torch.equal(runner.kv_scales, want)  # not measured again on the first prompt
    assert LLM(model_dir, num_kv_blocks=16).llm_engine.runner.kv_scales is None  # 16/32-bit: unused


def test_fp8_cache_with_ngram_speculation_gives_the_same_tokens(tiny_qwen3):
    """Verification reads the FP8 cache through the paged kernel's multi-token rows: greedy
    speculation must give the tokens of plain decoding over the same cache."""
    rng = np.random.default_rng(5)
    motif = rng.integers(0, 380, 6).tolist()
    prompts = [motif * 4, rng.integers(0, 380, 11).tolist() + motif * 3]  # repeats: drafts get accepted
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}):
        llm = LLM(tiny_qwen3, kv_cache_dtype="fp8", num_kv_blocks=32, speculative_config=spec)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0  # drafts were verified and kept
    assert outs[1] == outs[0]
