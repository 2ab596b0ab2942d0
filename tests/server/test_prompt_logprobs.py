"""Prompt logprobs through the server: `echo` with `logprobs` in /v1/completions (the request
lm-evaluation-harness's `local-completions` model sends for loglikelihood tasks) and vLLM's
`prompt_logprobs` field, against `transformers`' log-softmax."""

from __future__ import annotations

import json

import pytest
import torch

from tests.server.conftest import MODEL_NAME

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def _lm_eval_body(**extra) -> dict:
    # What lm-eval's local-completions sends for a loglikelihood request.
    return {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        **extra,
    }


def test_echo_with_logprobs_scores_the_prompt(http, hf_logprobs, tokenizer):
    ids, want = hf_logprobs
    r = http.post("/v1/completions", json=_lm_eval_body(seed=1234))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 1  # the prompt's tokens, then the one generated
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for got, exp in zip(lp["token_logprobs"][1:n], want[1:]):
        assert got == pytest.approx(exp, abs=1e-4)
    # lm-eval's greedy check: the top-1 entry of each position
    assert all(isinstance(t, dict) and len(t) == 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]


def test_echo_with_logprobs_streamed(http, hf_logprobs):
    ids, want = hf_logprobs
    with http.stream("POST", "/v1/completions", json=_lm_eval_body(stream=True)) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    assert first["logprobs"]["token_logprobs"][0] is None
    for got, exp in zip(first["logprobs"]["token_logprobs"][1:], want[1:]):
        assert got == pytest.approx(exp, abs=1e-4)


def test_vllm_prompt_logprobs_field(http, hf_logprobs):
    ids, want = hf_logprobs
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert str(ids[i]) in entry and 2 <= len(entry) <= 3
        assert entry[str(ids[i])]["logprob"] == pytest.approx(want[i], abs=1e-4)


def test_prompt_logprobs_out_of_range_is_400(http):
    from tests.server.conftest import assert_error

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 99}
    assert_error(http.post("/v1/completions", json=body), 400, "prompt_logprobs")
