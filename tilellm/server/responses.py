"""POST /v1/responses: OpenAI's Responses API as vLLM serves it, on the chat pipeline.

A request's `input` (a text, or a list of messages, function calls and their outputs) and its
`instructions` become chat messages; `tools` (function tools, flat as the Responses API writes
them), `tool_choice`, `text.format` (json_schema / json_object) and the sampling fields become
the chat request's; the answer is read back as output items: a `reasoning` item (with
`--reasoning-parser`), `message` items with `output_text`, and `function_call` items (parsed by
the same tool-call parsers as chat). Streamed, the answer comes as the API's semantic events
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each with its
`sequence_number`.

Nothing is stored (`store: true` is answered with `store: false`, as vLLM does without its
store), so `previous_response_id` is refused: send the whole conversation as `input`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from tilellm.engine.sampling_params import MAX_LOGPROBS
from tilellm.server.chat_tools import ToolPlan
from tilellm.server.errors import APIError
from tilellm.server.protocol import (
    SEED_MAX,
    SEED_MIN,
    ChatCompletionRequest,
    TokenIds,
    _Request,
)
from tilellm.server.serving import OpenAIServing, _Choice, _sse_response, _updates

logger = logging.getLogger("tilellm.server")


# ---- the request ----


class InputContentPart(_Request):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class InputItem(_Request):
    """One `input` item: a message (`role` + `content`), a `function_call` or a
    `function_call_output` (`reasoning` items of an earlier answer are accepted and skipped)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    summary: list[Any] | None = None  # a reasoning item's


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None


