"""`tilellm.server.tool_parsers`: Hermes `<tool_call>` blocks, `required` arrays and named
choices read into OpenAI tool calls; the streamed deltas join to the whole output's parse
wherever the deltas cut the text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilellm.server.tool_parsers import (
    NamedToolStream,
    RequiredToolStream,
    extract_named,
    extract_required,
    get_tool_parser,
    required_schema,
)

HERMES = get_tool_parser("hermes")

CALL_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "echo", "arguments": {"text": "a </tool_call in a string"}}\n</tool_call>',
    '<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call> done',
    '<tool_call>\n{"name": "cut", "arguments": {"q": "unterminated block"}}',  # stopped at the end token
    '<tool_call>\n{"name": "uni", "arguments": {"s": "\\u00e9t\\u00e9 \\"quoted\\""}}\n</tool_call>',
    'A <tool_call>{"name": "as_text", "arguments": "{\\"a\\": 1}"}</tool_call> B',
    '<tool_call>{"name":"compact","arguments":{"a":1,"b":[2]}}</tool_call>',
]
PLAIN_TEXTS = ["no calls here  \n", "a <tool_call>not json</tool_call> b", "<tool_call", "  lead"]


def _raw(deltas: list[dict]) -> list[str]:
    """Each streamed call's arguments text, joined."""
    out: dict[int, str] = {}
    for d in deltas:
        out[d["index"]] = out.get(d["index"], "") + d["function"]["arguments"]
    return [text for _, text in sorted(out.items())]


def _join(deltas: list[dict]) -> list[tuple[str, object]]:
    """Streamed tool-call deltas as (name, decoded arguments) per call index, checking that
    each call's first delta carries its id and type and the later ones none."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.get(d["index"])
        if c is None:
            assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function"
            c = calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        else:
            assert "id" not in d and "name" not in d["function"]
        c["arguments"] += d["function"]["arguments"]
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def _stream(stream, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    content, deltas = "", []
    for a, b in zip([0, *points], [*points, len(text)]):
        c, d = stream.feed(text[a:b])
        content, deltas = content + c, deltas + d
    c, d = stream.flush()
    return content + c, deltas + d


def test_hermes_extract():
    content, calls = HERMES.extract(CALL_TEXTS[0])
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, {"a": "}"}]}),
        ("noop", {}),
    ]
    assert calls[0].to_openai()["type"] == "function" and calls[0].id != calls[1].id
    assert HERMES.extract(CALL_TEXTS[3])[1][0].name == "cut"
    assert HERMES.extract(CALL_TEXTS[2])[0] == "done"
    content, calls = HERMES.extract(CALL_TEXTS[5])
    assert content == "A\nB" and calls[0].arguments == '{"a": 1}'  # a string's text; text one per line
    assert HERMES.extract(CALL_TEXTS[6])[1][0].arguments == '{"a":1,"b":[2]}'  # as written


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_hermes_text_without_a_valid_call_is_all_content(text):
    assert HERMES.extract(text) == (text, [])


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(CALL_TEXTS + PLAIN_TEXTS), cuts=st.lists(st.integers(0, 200), max_size=40))
def test_hermes_stream_equals_extract_wherever_the_deltas_cut(text, cuts):
    want_content, want_calls = HERMES.extract(text)
    content, deltas = _stream(HERMES.stream(), text, cuts)
    assert _join(deltas) == [(c.name, json.loads(c.arguments)) for c in want_calls]
    assert _raw(deltas) == [c.arguments for c in want_calls]  # the same text, not just the same JSON
    assert (content or None) == want_content


def test_hermes_stream_sends_the_name_before_the_arguments_end():
    stream = HERMES.stream()
    _, deltas = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["function"]["arguments"] == '{"city": "Pa'
    _, deltas = stream.feed('ris"}}\n</tool_call>')
    assert deltas == [{"index": 0, "function": {"arguments": 'ris"}'}}]


SCHEMA_TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]


def test_required_schema_lists_every_tool():
    schema = required_schema(SCHEMA_TOOLS, parallel=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["f"], ["g"]]
    assert "maxItems" not in required_schema(SCHEMA_TOOLS, parallel=True)


REQUIRED = '[{"name":"f","parameters":{"a":1,"s":"}]"}},{"name":"g","parameters":{}}]'


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, len(REQUIRED)), max_size=30))
def test_required_stream_equals_extract(cuts):
    _, deltas = _stream(RequiredToolStream(), REQUIRED, cuts)
    want = extract_required(REQUIRED)
    assert want is not None
    assert _join(deltas) == [(c.name, json.loads(c.arguments)) for c in want]


def test_required_and_named_cut_short_are_not_calls():
    assert extract_required(REQUIRED[:-5]) is None
    assert extract_required('{"name": "f"}') is None  # not an array
    assert extract_named('{"a": ', "f") is None
    (call,) = extract_named('{"a": 1}', "f")
    assert (call.name, call.arguments) == ("f", '{"a": 1}')


def test_named_stream():
    content, deltas = _stream(NamedToolStream("f"), '{"a": [1, 2]}', [3, 7])
    assert content == "" and _join(deltas) == [("f", {"a": [1, 2]})]


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="unknown tool call parser 'xml'; choose one of hermes"):
        get_tool_parser("xml")
