"""Random request bodies: never a 500, and every 4xx carries OpenAI's error shape.

Bodies start from plausible values of the real fields (so many reach the engine and succeed) and
then get a few fields, or unknown keys, replaced by junk or edge values (so the validation paths
are hit too). Generation lengths are kept tiny so the fuzz stays within a few seconds.
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
edge = st.sampled_from(
    [0, -1, 1, 2**63, -(2**63) - 1, 0.0, -0.0, 1e-320, 1e308, "", " ", [], {}, [None], True, False]
)
token_id = st.integers(0, 380)
stop_text = st.text(min_size=1, max_size=3)

# Values a client would plausibly send; most bodies built from them alone are valid.
COMMON = {
    "model": st.just(MODEL_NAME),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 1.5),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
    "min_p": st.floats(0, 0.5),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": stop_text | st.lists(stop_text, max_size=3),
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 4),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "stop_token_ids": st.lists(token_id, max_size=3),
    "presence_penalty": st.just(0),
    "user": st.text(max_size=5),
}
COMPLETION = {
    **COMMON,
    "prompt": st.text(min_size=1, max_size=20)
    | st.lists(token_id, min_size=1, max_size=12)
    | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3),
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
)
CHAT = {
    **COMMON,
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, 4),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
}


def _body(fields: dict, required: str) -> st.SearchStrategy:
    """A plausible body (any subset of the fields plus the required one), then 0-3 keys (a field
    or a junk key) set to junk or edge values."""
    optional = {k: v for k, v in fields.items() if k != required}
    plausible = st.fixed_dictionaries({required: fields[required]}, optional=optional)
    keys = st.sampled_from([*fields, "stream_options", "logit_bias"]) | st.text(max_size=6)
    mutations = st.lists(st.tuples(keys, junk | edge), max_size=3).filter(
        lambda m: len(m) < 2 or m[0] != m[1]
    )
    return st.tuples(plausible, st.sampled_from([0, 0, 1, 1, 2, 3]), mutations).map(
        lambda t: {**t[0], **dict(t[2][: t[1]])}
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
@given(body=_body(COMPLETION, "prompt"))
def test_fuzz_completions(http, body):
    _check(http, "/v1/completions", _bounded(body, chat=False))


@FUZZ
@given(body=_body(CHAT, "messages"))
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
