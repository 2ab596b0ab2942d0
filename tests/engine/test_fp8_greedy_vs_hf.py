"""FP8 checkpoints through the engine against `transformers` on the dequantized checkpoint (fp32, CPU).

The engine runs W8A8: weights exactly the checkpoint's (their dequantized values are what
`dequantize_model_dir` writes), activations quantized per token and 32-wide group of channels
before every FP8 GEMM. Two oracles, both transformers on the dequantized checkpoint:

- W8A8-replayed: every FP8 layer's input quantized as the engine's is (forward pre-hooks on the
  projections, and on the experts' matmuls). Only fp32 summation order differs, so the engine's
  greedy tokens must be transformers' own choices (see `test_greedy_tokens_are_hf_w8a8_choices`
  for the rare legitimate exception).
- plain (activations unquantized): the engine differs by the activation quantization alone. Each
  FP8 GEMM rounds every input to 3 mantissa bits, a relative error uniform in +-2^-4, RMS
  2^-4 / sqrt(3) = 3.6%, which reaches the GEMM's output as about that much relative noise; the
  GEMMs in series along the logits' path add it in quadrature, so the logits' relative L2 error
  is about sqrt(n_gemms) * 3.6% (an upper estimate: the residual stream carries unquantized
  parts; measured 7-8% where it gives 10% for the tiny Qwen3, 12% for 14% on the tiny
  DeepSeek-V2). On random tiny models whose top-2 logits are close (median gap 0.25 of the
  logits' std) that noise flips about one greedy choice in seven, after which the continuations
  part, so against this oracle the test bounds the logits' error and counts how often the
  engine's token is transformers' own choice given the same prefix (85% measured).

On a GPU the exact-replay checks run the engine with the PyTorch twins of the FP8 GEMM
(`W8A8_REPLAY_KWARGS`): Hopper's FP8 tensor-core dot keeps fewer bits than fp32 within a k-block
(the kernel tests allow 2e-3 of the output scale), far more than the summation order the replay
argument rests on. The Triton GEMM in the engine is checked on the GPU by its own test here.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.engine.test_greedy_vs_hf import MAX_TOKENS, _prompts
from tests.models.paged import PagedKV
from tilellm import LLM, SamplingParams
from tilellm.attention import BatchKind, attention_context
from tilellm.kernels.reference.fp8_gemm import dequantize_fp8_block
from tilellm.models import load_model
from tilellm.testing import (
    dequantize_model_dir,
    make_tiny_model,
    make_tiny_moe_model,
    quantize_model_dir_fp8,
)

GROUP = 32  # the tiny checkpoints' blocks are [32, 32]: activations quantized in 32-wide groups
# the layers transformers applies as nn.Linear that the engine runs in FP8 (MLA's kv_b_proj is
# dequantized, the routers and the LM head stay in the model dtype)
FP8_LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "kv_a_proj_with_mqa",
)
PER_GEMM_RMS = 2**-4 / math.sqrt(3)  # relative RMS error of one e4m3 rounding of the inputs
# fp32 twins of the FP8 GEMM (and of RMSNorm / SiLU / rotary) where the GEMM kernel's dot is not fp32
W8A8_REPLAY_KWARGS = {"fused_ops_backend": "reference"} if torch.cuda.is_available() else {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str, int]]:
    """name -> (FP8 checkpoint, its dequantized copy, FP8 GEMMs in series on the logits' path)."""
    root = tmp_path_factory.mktemp("fp8_engine")
    qwen3 = make_tiny_model(root / "qwen3", "Qwen3ForCausalLM", seed=1, head_dim=32)
    deepseek = make_tiny_moe_model(root / "deepseek_v2", "DeepseekV2ForCausalLM", seed=3)
    out = {}
    # Qwen3: 2 layers of qkv, o, gate_up, down. DeepSeek-V2: 3 layers of q, kv_a, o and the MLP's
    # two (the shared experts run beside the routed ones, not after them).
    for name, src, gemms in [("qwen3", qwen3, 8), ("deepseek_v2", deepseek, 15)]:
        q = quantize_model_dir_fp8(src, root / f"{name}_fp8", (GROUP, GROUP))
        out[name] = (str(q), str(dequantize_model_dir(q, root / f"{name}_dequant")), gemms)
        # per-tensor weights, static activation scales calibrated by transformers (AutoFP8's form)
        q = quantize_model_dir_fp8(src, root / f"{name}_static", per_tensor=True)
        out[f"{name}_static"] = (str(q), str(dequantize_model_dir(q, root / f"{name}_static_dequant")), gemms)
    return out


def _quantize_dequantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] -> e4m3 per token and `group` channels (scale = amax / 448), back in x's dtype."""
    g = x.float().reshape(-1, x.shape[-1] // group, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


def _hf_model(model_dir: str, w8a8: bool, group: int = GROUP) -> torch.nn.Module:
    """transformers' model; `w8a8`: every FP8 layer's input quantized in `group`-wide groups."""
    # eager experts: a loop of F.linear per expert, whose inputs the W8A8 replay quantizes
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    )
    if not w8a8:
        return model.eval()
    quantize_input = lambda module, args: (_quantize_dequantize(args[0], group), *args[1:])  # noqa: E731
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in FP8_LINEARS:
            module.register_forward_pre_hook(quantize_input)
        elif type(module).__name__.endswith("Experts"):  # w13's input, and w2's (silu(gate) * up)
            module.forward = _with_quantized_linear_inputs(module.forward, group)
    return model.eval()


