"""`--reasoning-parser qwen3`: chat answers carry the model's `<think>` part as
`reasoning_content`, whole and streamed (the deltas join to the same split), through the
`openai` client, on an engine whose output is scripted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.server.fake_engine import ScriptedEngine
from tests.server.helpers import ServerThread
from tilellm.server.reasoning import get_reasoning_parser

THOUGHT = "<think>\nTwo and two make four.\n</think>\n\nFour."


@pytest.fixture(scope="module")
def client(tokenizer):
    import openai

    from tilellm.server import ServerConfig, create_app

    app = create_app(ScriptedEngine(tokenizer, THOUGHT), ServerConfig("fake", reasoning_parser="qwen3"))
    with ServerThread(app) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)


MESSAGES = [{"role": "user", "content": "2+2?"}]


def test_whole_answer_splits(client):
    out = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=100)
    message = out.choices[0].message
    assert message.content == "Four."
    assert message.model_extra["reasoning_content"] == "\nTwo and two make four.\n"


def test_streamed_deltas_join_to_the_same_split(client):
    stream = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=100, stream=True)
    reasoning = content = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("\nTwo and two make four.\n", "Four.")


def test_thinking_cut_by_max_tokens_is_all_reasoning(client):
    out = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=12)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.content == "" and message.model_extra["reasoning_content"].startswith("\nTwo")


@settings(max_examples=200, deadline=None)
@given(
    text=st.sampled_from(
        [THOUGHT, "Plain answer.", "<think>cut", "  <think>a</think>b", "<thin", "<think></think>"]
    ),
    cuts=st.lists(st.integers(min_value=1, max_value=60), max_size=8),
)
def test_stream_equals_split_wherever_the_deltas_cut(text, cuts):
    parser = get_reasoning_parser("qwen3")
    points = sorted({c for c in cuts if c < len(text)})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    stream = parser.stream()
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.flush()
    want_r, want_c = parser.split(text)
    assert (reasoning + r, content + c) == (want_r or "", want_c)
