"""Tool calls: the model's text -> OpenAI `tool_calls`, whole and streamed.

    parser = get_tool_parser("hermes")
    content, calls = parser.extract(text)                 # a whole output
    stream = parser.stream()
    content_delta, call_deltas = stream.feed(delta_text)  # streamed, in order
    content_delta, call_deltas = stream.flush()           # at the end of the output

Three shapes of output become tool calls:

- **Hermes** (`--tool-call-parser hermes`, what Qwen2.5 / Qwen3 write under `tool_choice: auto`):
  each call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>`; text outside the tags is the message's content.
- **Required** (`tool_choice: "required"`): the output is constrained (structured outputs) to a
  JSON array of `{"name": ..., "parameters": {...}}`, one item per call (`required_schema`).
- **Named** (`tool_choice: {"type": "function", ...}`): the output is constrained to the named
  function's parameter schema; the whole output is that call's arguments.

Streamed, a call's first delta carries its `id`, `type` and `function.name`, the following ones
pieces of `function.arguments` (raw JSON text, concatenating to the call's whole arguments), as
OpenAI streams them. A tag or a JSON value cut across deltas is held back until it is whole.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call; `arguments` is JSON text, as OpenAI's API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _as_call(obj: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "<arguments key>": ...}`; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    return ToolCall(obj["name"], _arguments_text(args))


def _held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _ArgumentsStream:
    """The streamed `arguments` of the call open at the end of a buffer: what of it is safe to send.

    `update(buffer, start)` takes the whole buffer and where the arguments value starts, and
    returns the new piece and whether the value is complete (then `end` is the index after it).
    An object value streams as it grows (no text after an unfinished object can be anything but
    more of it); any other value is sent when whole."""

    def __init__(self) -> None:
        self.sent = 0  # characters of the value sent
        self.end: int | None = None

    def update(self, buffer: str, start: int) -> tuple[str, bool]:
        while start < len(buffer) and buffer[start].isspace():
            start += 1
        try:
            _, end = _DECODER.raw_decode(buffer, start)
        except ValueError:
            end = None
        if end is not None:
            self.end = end
            if buffer[start] == '"' and not self.sent:  # arguments given as a JSON string: its text
                self.sent = end - start
                return json.loads(buffer[start:end]), True
            piece, self.sent = buffer[start + self.sent : end], end - start
            return piece, True
        if start < len(buffer) and buffer[start] == "{":
            piece, self.sent = buffer[start + self.sent :], len(buffer) - start
            return piece, False
        return "", False


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    delta: dict[str, Any] = {"index": index}
    if call_id is not None:
        delta["id"], delta["type"] = call_id, "function"
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    fn["arguments"] = arguments
    delta["function"] = fn
    return delta


# `{"name": "<name>", "arguments": ` at the start of a call's JSON (the name's JSON string decoded)
_NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')


@dataclass(frozen=True)
class HermesToolParser:
    """Calls as JSON between `<tool_call>` and `</tool_call>` (see the module docstring)."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls). A block that is not a call's JSON leaves the whole output as
        content, with no calls (as vLLM's parser does). A last block the output ends inside (no
        end tag: the model stopped at its end token) still counts."""
        if self.start not in text:
            return text, []
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while (i := text.find(self.start, pos)) >= 0:
            gap = text[pos:i]
            content.append(gap.strip() if calls else gap.rstrip())  # no spacing around calls
            # (text around calls: its pieces one per line)
            j = text.find(self.end, i)
            body = text[i + len(self.start) : j if j >= 0 else len(text)]
            try:
                call = _as_call(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []
            head = _NAME_HEAD.match(body)
            if head is not None:  # the arguments as the model wrote them (what a stream sends)
                start = len(body) - len(body[head.end() :].lstrip())
                value, end = _DECODER.raw_decode(body, start)
                call.arguments = value if isinstance(value, str) else body[start:end]
            calls.append(call)
            pos = len(text) if j < 0 else j + len(self.end)
        content.append(text[pos:].strip())
        rest = "\n".join(piece for piece in content if piece)
        return (rest or None), calls

    def stream(self) -> HermesToolStream:
        return HermesToolStream(self)


class HermesToolStream:
    """`HermesToolParser.extract` over streamed text (see the module docstring)."""

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self.buffer = ""  # outside a block: held-back text; inside: the block so far
        self.inside = False
        self.index = -1  # the open call's index
        self.named = False  # its name delta was sent
        self.args = _ArgumentsStream()
        self.calls = 0
        # Content loses the whitespace next to a call: trailing whitespace waits in `space` (sent
        # when more content follows, dropped when a call does), and after a call `after_call`
        # drops the leading whitespace.
        self.space = ""
        self.dropped = ""
        self.after_call = False
        self.has_content = False  # content was sent: more after a call starts a new line

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        self.buffer += text
        p = self.parser
        while True:
            if not self.inside:
                i = self.buffer.find(p.start)
                if i < 0:
                    keep = _held_tag_prefix(self.buffer, p.start)
                    out, self.buffer = (
                        self.buffer[: len(self.buffer) - keep],
                        self.buffer[len(self.buffer) - keep :],
                    )
                    self._content(out, content)
                    break
                self._content(self.buffer[:i], content)
                self.buffer = self.buffer[i + len(p.start) :]
                self.inside, self.named, self.args = True, False, _ArgumentsStream()
                self.dropped, self.space = self.space, ""  # (given back if the block is no call)
                continue
            j = self.buffer.find(p.end)
            block = self.buffer if j < 0 else self.buffer[:j]
            self._advance(block, deltas, complete=j >= 0, content=content)
            if j < 0:
                break
            self.buffer = self.buffer[j + len(p.end) :]
            self.inside, self.after_call = False, self.named
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the output: an open block is closed; held-back text is content."""
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        if self.inside:
            self._advance(self.buffer, deltas, complete=True, content=content)
        else:
            self._content(self.buffer, content)
        if not self.calls and self.space:  # an answer with no call keeps its text as it is
            content.append(self.space)
        self.buffer, self.inside, self.space = "", False, ""
        return "".join(content), deltas

    @property
    def num_calls(self) -> int:
        return self.calls

    def _content(self, text: str, out: list[str]) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
            self.space = "\n" if self.has_content else ""
        body = text.rstrip()
        if body:
            out.append(self.space + body)
            self.space = text[len(body) :]
            self.has_content = True
        else:
            self.space += text

    def _advance(self, block: str, deltas: list[dict[str, Any]], complete: bool, content: list[str]) -> None:
        """Send what `block` (the open call's text so far) adds; `complete`: its end tag came."""
        head = _NAME_HEAD.match(block)
        if head is not None and not self.named:
            self.index, self.named = self.calls, True
            self.calls += 1
            deltas.append(_call_delta(self.index, _call_id(), json.loads(head.group(1)), ""))
        if head is not None:
            piece, _ = self.args.update(block, head.end())
            if piece:
                deltas.append(_call_delta(self.index, None, None, piece))
            if complete and self.args.end is None:  # never a whole value: what is left, as it is
                rest = block[head.end() :].strip().removesuffix("}").rstrip()
                if rest[self.args.sent :]:
                    deltas.append(_call_delta(self.index, None, None, rest[self.args.sent :]))
            return
        if complete:  # keys in another order, or not a call at all
            try:
                call = _as_call(json.loads(block), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is not None:
                self.index, self.named = self.calls, True
                self.calls += 1
                deltas.append(_call_delta(self.index, call.id, call.name, call.arguments))
            else:  # not a call: the block is text, as the whole output's parse keeps it
                self.space = self.dropped
                self._content(self.parser.start + block + self.parser.end, content)


_PARSERS = {"hermes": HermesToolParser()}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> HermesToolParser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(tool_parser_names())}"
        ) from None