def _with_quantized_linear_inputs(forward, group: int):
    def wrapped(*args, **kwargs):
        linear = torch.nn.functional.linear
        torch.nn.functional.linear = lambda x, w, b=None: linear(_quantize_dequantize(x, group), w, b)
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = linear

    return wrapped


def _static_quantize_dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x -> e4m3(x / scale) saturated at +-448, times scale, in x's dtype."""
    q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def _static_oracle_inputs(fp8_dir: str, dequant_dir: str, dst: pathlib.Path) -> tuple[str, dict]:
    """(checkpoint dir, scales) for `_hf_static_model`, from the engine's loaded model.

    scales: transformers' module name -> the static input scale the engine quantizes its input by
    (a merged layer's, the largest of its parts' as tests/models/test_fp8_checkpoint.py checks
    against the file, for each part; (a1, a2) for a fused experts module). The checkpoint: the
    dequantized one with each merged layer's parts replaced by the engine's own weights, which a
    per-tensor checkpoint's loading may requantize (shards of different scales that fall on no
    block of 16 to 128 rows all move to the largest scale, as vLLM does)."""
    model, _ = load_model(fp8_dir, device="cpu", attention_backend="reference")
    mapping = getattr(model, "packed_modules_mapping", {})
    weights = load_file(pathlib.Path(dequant_dir) / "model.safetensors")
    scales: dict[str, float | tuple[float, float]] = {}
    for name, module in model.named_modules():
        if getattr(module, "static_activations", False):  # FusedMoE
            scales[name] = (float(module.w13_input_scale), float(module.w2_input_scale))
        method = getattr(module, "quant_method", None)
        if not getattr(method, "static_activations", False):
            continue
        w = dequantize_fp8_block(
            module.weight, module.weight_scale_inv, list(method.block_size), torch.float32
        )
        prefix, _, leaf = name.rpartition(".")
        parts = [(ckpt, sid) for ckpt, (packed, sid) in mapping.items() if packed == leaf] or [(leaf, None)]
        for part, sid in parts:
            layout = module.shard_layout(sid)
            scales[f"{prefix}.{part}"] = float(module.input_scale)
            weights[f"{prefix}.{part}.weight"] = w.narrow(layout.dim, layout.dst_start, layout.size).clone()
    shutil.copytree(dequant_dir, dst)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst), scales


