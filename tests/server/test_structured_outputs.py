"""Structured outputs through the server: `response_format` (json_schema, json_object) and
vLLM's `structured_outputs` extra field (json, regex, choice, grammar), through the `openai`
client, streamed and not; a grammar that cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, assert_error, assert_serving

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me a city as JSON."}]


def _texts(client, n=3, **kw) -> list[tuple[str, str]]:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=80, n=n, seed=4, **kw
    )
    return [(c.message.content, c.finish_reason) for c in out.choices]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    for text, reason in _texts(client, temperature=temperature, response_format=fmt):
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(client):
    for text, reason in _texts(client, temperature=1.0, response_format={"type": "json_object"}):
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "so, check",
    [
        ({"regex": r"\d{3}-[xy]{2}"}, lambda t: re.fullmatch(r"\d{3}-[xy]{2}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= "ok" ("!")?'}, lambda t: t in ("ok", "ok!")),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_structured_outputs_extra_field(client, so, check):
    for text, reason in _texts(client, temperature=1.0, extra_body={"structured_outputs": so}):
        assert reason == "stop" and check(text), text


def test_streamed_constrained_output(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, stream=True,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("alpha", "beta")


def test_completions_take_it_too(http):
    body = {
        "model": MODEL_NAME,
        "prompt": "Color:",
        "max_tokens": 10,
        "structured_outputs": {"choice": ["a", "b"]},
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("a", "b")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "minProperties": "x"}},
                }
            },
            "response_format",
        ),
    ],
)
def test_bad_structured_outputs_are_a_400(http, extra, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, **extra}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert_serving(http)
