"""Chat template options in /v1/chat/completions: `chat_template_kwargs` (Qwen3's
`enable_thinking`), `continue_final_message`, a per-request `chat_template`, and `serve
--chat-template` (a file or the template itself)."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL_NAME, assert_error

MESSAGES = [{"role": "user", "content": "Count to three."}]


def _prompt_tokens(http, **extra) -> int:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_chat_template_kwargs_reach_the_template(http, tokenizer):
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert "<think>" in text
    want = len(tokenizer.encode(text, add_special_tokens=False))
    assert _prompt_tokens(http, chat_template_kwargs={"enable_thinking": False}) == want
    assert _prompt_tokens(http) < want  # without it, no empty think block


def test_continue_final_message(http, tokenizer):
    messages = MESSAGES + [{"role": "assistant", "content": "One, two"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert _prompt_tokens(http, **body) == len(tokenizer.encode(text, add_special_tokens=False))


def test_a_request_brings_its_own_template(http, tokenizer):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert _prompt_tokens(http, chat_template=template) == len(
        tokenizer.encode("Count to three.", add_special_tokens=False)
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
    ],
)
def test_bad_template_options_are_a_400(http, extra, param):
    r = http.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, **extra}
    )
    assert_error(r, 400, param)


def test_serve_chat_template_flag(tmp_path):
    from tilellm.commands.common import UsageError
    from tilellm.commands.serve import _chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert _chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert _chat_template("{% for m in messages %}{% endfor %}").startswith("{% for")
    with pytest.raises(UsageError, match="--chat-template"):
        _chat_template(str(tmp_path / "missing.jinja"))
