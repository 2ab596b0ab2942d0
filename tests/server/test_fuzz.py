"""Random request bodies: never a 500, and every 4xx carries OpenAI's error shape.

Bodies mix the real field names with well-typed, edge and wrongly typed values (and junk keys),
so most examples reach the engine's own checks rather than stopping at JSON parsing. Generation
lengths are kept tiny so the fuzz stays within a few seconds.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, assert_error, assert_serving

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
small_int = st.integers(-3, 4)
prob = st.floats(-0.5, 1.5, allow_nan=False)
token_ids = st.lists(st.integers(-2, 400), max_size=12)
stop = st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)

COMMON = {
    "model": st.sampled_from([MODEL_NAME, "other"]) | junk,
    "n": small_int | junk,
    "temperature": prob | junk,
    "top_p": prob | junk,
    "top_k": small_int | junk,
    "min_p": prob | junk,
    "seed": st.integers(-(2**65), 2**65) | junk,
    "stop": stop | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | junk,
    "presence_penalty": st.sampled_from([0, 0.0, 1.0]) | junk,
    "logit_bias": st.just({}) | junk,
    "ignore_eos": st.booleans() | junk,
    "min_tokens": small_int | junk,
    "stop_token_ids": token_ids | junk,
    "max_tokens": small_int | junk,
}
COMPLETION = {
    **COMMON,
    "prompt": st.text(max_size=20) | token_ids | st.lists(st.text(max_size=8), max_size=3) | junk,
    "logprobs": st.integers(-1, 21) | junk,
    "echo": st.booleans() | junk,
}
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "robot"]) | junk,
        "content": st.text(max_size=20) | junk,
    }
)
CHAT = {
    **COMMON,
    "messages": st.lists(message, max_size=3) | junk,
    "max_completion_tokens": small_int | junk,
    "logprobs": st.booleans() | junk,
    "top_logprobs": st.integers(-1, 21) | junk,
}


def _body(fields: dict) -> st.SearchStrategy:
    """Any subset of the fields (chat bodies always bound the generation length), plus junk keys."""
    return st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(st.text(max_size=6), junk, max_size=2).map(lambda extra: {**extra, **d})
    )


def _bounded(body: dict, chat: bool) -> dict:
    # Keep generations short: a null (or, in chat, absent) max_tokens means "up to the context length".
    if "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = 2
    if (
        chat
        and not isinstance(body.get("max_tokens"), int)
        and not isinstance(body.get("max_completion_tokens"), int)
    ):
        body["max_tokens"] = 2
    return body


def _check(http, path: str, body: dict | bytes) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    with http.stream("POST", path, content=content, headers=headers) as resp:
        resp.read()
    assert resp.status_code != 500 and resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert_error(resp, resp.status_code)
        return
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        assert "usage" in resp.json()


FUZZ = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)


@FUZZ
@given(body=_body(COMPLETION))
def test_fuzz_completions(http, body):
    _check(http, "/v1/completions", _bounded(body, chat=False))


@FUZZ
@given(body=_body(CHAT))
def test_fuzz_chat(http, body):
    _check(http, "/v1/chat/completions", _bounded(body, chat=True))


@settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
@given(raw=st.binary(max_size=64) | junk.map(lambda v: json.dumps(v).encode()))
def test_fuzz_raw_bodies(http, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        _check(http, path, raw)


@pytest.fixture(autouse=True)
def _still_serving(http):
    yield
    assert_serving(http)
