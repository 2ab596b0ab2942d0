"""A chat request's `tools` and `tool_choice` -> what the template sees, how the output is
constrained, and how it is read back into `tool_calls` (see `tool_parsers` for the formats).

    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, auto_parser)
    plan.template_tools          # given to the chat template (None: the template sees no tools)
    plan.structured_outputs      # the constraint of "required" / named choices (else None)
    content, calls = plan.extract(text)   # calls None: no call was made
    stream = plan.stream()               # .feed(delta) / .flush() -> (content, tool-call deltas)

`tool_choice` as OpenAI defines it: `none` (the model answers in text; the template is given no
tools), `auto` (the model may call; needs `--enable-auto-tool-choice` and a `--tool-call-parser`,
as in vLLM), `required` (at least one call, constrained so that every call's arguments parse and
match its function's schema), or `{"type": "function", "function": {"name": ...}}` (that call,
constrained the same way). Unset, it is `auto` when the request has tools, else `none`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tilellm.engine.sampling_params import StructuredOutputsParams
from tilellm.server.errors import APIError
from tilellm.server.protocol import ChatTool, NamedToolChoice
from tilellm.server.tool_parsers import (
    HermesToolParser,
    NamedToolStream,
    RequiredToolStream,
    ToolCall,
    extract_named,
    extract_required,
    function_parameters,
    required_schema,
)


@dataclass
class ToolPlan:
    choice: str  # "auto", "required" or "named"
    template_tools: list[dict[str, Any]]
    structured_outputs: StructuredOutputsParams | None = None
    name: str | None = None  # the named choice's function
    parser: HermesToolParser | None = None  # auto's

    def extract(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """(content, calls) of a whole output; calls None when it made none."""
        if self.choice == "auto":
            assert self.parser is not None
            content, calls = self.parser.extract(text)
            return content, calls or None
        calls = extract_required(text) if self.choice == "required" else extract_named(text, self.name or "")
        if calls is None:  # cut short (finish_reason length): the text as it is
            return text, None
        return None, calls

    def stream(self) -> Any:
        if self.choice == "auto":
            assert self.parser is not None
            return self.parser.stream()
        return RequiredToolStream() if self.choice == "required" else NamedToolStream(self.name or "")


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool,
    auto_parser: HermesToolParser | None,
) -> ToolPlan | None:
    """The request's plan, or None when no tool may be called; a 400 naming the field when the
    choice cannot be honoured."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise APIError.invalid(f"tool_choice {_describe(tool_choice)} needs tools", "tool_choice")
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError.invalid(f"tools: function name {dup!r} is given twice", "tools")
    as_dicts = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    if tool_choice == "auto":
        if auto_parser is None:
            raise APIError.invalid(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                '(or send tool_choice "required", a named function, or "none")',
                "tool_choice",
            )
        return ToolPlan("auto", as_dicts, parser=auto_parser)
    if tool_choice == "required":
        schema = required_schema(as_dicts, parallel_tool_calls)
        return ToolPlan("required", as_dicts, StructuredOutputsParams(json=schema))
    assert isinstance(tool_choice, NamedToolChoice)
    name = tool_choice.function.name
    if name not in names:
        raise APIError.invalid(
            f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})",
            "tool_choice",
        )
    tool = as_dicts[names.index(name)]
    return ToolPlan("named", as_dicts, StructuredOutputsParams(json=function_parameters(tool)), name=name)


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