def _hf_static_model(model_dir: str, scales: dict[str, float | tuple[float, float]]) -> torch.nn.Module:
    """transformers' model with every FP8 layer's input quantized by its static scale (`scales`:
    `_static_oracle_inputs`), the experts' gate/up input by a1 and their down input by a2."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    )
    for name, module in model.named_modules():
        if name not in scales:
            continue
        if isinstance(module, torch.nn.Linear):
            s = scales[name]
            module.register_forward_pre_hook(
                lambda m, args, s=s: (_static_quantize_dequantize(args[0], s), *args[1:])
            )
        elif type(module).__name__.endswith("Experts"):
            module.forward = _with_static_expert_inputs(module, *scales[name])
    return model.eval()


def _with_static_expert_inputs(module: torch.nn.Module, a1: float, a2: float):
    gate_up = {module.gate_up_proj[e].data_ptr() for e in range(module.gate_up_proj.shape[0])}
    forward = module.forward

    def wrapped(*args, **kwargs):
        linear = torch.nn.functional.linear

        def quantized(x, w, b=None):
            return linear(_static_quantize_dequantize(x, a1 if w.data_ptr() in gate_up else a2), w, b)

        torch.nn.functional.linear = quantized
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = linear

    return wrapped


def _engine_greedy(model_dir: str, prompts: list[list[int]], **llm_kwargs) -> list[list[int]]:
    llm = LLM(model_dir, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prefill_logits(model_dir: str, prompts: list[list[int]], **load_kwargs) -> torch.Tensor:
    """The engine's model's logits at every position of the prompts, packed [sum(len), vocab]:
    one prefill."""
    model, _ = load_model(model_dir, device="cpu", attention_backend="reference", **load_kwargs)
    kv = PagedKV(model, num_requests=len(prompts), max_len=max(map(len, prompts)))
    ids, positions, meta = kv.step(BatchKind.PREFILL, list(enumerate(prompts)))
    with torch.no_grad(), attention_context(meta):
        return model.compute_logits(model(ids, positions))


def _last_logits(model_dir: str, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), vocab]: each prompt's last position."""
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    return _prefill_logits(model_dir, prompts)[last]


