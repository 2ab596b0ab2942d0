"""The offline API's input errors name the real problem (the server's validation has its own
tests): a dict of sampling settings, no prompts at all, an unknown chat role."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from tilellm import LLM

    return LLM(tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=4)


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
