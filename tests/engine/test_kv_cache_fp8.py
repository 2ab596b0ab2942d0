"""`kv_cache_dtype="fp8"`: an e4m3 KV cache with per-layer scales measured on the first prompt.

The oracle: the 16/32-bit engine whose cache holds what the FP8 cache stands for (each stored
row quantized and dequantized with the FP8 run's scales, `_emulated`) must give the FP8 engine's
tokens and log-probabilities; a scale dropped or applied twice anywhere breaks that. The Triton
kernels and their twins read the same FP8 cache, so the engine gives the same tokens on either
backend; the trained demo model stays above its accuracy gate; the pool holds 4x the tokens of
an fp32 cache in the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilellm import LLM, SamplingParams
from tilellm.demo import run_demo
from tilellm.kernels.fp8 import dequantize_fp8, quantize_fp8


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 380, 33).tolist()
    return [shared[:17], shared + rng.integers(0, 380, 4).tolist()]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def _greedy_logprobs(llm: LLM) -> list[tuple[list[int], float]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


def _emulated(model_dir: str, scales: torch.Tensor, monkeypatch) -> list[tuple[list[int], float]]:
    """The 16/32-bit engine (the PyTorch twins, on any device) with every row stored in a layer's
    cache replaced by its FP8 value times `scales[layer]` (the FP8 run's): what an FP8 cache
    stands for. DeepSeek-V3.2's indexer keys likewise: each row replaced by its FP8 value times
    its own scale (`store_index_keys`' rule in the FP8 engine), and the indexer's queries too
    (`index_topk` over an FP8 index cache quantizes them)."""
    import tilellm.kernels.reference as reference_ops

    llm = LLM(model_dir, attention_backend="reference", fused_ops_backend="reference", num_kv_blocks=32)
    pool = llm.llm_engine.runner.kv_cache  # [num_caches, num_layers, ...]
    layer_of = {pool[0, i].data_ptr(): i for i in range(pool.shape[1])}
    store = reference_ops.store_kvcache

    def emulating_store(k, v, k_cache, v_cache, slot_mapping, **_):
        layer = layer_of.get(k_cache.data_ptr())
        if layer is not None:
            k_scale = scales[layer, 0].to(k.device)
            k = dequantize_fp8(quantize_fp8(k, k_scale), k_scale, k.dtype)
            if v is not None:
                v_scale = scales[layer, 1].to(k.device)
                v = dequantize_fp8(quantize_fp8(v, v_scale), v_scale, v.dtype)
        store(k, v, k_cache, v_cache, slot_mapping)

    monkeypatch.setattr(reference_ops, "store_kvcache", emulating_store)
    store_index = reference_ops.store_index_keys

    def emulating_index_store(index_k, index_cache, slot_mapping, *, index_scales=None):
        rows = torch.empty(index_k.shape[0], 1, 1, index_k.shape[1], dtype=torch.float8_e4m3fn)
        scales = torch.empty(index_k.shape[0], 1)
        every = torch.arange(index_k.shape[0], dtype=torch.int32)
        store_index(index_k.cpu(), rows, every, index_scales=scales)  # the FP8 engine's bytes
        k = (rows.float().reshape(index_k.shape) * scales).to(index_k.dtype).to(index_k.device)
        store_index(k, index_cache, slot_mapping, index_scales=index_scales)

    monkeypatch.setattr(reference_ops, "store_index_keys", emulating_index_store)
    index_topk = reference_ops.index_topk

    def emulating_index_topk(q, *args, **kw):  # the FP8 scores' queries: e4m3 rows and their scales
        from tilellm.kernels.reference.indexer import fp8_index_queries

        return index_topk(fp8_index_queries(q).to(q.dtype), *args, **kw)

    monkeypatch.setattr(reference_ops, "index_topk", emulating_index_topk)
    return _greedy_logprobs(llm)


def _assert_same(got: list[tuple[list[int], float]], want: list[tuple[list[int], float]]) -> None:
    for i, ((g_ids, g_lp), (w_ids, w_lp)) in enumerate(zip(got, want)):
        assert g_ids == w_ids, f"prompt {i}"
        assert abs(g_lp - w_lp) < 1e-4, f"prompt {i}: cumulative logprob {g_lp} vs {w_lp}"


def test_fp8_cache_same_tokens_from_kernels_and_twins(tiny_qwen3, monkeypatch):
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
    fp8 = LLM(
        tiny_qwen3, kv_cache_dtype="fp8", attention_backend="reference", fused_ops_backend="reference",
        num_kv_blocks=32,
    )  # fmt: skip
    got = _greedy_logprobs(fp8)
    _assert_same(got, _emulated(tiny_qwen3, fp8.llm_engine.runner.kv_scales, monkeypatch))
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
def test_fp8_latent_cache_same_tokens_from_kernels_and_twins(model, request, monkeypatch):
    """MLA's latent rows (and DeepSeek-V3.2's sparse attention over them, its indexer keys in
    e4m3 with a scale per key) from an FP8 cache."""
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
        if model == "tiny_deepseek_v32":
            assert runner.index_cache.dtype == torch.float8_e4m3fn
            used = runner.index_scales[runner.index_scales != 0]
            assert used.numel() > 0 and bool(torch.all(used > 0)), "no indexer key scale was written"
    assert outs[0] == outs[1]
    fp8 = LLM(
        model_dir, kv_cache_dtype="fp8", attention_backend="reference", fused_ops_backend="reference",
        num_kv_blocks=32,
    )  # fmt: skip
    got = _greedy_logprobs(fp8)
    _assert_same(got, _emulated(model_dir, fp8.llm_engine.runner.kv_scales, monkeypatch))


def _with_kv_scales(src: str, dst, names: tuple[str, str], num_layers: int = 2) -> str:
    """A copy of checkpoint `src` whose layers ship K and V cache scales under `names`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    for i in range(num_layers):
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
    assert torch.equal(runner.kv_scales.cpu(), want) and not runner.kv_scales_pending
    _greedy(llm)
    assert torch.equal(runner.kv_scales.cpu(), want)  # not measured again on the first prompt
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


def test_fp8_needs_an_ada_or_hopper_gpu(monkeypatch, tiny_qwen3):
    from tilellm.config import EngineConfig
    from tilellm.worker.model_runner import _check_fp8_support

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 .*sm_80"
    ):
        _check_fp8_support(torch.device("cuda"), EngineConfig(kv_cache_dtype="fp8"), model)
    model.weight.data = model.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(
        ValueError,
        match=r"FP8 weights \(an FP8 checkpoint or quantization=.fp8.\) need a GPU of compute capability 8.9",
    ):
        _check_fp8_support(torch.device("cuda"), EngineConfig(), model)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    _check_fp8_support(torch.device("cuda"), EngineConfig(kv_cache_dtype="fp8"), model)


