"""Tool calling in /v1/chat/completions through the `openai` client: `required` and named
choices constrained on the tiny random model (the arguments always parse and match the
function's schema, at temperature 0 and 1, streamed and not), `auto` parsed from Hermes
`<tool_call>` output (a scripted engine, and the real one with its output forced by a regex),
tools and earlier calls reaching the chat template, and the requests that are refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, assert_error, assert_serving
from tests.server.helpers import scripted_tool_client

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _joined_stream(stream):
    """(content, {index: (name, arguments)}, finish_reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            name, args = calls.get(d.index, (None, ""))
            if d.function.name:
                name = d.function.name
            calls[d.index] = (name, args + (d.function.arguments or ""))
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_calls_always_parse(tclient, temperature):
    out = tclient.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=120, n=3, seed=1, temperature=temperature,
    )  # fmt: skip
    for choice in out.choices:
        if choice.finish_reason == "length":  # cut short: the text as it is, no calls
            assert not choice.message.tool_calls
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)


def test_required_without_parallel_calls_makes_one(tclient):
    out = tclient.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, n=4, seed=3, temperature=1.0,
    )  # fmt: skip
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":
            assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_choice_calls_that_function(tclient, temperature):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = tclient.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named,
        max_tokens=60, n=3, seed=2, temperature=temperature,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice  # OpenAI's for a named choice
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, {"get_time"})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_join_to_the_calls(tclient, choice):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=120, seed=5)
    whole = tclient.chat.completions.create(**kw, temperature=0.0)
    content, calls, finish = _joined_stream(
        tclient.chat.completions.create(**kw, temperature=0.0, stream=True)
    )
    assert finish == whole.choices[0].finish_reason
    if finish == "length":
        return
    assert finish == ("tool_calls" if choice == "required" else "stop") and content == ""
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == want


def test_tools_and_earlier_calls_reach_the_template(thttp):
    messages = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = thttp.post(
        "/tokenize",
        json={"model": MODEL_NAME, "messages": messages, "tools": TOOLS, "return_token_strs": True},
    )
    assert r.status_code == 200, r.text
    text = "".join(
        thttp.post("/detokenize", json={"model": MODEL_NAME, "tokens": r.json()["tokens"]}).json()["prompt"]
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]["function"]["parameters"]["properties"]["city"]) in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
        in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # tool_choice "none": the template is given no tools
    r = thttp.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "none",
            "max_tokens": 2,
        },
    )
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # unset: auto
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "leave response_format",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "given twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", None),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type", None),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
            "does not compile",
        ),
    ],
    ids=[
        "auto-by-default", "auto", "no-tools", "unknown-name", "with-response-format", "duplicate",
        "bad-name", "bad-type", "bad-choice", "bad-schema",
    ],
)  # fmt: skip
def test_refused_tool_requests(http, extra, param, words):
    r = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **extra})
    body = assert_error(r, 400, param)
    if words:
        assert words in body["message"]
    assert_serving(http)


# ---- tool_choice "auto": Hermes output parsed ----

SCRIPT = (
    "<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def auto_client(tokenizer):
    with scripted_tool_client(tokenizer, SCRIPT) as client:
        yield client


WANT_AUTO = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]


def test_auto_parses_hermes_calls(auto_client):
    out = auto_client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "\nThe user wants weather.\n"
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ] == WANT_AUTO


def test_auto_streamed(auto_client):
    stream = auto_client.chat.completions.create(
        model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=True
    )
    content, calls, finish = _joined_stream(stream)
    assert finish == "tool_calls" and content == "Checking."
    assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == WANT_AUTO


def test_auto_cut_by_max_tokens_is_length(auto_client):
    out = auto_client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=5)
    assert out.choices[0].finish_reason == "length"


def test_auto_on_the_real_engine(tclient):
    """The real engine's own tokens, forced into a Hermes call by a regex, parsed by `auto`."""
    regex = r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    kw = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, seed=7,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    out = tclient.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    _check_calls(choice.message.tool_calls, {"get_time"})
    content, calls, finish = _joined_stream(tclient.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]
