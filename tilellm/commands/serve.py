"""Run the OpenAI-compatible HTTP server.

tilellm serve                      # the embedded model
tilellm serve DIR                  # or: tilellm serve --model DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import socket
import sys
from typing import Any

from tilellm.commands.common import (
    UsageError,
    add_engine_arguments,
    engine_kwargs,
    flag_error,
    merge_model_arguments,
    resolve_model,
)
from tilellm.server.reasoning import reasoning_parser_names
from tilellm.server.tool_parsers import tool_parser_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, model_positional=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TILELLM_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $TILELLM_API_KEY)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: MODEL as given)"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template (a Jinja file, or the template itself) instead of the tokenizer's",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=reasoning_parser_names(),
        help="split the model's thinking from its answer: chat responses carry it as reasoning_content",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=tool_parser_names(),
        help="how the model writes tool calls (hermes: <tool_call> JSON, as Qwen does); with "
        "--enable-auto-tool-choice, chat answers carry them as tool_calls",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let requests use tool_choice "auto" (the model decides; needs --tool-call-parser)',
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's settings and chat template), as vLLM's flag does",
    )
    _add_server_arguments(parser)
    parser.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGINT/SIGTERM before they are aborted",
    )
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--load-format",
        default="safetensors",
        choices=["safetensors", "dummy"],
        help="dummy: random weights, only config.json needed (benchmarks on a model's shapes)",
    )
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: prompts must be token ids, responses carry `token_ids` and empty "
        "text; no chat, echo or stop strings (as vLLM's flag)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process, so that HTTP streaming and the engine's Python "
        "do not share one GIL (default); --no-engine-process runs it in a thread of the server",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap the host work of step N+1 with the device work of step N (default: on CUDA)",
    )


def _server_default(name: str) -> Any:
    """A `ServerConfig` field's default: written once, there."""
    from tilellm.server.app import ServerConfig

    return next(f.default for f in dataclasses.fields(ServerConfig) if f.name == name)


# (flag, ServerConfig field, type, help): the server's limits and timeouts.
_SERVER_FLAGS = [
    ("--max-waiting", "max_waiting", int, "sequences (prompts x n) queued, not running; more: 429"),
    ("--max-waiting-tokens", "max_waiting_tokens", int, "tokens ((prompt + max_tokens) x n) queued: 429"),
    ("--max-request-seqs", "max_request_seqs", int, "sequences (prompts x n) one request may ask; more: 400"),
    ("--max-request-tokens", "max_request_tokens", int, "tokens one request may ask for; more: 400"),
    ("--max-request-bytes", "max_request_bytes", int, "larger bodies get 413"),
    ("--engine-seqs", "engine_seqs", int, "sequences kept inside the engine, the rest wait in the server "
     "(fed round-robin); default: 2 x --max-num-seqs"),
    ("--body-read-timeout", "body_read_timeout", float, "seconds to receive a request body; slower: 408"),
    ("--timeout-keep-alive", "timeout_keep_alive", float, "seconds an idle keep-alive connection stays open"),
    ("--header-timeout", "header_timeout", float, "seconds a connection may take to send a request head"),
    ("--engine-stall-timeout", "engine_stall_timeout", float, "seconds of no progress with requests in "
     "the engine before /health answers 503 and they fail with engine_stalled; 0: never"),
    ("--request-timeout", "request_timeout", float, "seconds a request may take before it is aborted "
     "with a 504; 0: no limit"),
]  # fmt: skip


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, field, kind, help_ in _SERVER_FLAGS:
        default = _server_default(field)
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, type=kind, default=default, help=help_ + shown)


def _check_server_arguments(args: argparse.Namespace) -> None:
    for flag, field, _, _ in _SERVER_FLAGS:
        value = getattr(args, field)
        if value is None:
            continue
        may_be_zero = field in ("engine_stall_timeout", "request_timeout")
        if value < 0 or (value == 0 and not may_be_zero):
            raise UsageError(f"{flag} must be {'>= 0' if may_be_zero else 'positive'}, got {value:g}")


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (vLLM's rule:
    anything with Jinja markup is a template, anything else must be a readable file)."""
    if value is None:
        return None
    if any(mark in value for mark in ("{{", "{%")):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UsageError(
            f"--chat-template {value}: not a template and not a readable file ({e.strerror})"
        ) from None


def _resolve_model(model: str | None, **checks) -> tuple[str, str]:
    """(model directory, default served name); the embedded model when none is given."""
    path = resolve_model(model, "serve", **checks)
    return path, model if model is not None else os.path.basename(os.path.normpath(path))


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine is built: a busy port fails at once."""
    from tilellm.server.launcher import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as exc:
        taken = exc.errno == errno.EADDRINUSE
        why = "is already in use (another server?); pass --port N" if taken else f"cannot be bound: {exc}"
        raise UsageError(f"{host}:{port} {why}") from None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.uvicorn_log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    _check_server_arguments(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError(
            "--enable-auto-tool-choice needs --tool-call-parser (e.g. --tool-call-parser hermes)"
        )
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    kwargs = dict(
        engine_kwargs(args), load_format=args.load_format, skip_tokenizer_init=args.skip_tokenizer_init
    )
    model, default_name = _resolve_model(
        merge_model_arguments(args),
        weights=args.load_format != "dummy",
        weights_fix="or pass --load-format dummy for random weights",
        tokenizer=not args.skip_tokenizer_init,
        tokenizer_fix="add one or pass --skip-tokenizer-init",
    )
    sock = _listen(args.host, args.port)

    from tilellm.server.app import ServerConfig, create_app
    from tilellm.server.launcher import make_server

    if args.engine_process:
        from tilellm.server.engine_process import EngineProcess

        try:
            engine = EngineProcess(model, kwargs, async_scheduling=args.async_scheduling)
        except RuntimeError as exc:
            print(f"tilellm serve: {exc}", file=sys.stderr)
            return 1
    else:
        from tilellm.engine.llm_engine import LLMEngine

        try:
            engine = LLMEngine(model, **kwargs)
        except ValueError as exc:  # the engine's documented error for a model it cannot run
            raise flag_error(exc) from None
        # As `LLM` does on CUDA: outputs lag one step, nothing else changes (see LLMEngine).
        is_cuda = bool(getattr(engine.runner, "is_cuda", False))
        engine.async_scheduling = is_cuda if args.async_scheduling is None else args.async_scheduling
    config = ServerConfig(
        served_model_name=args.served_model_name or default_name,
        api_key=args.api_key or None,
        model_root=model,
        chat_template=_chat_template(args.chat_template),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        **{field: getattr(args, field) for _, field, _, _ in _SERVER_FLAGS},
    )
    app = create_app(engine, config)
    server = make_server(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        graceful_timeout=args.graceful_shutdown_timeout,
        timeout_keep_alive=config.timeout_keep_alive,
        header_timeout=config.header_timeout,
    )
    server.run(sockets=[sock])
    # Non-zero when the engine died: a supervisor restarts the server (docs/serving.md).
    return server.exit_code if server.started else 1
