"""Large request bodies parsed and validated off the event loop, in a worker process.

FastAPI parses a JSON body (`json.loads`) and validates it (pydantic) on the event loop. Both
hold the GIL in C the whole time, so a thread cannot help: a body of a few million token ids
under the 8 MiB limit costs about half a second of one core (more on a loaded machine), during
which /health, every stream and every other request wait. Bodies over `inline_max_bytes` go to
a worker process instead; the loop only waits for its answer:

- the validated request model (pickled back). It is handed to FastAPI as the request's parsed
  JSON, and FastAPI takes an instance of the body's model as it is (pydantic does not validate
  an instance again), so the route and its OpenAPI schema are FastAPI's own;
- or the validation errors, raised as the `RequestValidationError` FastAPI would raise, so the
  client gets the same 400;
- or "not here" (a body FastAPI itself refuses before validation, such as one that is not
  UTF-8, or a worker that died): FastAPI's own path then runs on the loop, as for a small body.

The worker imports the server package (no torch); it starts with the first large body. After
MAX_FAILURES answers in a row that did not come back, bodies are parsed on the loop again.
"""

from __future__ import annotations

import asyncio
import email.message
import json
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from typing import Annotated, Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError

logger = logging.getLogger("tilellm.server")

# Below this a body is parsed inline: about 10 ms for 256 KiB of token ids on one core, less
# than the round trip to the worker costs a small body.
INLINE_MAX_BYTES = 256 * 1024
MAX_FAILURES = 3  # a worker that cannot start (or keeps dying) is not started again


class BodyParser:
    """Parses bodies over `inline_max_bytes` in one worker process (bodies that large are rare,
    and one worker keeps a flood of them to one core)."""

    def __init__(self, inline_max_bytes: int = INLINE_MAX_BYTES):
        self.inline_max_bytes = inline_max_bytes
        self.offloaded = 0  # bodies the worker answered (validated or refused)
        self.failures = 0  # answers in a row that did not come back
        self.closed = False
        self._pool: ProcessPoolExecutor | None = None

    def wants(self, body: bytes) -> bool:
        return len(body) > self.inline_max_bytes and not self.closed and self.failures < MAX_FAILURES

    async def parse(self, key: str, annotation: Any, body: bytes) -> Any:
        """The body validated as `annotation` (cached per `key`, the route's path), or None where
        FastAPI's own path should run; RequestValidationError as FastAPI raises it."""
        if self._pool is None:
            # spawn, not fork: the server has threads (the engine's, the tokenizer pool's).
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool = self._pool
        try:
            kind, value = await asyncio.wrap_future(pool.submit(parse_body, key, annotation, body))
        except BrokenExecutor:  # the worker died (killed, out of memory): a new one next time
            self._failed(pool, "the body-parsing worker died")
            return None
        except Exception:  # noqa: BLE001 (a result that does not pickle: FastAPI's path answers it)
            logger.exception("the body-parsing worker failed")
            self._failed(None, "the body-parsing worker failed")
            return None
        self.failures = 0
        if kind == "invalid":
            self.offloaded += 1
            raise RequestValidationError(value)
        if kind == "valid":
            self.offloaded += 1
            return value
        return None

    def _failed(self, broken: ProcessPoolExecutor | None, what: str) -> None:
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            what += f" {self.failures} times in a row; large bodies are parsed on the event loop from now on"
        logger.warning("%s; parsing this body on the event loop", what)
        # Only the pool that broke: another request may have started a new one meanwhile.
        if broken is not None and self._pool is broken:
            self._pool = None
            broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the worker; later bodies are parsed on the event loop."""
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_ADAPTERS: dict[str, TypeAdapter] = {}  # in the worker, per route


def parse_body(key: str, annotation: Any, body: bytes) -> tuple[str, Any]:
    """In the worker: ("valid", model), ("invalid", FastAPI's error list) or ("inline", None)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:  # FastAPI's own error for it (`fastapi.routing`)
        loc = ("body", e.pos)
        return "invalid", [
            {
                "type": "json_invalid",
                "loc": loc,
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": e.msg},
            }
        ]
    except Exception:  # noqa: BLE001 (not UTF-8, nested too deeply: FastAPI's path answers it)
        return "inline", None
    adapter = _ADAPTERS.get(key)
    if adapter is None:
        adapter = _ADAPTERS[key] = TypeAdapter(annotation)
    try:
        return "valid", adapter.validate_python(obj, from_attributes=True)  # as FastAPI validates
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        return "invalid", [_picklable({**err, "loc": ("body", *err["loc"])}) for err in errors]


def _picklable(error: dict[str, Any]) -> dict[str, Any]:
    """An error's `ctx` may hold the exception a validator raised; its text is what is shown."""
    ctx = error.get("ctx")
    if ctx:
        error["ctx"] = {k: v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in ctx.items()}
    return error


def _is_json(request: Request, strict_content_type: bool) -> bool:
    """Whether FastAPI would parse this body as JSON: application/json or application/*+json,
    or no content type unless the route is strict about it (its rule in `fastapi.routing`)."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return not strict_content_type
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class ParsedBodyRoute(APIRoute):
    """An APIRoute whose large JSON bodies are parsed by `request.app.state.body_parser`.

    Starlette keeps a request's parsed JSON in `request._json`, and FastAPI's handler reads it
    through `request.json()`: setting it first is how the worker's model reaches the route.
    """

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        body_field = self.body_field
        # (A route of several body parameters validates a generated model: left to FastAPI.)
        if body_field is None or getattr(self, "_embed_body_fields", False):
            return handler
        # FastAPI's `strict_content_type` (in FastAPI versions without it, no content type is JSON).
        strict = getattr(self, "strict_content_type", False)
        strict = bool(getattr(strict, "value", strict))
        # What FastAPI validates: the annotation with the metadata it split off (a union's
        # Discriminator, constraints).
        info = body_field.field_info
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        key = f"{','.join(sorted(self.methods or ()))} {self.path}"

        async def parsed_off_loop(request: Request) -> Any:
            parser: BodyParser | None = getattr(request.app.state, "body_parser", None)
            # The size first: most bodies are small, and the content type costs a header parse.
            if (
                parser is not None
                and parser.wants(body := await request.body())
                and _is_json(request, strict)
            ):
                model = await parser.parse(key, annotation, body)
                if model is not None:
                    request._json = model
            return await handler(request)

        return parsed_off_loop
