"""vLLM's tokenizer endpoints: POST /tokenize and POST /detokenize (GET /version is in `app.py`).

`/tokenize` takes one of two bodies, told apart by the `messages` key:

- text: `{"prompt": str, "add_special_tokens": true}`, encoded as /v1/completions encodes a text prompt;
- chat: `{"messages": [...], "add_generation_prompt": true}`, rendered and encoded by the very
  function /v1/chat/completions uses (`OpenAIServing._chat_prompt`), so the ids are the prompt a
  chat completion would run on (`continue_final_message` and `chat_template_kwargs` too).
  `add_special_tokens` is accepted at its neutral value only (false): the chat template writes
  the model's special tokens, and a count for a prompt other than the one served would mislead.

With `serve --enable-tokenizer-info-endpoint`, vLLM's `GET /tokenizer_info` answers the
tokenizer's class, its special tokens, `model_max_length` and the chat template (what
lm-evaluation-harness asks for before it falls back to loading the tokenizer itself); off by
default, as in vLLM, since it shows the template.

Both answer `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs`: the vocabulary
entries of the ids when `return_token_strs` is true, else null). `/detokenize` answers
`{"prompt": str}` for `{"tokens": [int]}`; an id outside [0, vocab_size) is a 400 naming `tokens`.

The checks are those of the other endpoints: the model name (404 `model_not_found`), strict
types and ignored unknown fields (`protocol.py`), a text too long to ever fit in `max_model_len`
refused before it is tokenized, the tokenizer's work off the event loop, and the API key
(`Authorization: Bearer`) checked before any of the body is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRouter
from pydantic import BaseModel, Discriminator, Field, Tag

from tilellm.server.bodies import ParsedBodyRoute
from tilellm.server.errors import APIError
from tilellm.server.protocol import ChatCompletionRequest, ChatMessage, ChatTool, TokenIds, _Request
from tilellm.server.serving import OpenAIServing, _encode

PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # given to the template, as a chat completion gives them
    return_token_strs: bool = False


def _form(body: Any) -> str:
    """The /tokenize body's kind: chat when it has `messages`, text otherwise."""
    if isinstance(body, dict):
        return "messages" if "messages" in body else "prompt"
    return "messages" if isinstance(body, TokenizeChatRequest) else "prompt"


_FORMS = ("prompt", "messages")

TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt")] | Annotated[TokenizeChatRequest, Tag("messages")],
    Discriminator(_form),
]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class _UntaggedRoute(ParsedBodyRoute):
    """Validation errors without the union's tag: pydantic locates an error of the chat body at
    `("body", "messages", "messages", 0, "role")`; the field the client sent is `messages[0].role`."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def untagged(request: Request) -> Any:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                errors = [_untag(e) for e in exc.errors()]
                raise RequestValidationError(errors, body=exc.body) from None

        return untagged


def _untag(error: Any) -> Any:
    loc = tuple(error.get("loc", ())) if isinstance(error, dict) else ()
    if len(loc) >= 2 and loc[0] == "body" and loc[1] in _FORMS:
        return {**error, "loc": (loc[0], *loc[2:])}
    return error


def _check_chat_options(req: TokenizeChatRequest) -> None:
    """400 for vLLM's chat options that the chat completions path does not implement."""
    if req.add_special_tokens:
        raise APIError.invalid(
            "add_special_tokens: true is not supported with messages (the chat template writes the "
            "model's special tokens); leave it unset or false",
            "add_special_tokens",
        )


def _tokenize(serving: OpenAIServing, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    """The response body; runs in the serving's tokenizer pool."""
    if isinstance(req, TokenizeChatRequest):
        chat = ChatCompletionRequest.model_construct(
            messages=req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = serving._chat_prompt(chat, tools)
    else:  # the checks /v1/completions makes of a text prompt, in its order
        serving._need_tokenizer("prompt", "a text prompt")
        serving._check_chars(len(req.prompt), "prompt")
        serving._check_text(req.prompt, "prompt")
        ids = _encode(serving.tokenizer, req.prompt, add_special_tokens=req.add_special_tokens)
    strs = serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}


def tokenizer_info(serving: OpenAIServing) -> dict[str, Any]:
    """GET /tokenizer_info's body: the tokenizer's class, its JSON-representable init settings,
    the special tokens, `model_max_length` and the chat template in use."""
    tok = serving.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for key, value in getattr(tok, "init_kwargs", {}).items():
        if isinstance(value, (str, int, float, bool)) or value is None:
            info[key] = value
    for key in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[key] = getattr(tok, key, None)
    info["model_max_length"] = serving.max_model_len
    info["chat_template"] = serving.chat_template or getattr(tok, "chat_template", None)
    return info


def register(app: FastAPI, serving: OpenAIServing, info_endpoint: bool = False) -> None:
    """Add /tokenize and /detokenize (and with `info_endpoint`, GET /tokenizer_info) to `app`
    (app.py's API-key check guards them as /v1/*)."""
    from tilellm.server.app import _guarded  # (app.py imports this module)

    router = APIRouter(route_class=_UntaggedRoute)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        async def run() -> JSONResponse:
            serving.check_model(body.model)
            if isinstance(body, TokenizeChatRequest):
                _check_chat_options(body)
            return JSONResponse(await serving._off_loop(_tokenize, serving, body))

        return await _guarded(run())

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        async def run() -> JSONResponse:
            serving.check_model(body.model)
            serving._need_tokenizer("tokens", "detokenizing")
            serving._check_token_ids(body.tokens, "tokens")
            text = await serving._off_loop(serving.tokenizer.decode, body.tokens)
            return JSONResponse({"prompt": text})

        return await _guarded(run())

    if info_endpoint:

        @router.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            serving._need_tokenizer("tokenizer_info", "the tokenizer's description")
            return JSONResponse(tokenizer_info(serving))

    app.include_router(router)