# ---- tool_choice "required" and named: constrained outputs ----


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema (an object of anything when the tool declares none)."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object"}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema `tool_choice: "required"` constrains the output to: an array of one call
    (or more, with `parallel`), each `{"name": <one of the tools>, "parameters": <its schema>}`."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": function_parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def extract_required(text: str) -> list[ToolCall] | None:
    """The calls of a `required` output; None when it is not a whole array of calls (cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [_as_call(item, ("parameters", "arguments")) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def extract_named(text: str, name: str) -> list[ToolCall] | None:
    """The one call of a named choice; None when the output is not a whole JSON value."""
    try:
        json.loads(text)
    except ValueError:
        return None
    return [ToolCall(name, text.strip())]


class NamedToolStream:
    """A named choice's output streamed: the first delta names the call, the text is its arguments."""

    def __init__(self, name: str):
        self.name = name
        self.started = False
        self.num_calls = 1

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas = []
        if not self.started:
            self.started = True
            deltas.append(_call_delta(0, _call_id(), self.name, ""))
            text = text.lstrip()
        if text:
            deltas.append(_call_delta(0, None, None, text))
        return "", deltas

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        return self.feed("") if not self.started else ("", [])


# `[` or `,` then `{"name": "<name>", "parameters": ` in a required choice's array
_ITEM_HEAD = re.compile(
    r'\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:'
)


class RequiredToolStream:
    """A `required` choice's array streamed, one call per item (keys in schema order, as the
    grammar writes them)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.pos = 0  # where the next item's head is looked for
        self.open: tuple[int, int] | None = None  # (call index, where its arguments start)
        self.args = _ArgumentsStream()
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        deltas: list[dict[str, Any]] = []
        while True:
            if self.open is None:
                head = _ITEM_HEAD.match(self.buffer, self.pos)
                if head is None:
                    break
                self.open = (self.num_calls, head.end())
                self.num_calls += 1
                self.args = _ArgumentsStream()
                deltas.append(_call_delta(self.open[0], _call_id(), json.loads(head.group(1)), ""))
            index, start = self.open
            piece, done = self.args.update(self.buffer, start)
            if piece:
                deltas.append(_call_delta(index, None, None, piece))
            if not done:
                break
            assert self.args.end is not None
            close = self.buffer.find("}", self.args.end)
            if close < 0:
                break
            self.pos, self.open = close + 1, None
        return "", deltas

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []
