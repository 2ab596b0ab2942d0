"""Request bodies of the OpenAI-compatible API (pydantic), as OpenAI defines them plus vLLM's extras.

Fields the engine cannot honour are accepted only at their neutral value (`best_of` equal to `n`,
`response_format` text, ...); anything else is a 400 that names the field, raised by
`check_unsupported`.
Unknown fields are ignored, as OpenAI's own server does for forward compatibility. Types are
strict, as OpenAI's are: `"5"`, `4.0` or `true` is not an integer, `"0.5"` not a number and `"yes"`
not a boolean (an integer is a valid number); the offline `SamplingParams` rejects the same.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, field_validator

from tilellm.engine.sampling_params import MAX_LOGPROBS, MAX_N
from tilellm.server.errors import APIError

# Bounds that keep a single request from asking the engine for something absurd (`n` and
# `logprobs` are the engine's own limits); the engine's SamplingParams checks the finer ranges
# (temperature >= 0, 0 < top_p <= 1, ...).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

TokenIds = list[Annotated[int, Field(ge=0)]]


class _Request(BaseModel):
    # Unknown fields are kept aside (`model_extra`), never used: the server names them in a
    # warning and a response header (`ignored_fields`), so that a dropped option is visible.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


IGNORED_FIELDS_HEADER = "X-Ignored-Fields"


def ignored_fields(req: BaseModel, prefix: str = "") -> list[str]:
    """The request's unknown fields, nested ones as `messages[0].x`, in body order."""
    out = [prefix + k for k in req.model_extra or {}]
    for name in type(req).model_fields:
        value = getattr(req, name)
        if isinstance(value, BaseModel):
            out += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list) and not (value and type(value[0]) is int):  # (token ids: no models)
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += ignored_fields(item, f"{prefix}{name}[{i}].")
    return out


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: TokenIds | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None


def _is_token_ids(value: Any) -> bool:
    """Every item a non-negative int (bools are not token ids), in C loops (`set(map(type, ...))`,
    `min`): a 1000-token prompt checked item by item in Python costs about 0.1 ms per request."""
    return not value or (set(map(type, value)) == {int} and min(value) >= 0)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_in_one_pass(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # Token ids are checked here in one pass: tried member by member, the union would first
        # collect an error for every item of a long id list as `list[str]` (seconds on the event
        # loop for a few million ids under the body limit). Anything else goes through the union.
        if isinstance(value, list) and value:
            if type(value[0]) is int and _is_token_ids(value):
                return value
            if isinstance(value[0], list) and all(
                isinstance(v, list) and v and _is_token_ids(v) for v in value
            ):
                return value
        return handler(value)

    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM extra: each choice (and each streamed chunk's choice) also carries its `token_ids`;
    # always on when the server runs without a tokenizer
    return_token_ids: bool = False
    # vLLM extra: each choice carries the prompt's logprobs (None first, then {token id: ...})
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Request):
    """A call an assistant message made (sent back in the conversation)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its thinking (vLLM's name; not re-sent)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extra field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    # None: "auto" when there are tools, else "none" (OpenAI's default)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a Jinja template for this request (else the server's)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false} (Qwen3)


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON object keys) with integer keys; 400 naming it."""
    if not bias:
        return None
    try:
        out = {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        raise APIError.invalid(
            "logit_bias keys must be token ids (integers as strings)", "logit_bias"
        ) from None
    if any(k < 0 for k in out):
        raise APIError.invalid("logit_bias keys must be token ids >= 0", "logit_bias")
    return out


def structured_outputs_params(req: _SamplingFields) -> Any:
    """The request's `StructuredOutputsParams` (from `structured_outputs` or `response_format`),
    or None; 400 naming the field when it is malformed."""
    from tilellm.engine.sampling_params import StructuredOutputsParams

    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise APIError.invalid("give response_format or structured_outputs, not both", "structured_outputs")
    try:
        if so is not None:
            return StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object,
            )
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError.invalid("response_format json_schema needs json_schema.schema", "response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    except ValueError as e:
        param = "structured_outputs" if so is not None else "response_format"
        raise APIError.invalid(str(e).replace("StructuredOutputsParams", param), param) from None


def check_unsupported(req: _SamplingFields) -> None:
    """400 for OpenAI features this engine does not implement, unless left at their neutral value."""
    if req.stream_options is not None and not req.stream:
        raise APIError.invalid("stream_options is only allowed when stream is true", "stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(s == "" for s in stops):
        raise APIError.invalid("stop strings must not be empty", "stop")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError.invalid("suffix is not supported by this server", "suffix")
        if req.best_of not in (None, req.n):
            raise APIError.invalid(
                "best_of is not supported by this server; leave it unset or equal to n", "best_of"
            )
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError.invalid("top_logprobs requires logprobs to be true", "top_logprobs")
