"""The FastAPI application: routes, API-key check, body size limit, lifespan of the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import urllib.parse
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tilellm.server.admission import AdmissionLimits, FairFeeder
from tilellm.server.async_engine import AsyncEngine
from tilellm.server.bodies import BodyParser, ParsedBodyRoute
from tilellm.server.engine_process import EngineProcess
from tilellm.server.errors import APIError, error_body, install_error_handlers
from tilellm.server.metrics import ServerMetrics
from tilellm.server.protocol import (
    IGNORED_FIELDS_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
)
from tilellm.server.responses import ResponsesRequest, ResponsesServing
from tilellm.server.serving import OpenAIServing
from tilellm.server.tokenize import register as register_tokenizer_routes
from tilellm.server.watchdog import EngineWatchdog

logger = logging.getLogger("tilellm.server")

_GRACE_OVER = (
    "the server is shutting down and this request did not finish within the graceful shutdown period"
)


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # when set, /v1/*, /inspect and /tokenize need `Authorization: Bearer <key>`
    max_waiting: int = 1024  # sequences (prompts x n) queued but not yet running; beyond this -> 429
    max_request_bytes: int = 8 * 1024 * 1024  # bodies over this -> 413
    body_read_timeout: float = 30.0  # seconds to receive a whole request body; slower -> 408
    # Connections (`launcher.make_server`): an idle keep-alive one is closed after
    # `timeout_keep_alive` s, one that sends no whole request head within `header_timeout` s too.
    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0
    model_root: str | None = None  # shown as `root` in /v1/models
    # Admission (see `admission.py`): tokens = (prompt + max_tokens) per sequence.
    max_waiting_tokens: int = 1 << 23  # tokens queued but not yet in the engine; beyond this -> 429
    max_request_seqs: int = 256  # sequences one request may ask for; beyond this -> 400
    max_request_tokens: int = 1 << 21  # tokens one request may ask for; beyond this -> 400
    engine_seqs: int | None = None  # sequences kept inside the engine; None: 2 x its max_num_seqs
    # Seconds with requests in the engine and no word from it before it counts as stalled (/health
    # 503, those requests failed with engine_stalled); 0: never.
    engine_stall_timeout: float = 60.0
    request_timeout: float = 0.0  # seconds a request may take before it is aborted with a 504; 0: no limit
    chat_template: str | None = None  # Jinja chat template used instead of the tokenizer's
    reasoning_parser: str | None = None  # e.g. "qwen3": chat answers carry `reasoning_content`
    tool_call_parser: str | None = None  # e.g. "hermes": how the model writes its tool calls
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (shows the chat template)

    def limits(self, engine: Any) -> AdmissionLimits:
        engine_seqs = self.engine_seqs
        if engine_seqs is None:
            max_num_seqs = getattr(engine, "max_num_seqs", None) or getattr(
                getattr(engine, "config", None), "max_num_seqs", None
            )
            engine_seqs = 2 * max_num_seqs if isinstance(max_num_seqs, int) else 512
        return AdmissionLimits(
            max_waiting=self.max_waiting,
            max_waiting_tokens=self.max_waiting_tokens,
            max_request_seqs=self.max_request_seqs,
            max_request_tokens=self.max_request_tokens,
            engine_seqs=engine_seqs,
        )


class _BodyLimit:
    """ASGI middleware: 413 for request bodies over `limit` bytes (declared or actually sent),
    408 for a body not received within `timeout` seconds (a slow or stalled client).

    The body is read here in full (it is small by construction) and replayed to the app; later
    `receive()` calls go to the server, so the app still sees the client's disconnect.
    """

    def __init__(self, app: Any, limit: int, timeout: float = 30.0):
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, 413, self._message())
        chunks, size = [], 0
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                message = f"request body not received within {self.timeout:g} s"
                return await _send_error(send, 408, message, "body_timeout")
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_error(send, 413, self._message())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.limit} bytes"


_GUARDED_PATHS = ("/inspect", "/tokenize", "/detokenize", "/tokenizer_info")  # besides /v1/*


class _APIKeyCheck:
    """ASGI middleware: 401 on /v1/*, /inspect, /tokenize and /detokenize without
    `Authorization: Bearer <key>`."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in _GUARDED_PATHS):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not token:
                return await _send_error(
                    send, 401, "missing API key: send `Authorization: Bearer <key>`", "invalid_api_key"
                )
            if not secrets.compare_digest(token.strip(), self.api_key):
                return await _send_error(send, 401, "incorrect API key provided", "invalid_api_key")
        return await self.app(scope, receive, send)


async def _send_error(send: Any, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _vocab_size(engine: Any) -> int:
    cfg = getattr(engine, "model_config", None)
    for obj in (engine, cfg, getattr(cfg, "hf_config", None), getattr(cfg, "text_config", None)):
        size = getattr(obj, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return len(engine.tokenizer)


def create_app(engine: Any, config: ServerConfig) -> FastAPI:
    """An app serving `engine`: an `LLMEngine` (run by a thread of this process while the app's
    lifespan does) or an `EngineProcess` (the engine in its own process; `tilellm serve`'s default)."""
    metrics = ServerMetrics(config.served_model_name)
    # The feeder bounds what reaches the engine; the engine's own queue check never fires.
    if isinstance(engine, EngineProcess):
        engine.configure(max_waiting=1 << 62, observer=metrics)
        async_engine: AsyncEngine | EngineProcess = engine
    else:
        async_engine = AsyncEngine(engine, max_waiting=1 << 62, observer=metrics)
    feeder = FairFeeder(async_engine, config.limits(engine), request_timeout=config.request_timeout)

    def stats() -> Any:  # the engine's counts plus the sequences still queued in the server
        s = async_engine.stats
        return dataclasses.replace(s, num_waiting=s.num_waiting + feeder.pending_seqs)

    metrics.bind(stats)
    serving = OpenAIServing(
        feeder,
        engine.tokenizer,
        config.served_model_name,
        int(engine.max_model_len),
        _vocab_size(engine),
        config.chat_template,
        dict(getattr(engine, "default_sampling", None) or {}),
        config.reasoning_parser,
        config.tool_call_parser if config.enable_auto_tool_choice else None,
    )

    def on_dead() -> None:  # the launcher's server, if any, exits non-zero (see docs/serving.md)
        request_exit = getattr(app.state, "request_exit", None)
        if request_exit is not None:
            request_exit(1)

    watchdog = EngineWatchdog(async_engine, feeder, config.engine_stall_timeout, on_dead)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        watching = asyncio.ensure_future(watchdog.run())
        try:
            yield
        finally:
            watching.cancel()
            try:
                async_engine.stop()
            finally:
                app.state.body_parser.close()

    def on_grace_expired() -> None:
        """Shutdown's grace period is over: every request still open gets an OpenAI error (a
        stream its final error event and [DONE]) instead of being cut off."""
        n = feeder.fail_all(503, "shutting_down", _GRACE_OVER)
        if n:
            logger.warning("graceful shutdown period over: %d requests in flight got 503 shutting_down", n)

    app = FastAPI(title="tilellm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = ParsedBodyRoute  # large bodies are parsed off the event loop
    app.state.body_parser = BodyParser()
    app.state.on_grace_expired = on_grace_expired
    app.state.watchdog = watchdog
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.feeder = feeder
    install_error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            reason = async_engine.error or "the engine loop is not running"
            return JSONResponse(error_body(503, reason, code="engine_dead"), status_code=503)
        if watchdog.stalled:
            body = error_body(503, watchdog.stall_message(), code="engine_stalled")
            return JSONResponse(body, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from tilellm import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "tilellm",
            "root": config.model_root or config.served_model_name,
            "max_model_len": serving.max_model_len,
            "vocab_size": serving.vocab_size,
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return (await models())["data"][0]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return _name_ignored(body, await _guarded(serving.completions(body, raw)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return _name_ignored(body, await _guarded(serving.chat(body, raw)))

    responses = ResponsesServing(serving)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        return _name_ignored(body, await _guarded(responses.create(body, raw)))

    _mount_inspect(app, async_engine)
    # The last added runs first: the key is checked before any of the body is read.
    app.add_middleware(_BodyLimit, limit=config.max_request_bytes, timeout=config.body_read_timeout)
    if config.api_key:
        app.add_middleware(_APIKeyCheck, api_key=config.api_key)
    register_tokenizer_routes(app, serving, config.enable_tokenizer_info_endpoint)
    return app


def _name_ignored(body: Any, response: Any) -> Any:
    """Unknown request fields, which change nothing: a warning and a response header naming them."""
    names = ignored_fields(body)
    if names:
        more = f" (+{len(names) - 16} more)" if len(names) > 16 else ""
        logger.warning("request fields ignored (unknown to this server): %s", ", ".join(names[:16]) + more)
        # A header value is latin-1 text with no whitespace at either end: each name is
        # percent-encoded beyond printable ASCII and its own spaces ("" for an empty name).
        shown = ", ".join(urllib.parse.quote(name, safe="()+[]._-") or '""' for name in names[:16])
        response.headers[IGNORED_FIELDS_HEADER] = shown + more
    return response


async def _guarded(handler: Awaitable[Any]) -> Any:
    """Turn an unexpected exception into a logged, opaque 500 `APIError`.

    (A bare exception would reach Starlette's ServerErrorMiddleware, which answers 500 but then
    re-raises, and uvicorn drops the keep-alive connection.)
    """
    try:
        return await handler
    except APIError:
        raise
    except Exception:
        logger.exception("internal error while serving a request")
        raise APIError(500, "internal server error; see the server log", code="internal_error") from None


def _mount_inspect(app: FastAPI, async_engine: AsyncEngine | EngineProcess) -> None:
    """GET /inspect: the last engine step and the KV pool as HTML, when `tilellm.inspect` is there."""
    try:
        from tilellm.inspect import inspect_engine, render_html
    except ImportError:
        return

    # HTMLResponse is imported at module level: with postponed annotations FastAPI resolves this
    # return annotation from the module's globals when it builds the OpenAPI document.
    @app.get("/inspect", response_class=HTMLResponse)
    async def inspect_page() -> HTMLResponse:
        async def run() -> HTMLResponse:
            try:
                # The engine thread takes the snapshot between two steps; rendering happens here.
                insp = await async_engine.call(inspect_engine)
            except ValueError as exc:  # no step has run yet
                raise APIError(503, f"nothing to inspect yet: {exc}", code="nothing_to_inspect") from None
            return HTMLResponse(await asyncio.to_thread(render_html, insp))

        return await _guarded(run())


__all__ = ["APIError", "ServerConfig", "create_app"]