def test_mla_checkpoint_k_scale_is_the_latent_cache_scale(tiny_deepseek_v2, tmp_path):
    import json

    layers = json.loads(open(f"{tiny_deepseek_v2}/config.json").read())["num_hidden_layers"]
    model_dir = _with_kv_scales(tiny_deepseek_v2, tmp_path / "m", ("k_scale", "v_scale"), layers)
    runner = LLM(model_dir, kv_cache_dtype="fp8", num_kv_blocks=16).llm_engine.runner
    want = torch.tensor([[0.05 + i] for i in range(layers)])
    assert torch.equal(runner.kv_scales.cpu(), want) and not runner.kv_scales_pending
    assert LLM(model_dir, num_kv_blocks=16).llm_engine.runner.kv_scales is None  # loads, unused


def _near_greedy(llm: LLM, prompts, outputs, top: int = 20, share: float = 0.05) -> list[float]:
    """Teacher-forced check of `outputs`: at each position, how far the token's log-probability
    (under `llm`, plain decoding, given the prompt and the tokens before it) lies below the best
    one, as a share of the gap from the best to the `top`-th; every share must be <= `share`
    (the argmax, or a near-tie that bf16 rounding may flip)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top)
    shares = []
    for prompt, out in zip(prompts, outputs):
        scored = llm.generate([prompt + out], params, use_tqdm=False)[0].prompt_logprobs[len(prompt) :]
        for token, ranked in zip(out, scored):
            values = sorted((lp.logprob for lp in ranked.values()), reverse=True)
            shares.append((values[0] - ranked[token].logprob) / (values[0] - values[top - 1]))
    assert max(shares) <= share, f"tokens far from plain decoding's choices: {sorted(shares)[-5:]}"
    return shares


@pytest.mark.gpu
def test_fp8_verification_in_the_gluon_kernel_is_near_greedy(tmp_path, monkeypatch, request):
    """On an H100/H200 with TILELLM_FP8_VERIFY=gluon, verification of 4 tokens x a group of 2
    heads (8 rows a request) over an FP8 cache runs decode_fp8.py; each token greedy speculation
    keeps is plain decoding's choice over the same cache, given the tokens before it, or a
    near-tie (bf16 rounding differs between one token's decode and a verification of four)."""
    from tilellm.kernels import config, decode_fp8, paged
    from tilellm.testing import make_tiny_model

    if not config.gluon_ok():
        pytest.skip("needs an H100/H200 and Gluon")
    monkeypatch.setenv("TILELLM_FP8_VERIFY", "gluon")
    paged.clear_plans()
    request.addfinalizer(paged.clear_plans)  # (plans kept per shape hold the setting)
    verify_launches = [0]
    launch = decode_fp8.launch_decode_fp8

    def counted(*args, cu_seqlens_q=None, **kwargs):
        verify_launches[0] += cu_seqlens_q is not None
        return launch(*args, cu_seqlens_q=cu_seqlens_q, **kwargs)

    monkeypatch.setattr(decode_fp8, "launch_decode_fp8", counted)
    # K/V scales from the checkpoint: both engines quantize the cache alike (measured scales would
    # follow each engine's first step)
    model = _with_kv_scales(
        str(make_tiny_model(tmp_path / "m", "Qwen3ForCausalLM", seed=7, head_dim=64, dtype="bfloat16")),
        tmp_path / "scaled",
        ("k_scale", "v_scale"),
    )
    rng = np.random.default_rng(7)
    motif = rng.integers(0, 380, 7).tolist()
    prompts = [motif * 5, rng.integers(0, 380, 13).tolist() + motif * 4, motif * 3 + [5, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    plain = LLM(model, device="cuda", kv_cache_dtype="fp8", num_kv_blocks=128, enforce_eager=True)
    for eager in (True, False):
        llm = LLM(
            model, device="cuda", kv_cache_dtype="fp8", num_kv_blocks=64, enforce_eager=eager,
            speculative_config=spec,
        )  # fmt: skip
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
        _near_greedy(plain, prompts, outputs)
    assert verify_launches[0] > 0  # the verifications ran in decode_fp8.py


def test_fp8_cache_with_a_draft_model(tiny_qwen3, tiny_llama):
    """The draft model's cache follows kv_cache_dtype, with scales of its own measured on its
    first step; greedy speculation gives the tokens of plain decoding over the same FP8 cache,
    and the pool counts the draft's FP8 bytes."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 380, n).tolist() for n in (9, 23, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs, runners = [], []
    for spec in (None, {"method": "draft_model", "model": tiny_qwen3, "num_speculative_tokens": 3}):
        llm = LLM(tiny_qwen3, kv_cache_dtype="fp8", num_kv_blocks=32, speculative_config=spec)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        runners.append(llm.llm_engine.runner)
    assert outs[1] == outs[0]
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0  # the draft (the target itself) was heard
    draft = runners[1].draft
    assert draft.kv_cache.dtype == torch.float8_e4m3fn and draft.attn_spec.fp8_cache
    scales = draft.fp8_scales.values
    assert not draft.fp8_scales.pending and bool(torch.all(scales > 0)) and bool(torch.all(scales != 1.0))
    # a block id costs the target's FP8 block and the draft's (the same model: the same FP8 bytes)
    assert runners[1].pool_spec.block_bytes == 2 * runners[0].pool_spec.block_bytes
    # a draft of another architecture (Llama) over the FP8 target cache
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    llm = LLM(tiny_qwen3, kv_cache_dtype="fp8", num_kv_blocks=32, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == outs[0]
    assert llm.llm_engine.runner.draft.kv_cache.dtype == torch.float8_e4m3fn