def _hf_choices(hf: torch.nn.Module, prompts: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """[len(prompts), MAX_TOKENS] bool: whether each engine token is `hf`'s own greedy choice given
    the same prefix (the prompt and the engine's tokens before it: one forward per prompt)."""
    with torch.no_grad():
        return torch.stack([
            hf(torch.tensor([p + g[:-1]])).logits[0, len(p) - 1 :].argmax(dim=-1) == torch.tensor(g)
            for p, g in zip(prompts, tokens)
        ])  # fmt: skip


_ENGINE: dict[tuple, list[list[int]]] = {}


def _engine_tokens(model_dir: str, **llm_kwargs) -> list[list[int]]:
    """The engine's greedy tokens for `_prompts()` (one engine per setting and model)."""
    key = (model_dir, *sorted(llm_kwargs.items()))
    if key not in _ENGINE:
        _ENGINE[key] = _engine_greedy(model_dir, _prompts(), **llm_kwargs)
    return _ENGINE[key]


@pytest.mark.parametrize(
    "name, llm_kwargs",
    [
        ("qwen3", dict(num_kv_blocks=64)),
        ("qwen3", dict(num_kv_blocks=64, max_num_batched_tokens=13)),  # chunked prefill
        ("deepseek_v2", dict(num_kv_blocks=64)),
    ],
    ids=["qwen3", "qwen3_chunked", "deepseek_v2"],
)
def test_greedy_tokens_are_hf_w8a8_choices(checkpoints, name, llm_kwargs):
    """Against the W8A8 replay, the engine's tokens are transformers' own choices, the first of
    every prompt included (measured: all 70, and free-running generation gives the same 70).
    Not asserted equal all the way: an fp32 ordering difference of ~1e-7 moves an input across an
    e4m3 rounding boundary (one step: 6-12% of that value) with probability ~1e-7 / 2^-4 per
    value, ~1e-3 per row over the thousands a row quantizes; from there the row carries the full
    quantization noise (7-12% of the logits), which flips one close greedy choice in seven. A
    few positions in the suite's hundreds may thus differ legitimately: at most 5% of the
    tokens."""
    fp8_dir, dequant_dir, _ = checkpoints[name]
    prompts, got = _prompts(), _engine_tokens(fp8_dir, **llm_kwargs, **W8A8_REPLAY_KWARGS)
    agree = _hf_choices(_hf_model(dequant_dir, w8a8=True), prompts, got)
    assert bool(agree[:, 0].all()), f"first tokens: {agree[:, 0].tolist()}"
    assert agree.float().mean() >= 0.95, (
        f"{int(agree.sum())}/{agree.numel()} tokens are transformers' choices"
    )


@pytest.mark.parametrize(
    "name, llm_kwargs",
    [
        ("qwen3_static", dict(num_kv_blocks=64)),
        ("qwen3_static", dict(num_kv_blocks=64, max_num_batched_tokens=13)),
        ("deepseek_v2_static", dict(num_kv_blocks=64)),
    ],
    ids=["qwen3", "qwen3_chunked", "deepseek_v2"],
)
def test_static_activation_scales_are_hf_static_w8a8_choices(checkpoints, name, llm_kwargs, tmp_path):
    """A per-tensor checkpoint with calibrated static input scales: against transformers with
    every FP8 layer's input quantized by that layer's scale (a merged layer's largest, the
    experts' largest), the engine's tokens are transformers' own choices, the first of every
    prompt included, as for the dynamic W8A8 replay above."""
    fp8_dir, dequant_dir, _ = checkpoints[name]
    prompts, got = _prompts(), _engine_tokens(fp8_dir, **llm_kwargs, **W8A8_REPLAY_KWARGS)
    hf = _hf_static_model(*_static_oracle_inputs(fp8_dir, dequant_dir, tmp_path / "oracle"))
    agree = _hf_choices(hf, prompts, got)
    assert bool(agree[:, 0].all()), f"first tokens: {agree[:, 0].tolist()}"
    assert agree.float().mean() >= 0.95, (
        f"{int(agree.sum())}/{agree.numel()} tokens are transformers' choices"
    )


def test_static_prompt_steps_through_scaled_mm_are_hf_static_w8a8_choices(checkpoints, tmp_path, monkeypatch):
    """A static checkpoint on the Triton kernels' backend, whose many-token steps run torch's
    scaled_mm on folded scales (`scaled_mm_fp8`; its threshold lowered to 16 tokens so that the
    tiny prompts' steps reach it, chunked to 24): the same gates against transformers quantizing
    each layer's input by its scale (on a GPU, where the block GEMM's FP8 dots round more, the
    Triton engine's gate above). Eager steps: a CUDA graph would call the layers at its capture's
    padded sizes, and not at all when replayed."""
    from tilellm.kernels import fp8_gemm
    from tilellm.models import quantization

    calls = []
    real = fp8_gemm.scaled_mm_fp8
    monkeypatch.setattr(fp8_gemm, "scaled_mm_fp8", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(quantization, "SCALED_MM_MIN_TOKENS", 16)
    fp8_dir, dequant_dir, _ = checkpoints["qwen3_static"]
    prompts = _prompts()
    got = _engine_greedy(
        fp8_dir, prompts, num_kv_blocks=64, max_num_batched_tokens=24, fused_ops_backend="triton",
        enforce_eager=True,
    )  # fmt: skip
    # steps of 17-24 tokens (chunks of the budget) reach it: on the CPU all of the tiny Qwen3's 8
    # FP8 layers in every such step; on a GPU the 4 unmerged ones (o_proj, down_proj), since the
    # merged layers' shards carry scales of their own (row-wise), which cuBLAS takes only with
    # bfloat16 output (`scaled_mm_fp8_unavailable`; this engine runs float32), so Triton's GEMM
    # runs them
    per_step = 4 if torch.cuda.is_available() else 8
    assert len(calls) >= per_step and len(calls) % per_step == 0 and max(calls) <= 24, calls
    assert min(calls) >= 16, calls
    hf = _hf_static_model(*_static_oracle_inputs(fp8_dir, dequant_dir, tmp_path / "oracle"))
    agree = _hf_choices(hf, prompts, got)
    if not torch.cuda.is_available():
        assert bool(agree[:, 0].all()), f"first tokens: {agree[:, 0].tolist()}"
    assert agree.float().mean() >= (0.85 if torch.cuda.is_available() else 0.95), (
        f"{int(agree.sum())}/{agree.numel()} tokens are transformers' choices"
    )


@pytest.mark.parametrize("name", ["qwen3_static", "deepseek_v2_static"])
def test_static_activation_scales_stay_close_to_hf(checkpoints, name, tmp_path):
    """Static scales cost accuracy only through the activations' rounding (each scale fits its
    layer's calibrated range): against transformers on the engine's weights
    (`_static_oracle_inputs`) with unquantized activations, the logits stay within the dynamic
    case's bound; and they differ from the engine's on the same weights with dynamic
    activations (the static scales are what runs)."""
    fp8_dir, dequant_dir, gemms = checkpoints[name]
    prompts = _prompts()
    oracle_dir, _ = _static_oracle_inputs(fp8_dir, dequant_dir, tmp_path / "oracle")
    hf = _hf_model(oracle_dir, w8a8=False)
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    got = _last_logits(fp8_dir, prompts)
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    bound = math.sqrt(gemms) * PER_GEMM_RMS
    assert rel.mean() < bound and rel.max() < 2 * bound, (
        f"relative logit errors {rel.tolist()}, bound {bound:.3f}"
    )
    dynamic = tmp_path / "dynamic"
    shutil.copytree(fp8_dir, dynamic)
    config = json.loads((dynamic / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "dynamic"
    (dynamic / "config.json").write_text(json.dumps(config))
    assert not torch.allclose(got, _last_logits(str(dynamic), prompts), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the FP8 tensor-core dot needs a CUDA device")
@pytest.mark.parametrize("name", ["qwen3", "deepseek_v2"])
def test_triton_fp8_gemm_engine_agrees_with_the_w8a8_replay(checkpoints, name):
    """The engine on the Triton FP8 GEMM (tensor-core dots), chunked and not: its greedy tokens
    are mostly the W8A8 replay's own choices (its k-block sums differ from fp32 by up to ~2e-3,
    so more inputs cross an e4m3 boundary than on the CPU: on the H200 the un-chunked runs
    matched 6 (Qwen3) and 5 (DeepSeek-V2) of the 7 first tokens)."""
    fp8_dir, dequant_dir, _ = checkpoints[name]
    hf = _hf_model(dequant_dir, w8a8=True)
    for kwargs in (dict(num_kv_blocks=64), dict(num_kv_blocks=64, max_num_batched_tokens=13)):
        prompts, got = _prompts(), _engine_tokens(fp8_dir, **kwargs)
        agree = _hf_choices(hf, prompts, got)
        assert agree.float().mean() >= 0.85, (
            f"{kwargs}: {int(agree.sum())}/{agree.numel()} tokens are transformers' choices"
        )


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v2"])
def test_close_to_hf_with_unquantized_activations(checkpoints, name):
    """The logits' error is the activation quantization's (module docstring), and the engine's
    greedy tokens are mostly transformers' own choices given the same prefix (measured: 60 and
    58 of 70; free-running, 29 and 24 of 70 agree, the first tokens of 5 of 7 prompts)."""
    fp8_dir, dequant_dir, gemms = checkpoints[name]
    prompts = _prompts()
    hf = _hf_model(dequant_dir, w8a8=False)
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    rel = (_last_logits(fp8_dir, prompts) - want).norm(dim=-1) / want.norm(dim=-1)
    bound = math.sqrt(gemms) * PER_GEMM_RMS
    assert rel.mean() < bound and rel.max() < 2 * bound, (
        f"relative logit errors {rel.tolist()}, bound {bound:.3f}"
    )

    got = _engine_tokens(fp8_dir, num_kv_blocks=64)
    # continuations that vary (not one repeated token), so that the agreement says something
    assert len({tuple(g) for g in got}) == len(got) and len({t for g in got for t in g}) > 3 * MAX_TOKENS
    agree = _hf_choices(hf, prompts, got)
    assert agree.float().mean() >= 0.75, (
        f"{int(agree.sum())}/{agree.numel()} tokens are transformers' choices"
    )


def test_online_quantization_is_the_fp8_checkpoint(tmp_path):
    """`LLM(float checkpoint, quantization="fp8")` quantizes at load in [128, 128] blocks what
    `quantize_model_dir_fp8` writes (q, k and v of 128 rows each, so that the merged layer's
    blocks are the checkpoint matrices' own): the same model, so the same logits bit for bit
    and the same greedy tokens as the FP8 checkpoint, which are transformers' W8A8 choices
    (activations in 128-wide groups) as in `test_greedy_tokens_are_hf_w8a8_choices`."""
    src = make_tiny_model(
        tmp_path / "llama", "LlamaForCausalLM", seed=2, hidden_size=128, head_dim=32, num_kv_heads=4,
        intermediate_size=256, tie_word_embeddings=False,
    )  # fmt: skip
    fp8_dir = quantize_model_dir_fp8(src, tmp_path / "fp8")
    prompts = _prompts()
    assert torch.equal(
        _prefill_logits(str(src), prompts, quantization="fp8"), _prefill_logits(str(fp8_dir), prompts)
    )
    got = _engine_greedy(str(src), prompts, num_kv_blocks=64, quantization="fp8", **W8A8_REPLAY_KWARGS)
    assert got == _engine_greedy(str(fp8_dir), prompts, num_kv_blocks=64, **W8A8_REPLAY_KWARGS)
    oracle = dequantize_model_dir(fp8_dir, tmp_path / "dequant")
    agree = _hf_choices(_hf_model(str(oracle), w8a8=True, group=128), prompts, got)
    assert bool(agree[:, 0].all()) and agree.float().mean() >= 0.95, agree.tolist()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_static"])
def test_fp8_gemv_keeps_the_greedy_tokens(checkpoints, name, monkeypatch):
    """`TILELLM_GEMV=1` on the Triton kernels' backend (the interpreter on the CPU): the FP8
    layers' decode steps of one and two sequences run `fp8_gemv.py` (dynamic and static
    activation scales), with the RMSNorms in the qkv and gate-up launches and SiLU-and-mul in
    gate-up's, and give the tokens of the same engine without it, each step's top
    log-probabilities within fp32's summation-order error (the same x_q and scales, the same
    exact e4m3 products, summed in another order)."""
    from tilellm.kernels import fp8_gemm, fp8_gemv, fused

    fp8_dir = checkpoints[name][0]
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)

    launches: list = []  # (rows, gated, normalised) of each launch
    quantized: list = []  # whether each launch read an x quantized before it
    fused_quant: list = []  # the norm and SiLU-and-mul launches that quantized for the layer after

    def run():
        llm = LLM(fp8_dir, num_kv_blocks=32, max_num_seqs=2, fused_ops_backend="triton", enforce_eager=True)
        # (only the requests' steps are counted: on a GPU the engine's warm-up steps of 1-8 rows
        # run before them)
        for seen in (launches, quantized, fused_quant):
            seen.clear()
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run()

    def _assert_same_choices(outputs, want):
        """The same tokens, and each step's top log-probabilities within 1e-3."""
        assert [o.token_ids for o in outputs] == [o.token_ids for o in want]
        for g, w in zip(outputs, want):
            for step_got, step_want in zip(g.logprobs, w.logprobs):
                for token, logprob in step_want.items():
                    assert abs(step_got[token].logprob - logprob.logprob) < 1e-3, (token, step_got, step_want)

    monkeypatch.setenv("TILELLM_GEMV", "1")
    real = fp8_gemv.launch_fp8_gemv

    def spy(x, *args, **kwargs):
        launches.append((x.shape[0], kwargs.get("gated", False), kwargs.get("norm") is not None))
        quantized.append(kwargs.get("x_s") is not None)
        return real(x, *args, **kwargs)

    for module in (fp8_gemm, fp8_gemv):  # (`w8a8_block_fp8_linear`'s launches, `fp8_gemv_linear`'s)
        monkeypatch.setattr(module, "launch_fp8_gemv", spy)
    got = run()
    _assert_same_choices(got, want)
    # each layer's 4 launches of each decode step at two rows (3 a prompt, the two together):
    # norm + qkv, o_proj, norm + gate-up + SiLU, down_proj
    for kind in ((2, False, True), (2, False, False), (2, True, True)):
        assert launches.count(kind) >= (2 if kind[2] or kind[1] else 4) * 3, (kind, launches)
    assert not any(quantized)
    # rows quantized before the launch (as for more rows, or fewer weight rows a program): the norm
    # and SiLU-and-mul launches quantize (dynamic scales; static ones, the layer's own launch),
    # and the kernel loads x_q and its scales
    monkeypatch.setattr(fp8_gemv, "MAX_QUANT_ROWS_PER_WEIGHT_ROW", 0.0)
    for op in ("rms_norm_per_token_group_quant_fp8", "silu_and_mul_per_token_group_quant_fp8"):
        real_op = getattr(fused, op)
        monkeypatch.setattr(
            fused, op, lambda x, *a, _op=real_op, **k: fused_quant.append(x.shape[0]) or _op(x, *a, **k)
        )
    again = run()
    _assert_same_choices(again, want)
    assert launches.count((2, False, False)) >= 4 * 2 * 3 and all(quantized), launches
    # dynamic scales: each decode step's norms (before qkv and gate-up) and SiLU-and-mul quantize;
    # static ones quantize in the layer's own path (`scaled_fp8_quant`), never in those launches
    if name.endswith("static"):
        assert not fused_quant, fused_quant
    else:
        assert fused_quant.count(2) >= 3 * 2 * 3, fused_quant
