"""Penalties, logit bias and allowed tokens (vLLM's definitions) against a hand-written greedy
oracle on `transformers`' logits (fp32, CPU), in batches mixing them with plain requests, under
asynchronous scheduling, preemption and speculative decoding of the plain requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.conftest import PROCESSING_SETTINGS as SETTINGS
from tilellm import LLM, SamplingParams

MAX_TOKENS = 12

_HF: dict[str, object] = {}


def oracle(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with vLLM's logits processing, one token at a time on transformers."""
    from transformers import AutoModelForCausalLM

    model = _HF.get(model_dir)
    if model is None:
        model = _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            vocab = logits.shape[0]
            counts = (
                torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=vocab)
                if out
                else torch.zeros(vocab)
            )
            seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(prompt))
            r = params.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
            logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
            for t, b in (params.logit_bias or {}).items():
                logits[t] += b
            if params.allowed_token_ids is not None:
                keep = torch.zeros(vocab, dtype=torch.bool)
                keep[params.allowed_token_ids] = True
                logits = logits.masked_fill(~keep, float("-inf"))
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    motif = rng.integers(0, 380, 5).tolist()
    return [motif * 4, [7] * 10, rng.integers(0, 380, 23).tolist(), motif * 2 + [1, 2, 3]]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=0.9),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=-0.5, frequency_penalty=0.4,
        repetition_penalty=0.8, logit_bias={11: 3.0, 12: -50.0},
    ),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={5: 2.5, 383: -100}),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=[3, 4, 5, 300]),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),  # a plain request beside them
]  # fmt: skip


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_processing_matches_the_oracle(tiny_qwen3, setting):
    prompts = _prompts()
    pairs = [(p, params) for p in prompts for params in PARAMS]
    llm = LLM(tiny_qwen3, **SETTINGS[setting])
    llm.llm_engine.async_scheduling = setting == "async"
    outs = llm.generate([p for p, _ in pairs], [params for _, params in pairs], use_tqdm=False)
    for (prompt, params), out in zip(pairs, outs):
        assert out.outputs[0].token_ids == oracle(tiny_qwen3, prompt, params), params
    if setting == "tiny_pool_preempts":
        assert llm.llm_engine.get_stats().num_preemptions > 0


def test_penalties_change_the_output(tiny_qwen3):
    """The oracle test cannot pass by ignoring a penalty: each one changes these outputs."""
    prompt = [7] * 10
    plain = oracle(tiny_qwen3, prompt, PARAMS[-1])
    for params in PARAMS[:-1]:
        assert oracle(tiny_qwen3, prompt, params) != plain, params


def test_sampled_requests_with_penalties_are_reproducible(tiny_qwen3):
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=MAX_TOKENS, presence_penalty=1.0, top_p=0.9)
    runs = [
        [
            o.outputs[0].token_ids
            for o in LLM(tiny_qwen3, num_kv_blocks=96).generate(_prompts(), params, use_tqdm=False)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
    ],
)
def test_bad_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary(tiny_qwen3):
    llm = LLM(tiny_qwen3, num_kv_blocks=16)
    for kwargs in (dict(logit_bias={10_000: 1.0}), dict(allowed_token_ids=[1, 10_000])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 3]], SamplingParams(**kwargs), use_tqdm=False)
