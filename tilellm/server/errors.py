"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports goes through `APIError`, including FastAPI's validation errors
(422 -> 400), Starlette's 404/405 and unexpected exceptions (500, logged, never a stack trace).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tilellm.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, param=param, code="invalid_value" if param else None)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    # Messages may quote client input; a lone surrogate from JSON would make the body unencodable.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# A union member pydantic names in an error's location (`tool_choice.literal['none','auto']`,
# `messages.0.content.str`, `tool_choice.NamedToolChoice`): not a field, left out of `param`.
_UNION_TAG = re.compile(r"^(literal\[.*\]|str|int|float|bool|none|(list|dict)\[.*\]|[A-Z]\w*)$")


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and _UNION_TAG.match(p))]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON: " + str(first.get("ctx", {}).get("error", "")), None
    param = _loc_to_param(tuple(first.get("loc", ()))) or None
    if param is None:
        return f"request body: {first.get('msg', 'invalid')}", None
    # Pydantic tries every member of a union and reports each; the first names the field well enough.
    param = param.split(".", 1)[0] if param.split(".", 1)[0] in ("prompt", "stop") else param
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param}: {first.get('msg', 'invalid value')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError.invalid(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        return JSONResponse(
            error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s %s", request.method, request.url.path)
        body = error_body(500, "internal server error; see the server log", code="internal_error")
        return JSONResponse(body, status_code=500)
