"""The offline API's input errors name the real problem: a dict of sampling settings, no prompts
at all, an unknown chat role; and the offline API and the server apply one rule to a request's
length, max_tokens, n and stop_token_ids (`SamplingParams.check_request`), with one message."""

from __future__ import annotations

import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, assert_error


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from tilellm import LLM

    return LLM(
        tiny_model_dir,
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,  # as the test server's
    )


def test_a_dict_of_sampling_settings_says_so(llm):
    with pytest.raises(TypeError, match=r"got dict: pass SamplingParams\(\*\*"):
        llm.generate(["Hello"], {"max_tokens": 3}, use_tqdm=False)


@pytest.mark.parametrize("prompts", [None, 5])
def test_no_prompts_says_what_a_prompt_is(llm, prompts):
    with pytest.raises(TypeError, match="prompts must be a string"):
        llm.generate(prompts, use_tqdm=False)


def test_an_empty_prompt_list_says_so(llm):
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.generate([], use_tqdm=False)


def test_an_unknown_chat_role_is_named(llm):
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        llm.chat([{"role": "robot", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat([], use_tqdm=False)


def _offline_error(llm, prompt: list[int], **params) -> str:
    from tilellm import SamplingParams

    with pytest.raises(ValueError) as exc:
        llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    return str(exc.value)


def test_a_prompt_of_max_model_len_tokens_is_refused_alike(llm, http):
    """It leaves no room for one output token: ValueError offline, 400 in the server, one message
    naming both numbers."""
    prompt = [7] * MAX_MODEL_LEN
    offline = _offline_error(llm, prompt, max_tokens=1)
    assert f"({MAX_MODEL_LEN} tokens)" in offline and f"max_model_len ({MAX_MODEL_LEN})" in offline
    r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert assert_error(r, 400, "prompt")["message"] == offline
    one_less = llm.generate([prompt[1:]], use_tqdm=False)[0].outputs[0]
    assert len(one_less.token_ids) == 1 and one_less.finish_reason == "length"


def test_max_tokens_beyond_the_room_is_cut_alike(llm, http):
    """max_tokens larger than what the context has left is cut to it, offline and served."""
    from tilellm import SamplingParams

    prompt, room = [9] * (MAX_MODEL_LEN - 5), 5
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    offline = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    served = r.json()
    assert len(offline.token_ids) == served["usage"]["completion_tokens"] == room
    assert offline.finish_reason == served["choices"][0]["finish_reason"] == "length"


def test_a_stop_token_outside_the_vocabulary_is_refused_alike(llm, http):
    vocab = llm.llm_engine.vocab_size
    offline = _offline_error(llm, [5, 6], stop_token_ids=[3, vocab])
    assert f"token id {vocab}" in offline and f"[0, {vocab})" in offline
    body = {"model": MODEL_NAME, "prompt": [5, 6], "stop_token_ids": [3, vocab]}
    assert assert_error(http.post("/v1/completions", json=body), 400, "stop_token_ids")["message"] == offline


def test_n_has_one_limit(llm, http):
    from tilellm import SamplingParams
    from tilellm.engine.sampling_params import MAX_N

    with pytest.raises(ValueError, match=rf"SamplingParams.n must be an integer in \[1, {MAX_N}\]"):
        SamplingParams(n=MAX_N + 1)
    SamplingParams(n=MAX_N)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "n": MAX_N + 1}
    assert str(MAX_N) in assert_error(http.post("/v1/completions", json=body), 400, "n")["message"]