class ReasoningOptions(_Request):
    effort: str | None = None  # given to the chat template as `reasoning_effort`, as vLLM does


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # refused unless 0 (not built)
    background: bool = False
    max_tool_calls: int | None = Field(None, ge=0)  # 0: no calls, 1: one call; more are refused
    # vLLM extras (its sampling fields on the Responses API)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _text(content: str | list[InputContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, part in enumerate(content):
        if part.type == "refusal":
            out.append(part.refusal or "")
        elif part.text is None:
            raise APIError.invalid(f"{param}[{j}]: a {part.type} part needs text", f"{param}[{j}]")
        else:
            out.append(part.text)
    return "".join(out)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of a Responses request (`instructions` first, as the system message)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        if item.type == "reasoning":
            continue
        if item.type == "message":
            if item.role is None:
                raise APIError.invalid(f"{param}: a message needs a role", f"{param}.role")
            messages.append({"role": item.role, "content": _text(item.content, f"{param}.content")})
        elif item.type == "function_call":
            if item.name is None or item.arguments is None or item.call_id is None:
                raise APIError.invalid(f"{param}: a function_call needs call_id, name and arguments", param)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:  # function_call_output
            if item.call_id is None or item.output is None:
                raise APIError.invalid(f"{param}: a function_call_output needs call_id and output", param)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    if not messages:
        raise APIError.invalid("input: give at least one message", "input")
    return messages


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request the answer is computed from (validated again as one)."""
    if req.previous_response_id is not None:
        raise APIError.invalid(
            "previous_response_id: this server stores no responses; send the whole conversation as input",
            "previous_response_id",
        )
    if req.top_logprobs:
        raise APIError.invalid(
            "top_logprobs: logprobs are not given on /v1/responses; use /v1/chat/completions", "top_logprobs"
        )
    if req.truncation == "auto":
        raise APIError.invalid(
            'truncation "auto": this server never drops input; send "disabled" or a shorter input',
            "truncation",
        )
    if req.max_tool_calls is not None and req.max_tool_calls > 1:
        raise APIError.invalid(
            "max_tool_calls: only 0 (no calls) or 1 (one call) can be enforced; leave it unset",
            "max_tool_calls",
        )
    if req.background:
        raise APIError.invalid(
            "background: responses run in the foreground only on this server", "background"
        )
    fmt = req.text.format if req.text is not None else None
    body: dict[str, Any] = {
        "messages": chat_messages(req),
        "max_tokens": req.max_output_tokens,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls and req.max_tool_calls != 1,
    }
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop", "stop_token_ids", "chat_template_kwargs"):  # fmt: skip
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs = body.get("chat_template_kwargs", {})
        body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort, **kwargs}
    if req.max_tool_calls == 0:
        body["tool_choice"] = "none"
    elif isinstance(req.tool_choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError.invalid("text.format: a json_schema format needs its schema", "text.format.schema")
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.schema_},
        }
    return ChatCompletionRequest.model_validate(body)


# ---- the answer as output items ----


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id or _new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
        "content": [{"type": "reasoning_text", "text": text}], "status": "completed",
    }  # fmt: skip


def _call_item(
    call_id: str, name: str, arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name,
        "arguments": arguments, "status": status,
    }  # fmt: skip


class ResponsesServing:
    """/v1/responses on top of the chat serving (`OpenAIServing`)."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self._warned_store = False

    def _response(
        self, req: ResponsesRequest, resp_id: str, created: int, status: str, output: list[dict[str, Any]],
        usage: dict[str, Any] | None, incomplete: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat()
        return {
            "id": resp_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.serving.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": False,
            "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": _tool_choice_out(req.tool_choice, bool(req.tools)),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
        }

    @staticmethod
    def _usage(prompt: list[int], c: _Choice | None, reasoning_tokens: int = 0) -> dict[str, Any]:
        out = len(c.token_ids) if c is not None else 0
        return {
            "input_tokens": len(prompt),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": len(prompt) + out,
        }

    async def create(self, req: ResponsesRequest, raw: Request) -> Any:
        s = self.serving
        s.check_model(req.model)
        if req.store and not self._warned_store:
            self._warned_store = True
            logger.warning("/v1/responses: store is not supported; responses are not kept (store: false)")
        chat = _chat_request(req)
        renames = {"max_tokens": "max_output_tokens", "prompt": "input", "logprobs": "top_logprobs"}
        prep = await s.prepare_chat(chat, renames, "text.format")
        plan, prompt = prep.plan, prep.prompt
        resp_id = _new_id("resp")
        queue, ticket = s._submit(resp_id, [prompt], prep.params, prep.max_tokens)
        created = int(time.time())
        if req.stream:
            events = self._stream(req, resp_id, created, prompt, queue, plan)
            return _sse_response(s._guarded_stream(events, resp_id, ticket, done=False))
        choices, _ = await s._collect(queue, 1, ticket, raw)
        c = choices[(0, 0)]
        text = c.final_text if c.final_text is not None else "".join(c.text)
        message, finish_reason = s.chat_message(text, c.finish_reason, plan)
        output: list[dict[str, Any]] = []
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        reasoning = message.get("reasoning_content")
        if reasoning:
            output.append(_reasoning_item(reasoning))
        if message["content"] or not message.get("tool_calls"):
            output.append(_message_item(message["content"] or "", status))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            output.append(_call_item(call["id"], fn["name"], fn["arguments"], "completed"))
        body = self._response(req, resp_id, created, status, output, self._usage(prompt, c), incomplete)
        return JSONResponse(body)

    async def _stream(
        self, req: ResponsesRequest, resp_id: str, created: int, prompt: list[int], queue: Any,
        plan: ToolPlan | None,
    ) -> AsyncIterator[str]:  # fmt: skip
        events = _EventWriter()
        head = self._response(req, resp_id, created, "in_progress", [], None)
        yield events("response.created", response=head)
        yield events("response.in_progress", response=head)
        c = _Choice()
        items = _OutputItems(events)
        finish = None
        try:
            async for batch in _updates(queue, 1):
                for u in batch:
                    for d in u.deltas:
                        c.token_ids.extend(d.token_ids)
                        finished = d.finish_reason is not None
                        reasoning, content, calls = self.serving.parse_delta(c, d.text, finished, plan)
                        for event in items.feed(reasoning, content, calls):
                            yield event
                        if finished:
                            finish = d.finish_reason
        except APIError as exc:  # the engine failed the request: the API's error, then response.failed
            yield events("error", code=exc.code, message=exc.message, param=exc.param)
            failed = self._response(req, resp_id, created, "failed", items.done, None)
            failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
            yield events("response.failed", response=failed)
            return
        incomplete = "max_output_tokens" if finish == "length" else None
        status = "incomplete" if incomplete else "completed"
        for event in items.close(status):
            yield event
        body = self._response(req, resp_id, created, status, items.done, self._usage(prompt, c), incomplete)
        yield events("response.incomplete" if incomplete else "response.completed", response=body)


def _tool_choice_out(choice: Any, has_tools: bool) -> Any:
    if choice is None:
        return "auto" if has_tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


class _EventWriter:
    """One server-sent event per call: `event: <type>` and its data with the sequence number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _OutputItems:
    """The streamed answer as output items, one open at a time: reasoning text, message text or
    one function call; a piece of another kind closes the open item and opens the next."""

    def __init__(self, events: _EventWriter):
        self.events = events
        self.done: list[dict[str, Any]] = []  # closed items, in order
        self.kind: str | None = None  # the open item's: "reasoning", "message" or "call"
        self.item: dict[str, Any] = {}
        self.text = ""  # the open item's text (or arguments)
        self.call_index = -1

    def feed(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> list[str]:
        """The events of one streamed piece: its reasoning, then the rest of the call already
        open (a delta can end it and go on with text), then its content, then new calls."""
        out: list[str] = []
        if reasoning:
            out += self._piece("reasoning", reasoning)
        open_call = [d for d in calls if self.kind == "call" and d["index"] == self.call_index]
        for d in open_call:
            if d["function"].get("arguments"):
                out += self._piece("call", d["function"]["arguments"])
        if content:
            out += self._piece("message", content)
        for d in calls[len(open_call) :]:
            if d["index"] != self.call_index:  # a new call: its first delta names it
                self.call_index = d["index"]
                out += self._open("call", d)
            if d["function"].get("arguments"):
                out += self._piece("call", d["function"]["arguments"])
        return out

    def close(self, status: str) -> list[str]:
        out = self._close(status)
        if not self.done:  # an empty answer is one empty message
            out += self._open("message")
            out += self._close(status)
        return out

    def _piece(self, kind: str, text: str) -> list[str]:
        out = [] if self.kind == kind else self._open(kind)
        self.text += text
        ev, ids = self.events, self._ids()
        if kind == "reasoning":
            out.append(ev("response.reasoning_text.delta", **ids, content_index=0, delta=text))
        elif kind == "message":
            out.append(ev("response.output_text.delta", **ids, content_index=0, delta=text, logprobs=[]))
        else:
            out.append(ev("response.function_call_arguments.delta", **ids, delta=text))
        return out

    def _ids(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.done)}

    def _open(self, kind: str, call: dict[str, Any] | None = None) -> list[str]:
        out = self._close("completed")
        self.kind, self.text = kind, ""
        if kind == "reasoning":
            self.item = {
                "type": "reasoning",
                "id": _new_id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
        elif kind == "message":
            self.item = {
                "type": "message",
                "id": _new_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            assert call is not None
            self.item = _call_item(call["id"], call["function"]["name"], "", "in_progress")
        ev = self.events
        out.append(ev("response.output_item.added", output_index=len(self.done), item=self.item))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(ev("response.content_part.added", **self._ids(), content_index=0, part=part))
        return out

    def _close(self, status: str) -> list[str]:
        if self.kind is None:
            return []
        ev, ids, text = self.events, self._ids(), self.text
        out = []
        if self.kind == "reasoning":
            out.append(ev("response.reasoning_text.done", **ids, content_index=0, text=text))
            item = _reasoning_item(text, self.item["id"])
        elif self.kind == "message":
            out.append(ev("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]))
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(ev("response.content_part.done", **ids, content_index=0, part=part))
            item = _message_item(text, status, self.item["id"])
        else:
            out.append(
                ev("response.function_call_arguments.done", **ids, arguments=text, name=self.item["name"])
            )
            item = _call_item(self.item["call_id"], self.item["name"], text, status, self.item["id"])
        out.append(ev("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.kind = None
        return out
