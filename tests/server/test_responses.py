"""POST /v1/responses through the `openai` client's `responses.create` (and its streaming
events): text input and message lists, `instructions`, `text.format` json_schema, function tools
with `required` / named / `auto` choices (Hermes output parsed, reasoning split off), function
call outputs sent back, `store: false`, and the requests that are refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, assert_error, assert_serving
from tests.server.helpers import scripted_tool_client

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_time", "parameters": SCHEMA, "description": "Time in a city"}]


def test_text_input(client):
    out = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=8, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant"
    assert out.output_text == item.content[0].text and out.output_text
    assert out.usage.output_tokens == 8 and out.usage.total_tokens == out.usage.input_tokens + 8
    assert out.store is False


def test_same_answer_as_chat(client, http):
    """`instructions` + a message list is the chat request with a system message first."""
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": [{"type": "input_text", "text": "again"}]}]  # fmt: skip
    out = client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", input=messages, max_output_tokens=12, temperature=0
    )
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": "Be brief."},
                *messages[:2],
                {"role": "user", "content": "again"},
            ],
            "max_tokens": 12,
            "temperature": 0,
        },
    ).json()
    assert out.output_text == chat["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_streamed_events(client):
    kw = dict(model=MODEL_NAME, input="Hello", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    assert events[-1].response.output_text == text


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA}
    for temperature in (0.0, 1.0):
        out = client.responses.create(
            model=MODEL_NAME, input="A city as JSON", text={"format": fmt}, max_output_tokens=60,
            temperature=temperature,
        )  # fmt: skip
        if out.status == "completed":
            jsonschema.validate(json.loads(out.output_text), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_function_calls(tclient, choice):
    kw = dict(model=MODEL_NAME, input="Time in Oslo?", tools=TOOLS, tool_choice=choice, max_output_tokens=200)
    out = tclient.responses.create(**kw, temperature=1.0)
    calls = [i for i in out.output if i.type == "function_call"]
    assert out.status == "completed" and len(calls) >= 1
    for call in calls:
        assert call.name == "get_time" and call.call_id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
    events = list(tclient.responses.create(**kw, temperature=0.0, stream=True))
    final = events[-1].response
    streamed = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in streamed] == [i.arguments for i in final.output if i.type == "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(e.arguments for e in streamed)


def test_function_call_output_reaches_the_template(tclient, thttp):
    """A function call and its output sent back as input items render as the chat template's
    assistant call and tool answer (the prompt counted in usage equals /tokenize's)."""
    items = [
        {"role": "user", "content": "Time in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
    ]
    out = tclient.responses.create(
        model=MODEL_NAME, input=items, tools=TOOLS, max_output_tokens=4, tool_choice="none"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}
    messages = [
        items[0],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    tok = thttp.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    assert out.usage.input_tokens == tok["count"]


SCRIPT = (
    "<think>\nOslo time.\n</think>\n\nOne moment.\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def auto_client(tokenizer):
    with scripted_tool_client(tokenizer, SCRIPT) as client:
        yield client


def test_auto_items_in_order(auto_client):
    want = [
        ("reasoning", "\nOslo time.\n"),
        ("message", "One moment."),
        ("function_call", '{"city": "Oslo"}'),
    ]

    def summary(output):
        out = []
        for item in output:
            if item.type == "reasoning":
                out.append((item.type, item.content[0].text))
            elif item.type == "message":
                out.append((item.type, item.content[0].text))
            else:
                out.append((item.type, json.dumps(json.loads(item.arguments))))
        return out

    kw = dict(model="fake", input="Time?", tools=TOOLS, max_output_tokens=200)
    assert summary(auto_client.responses.create(**kw).output) == want
    events = list(auto_client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.completed"
    assert summary(events[-1].response.output) == want
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == want[0][1]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": TOOLS}, "tool_choice"),  # auto needs --enable-auto-tool-choice
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "zz"}}}},
            "text.format",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)
def test_refused(http, body, param):
    r = http.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert_error(r, 404 if param == "model" else 400, param)
    assert_serving(http)


def test_unknown_fields_are_named(http):
    r = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "x", "max_output_tokens": 1, "zzz": 1})
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "zzz"
