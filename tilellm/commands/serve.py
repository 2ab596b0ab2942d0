"""Run the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tilellm.commands.common import add_engine_arguments, engine_kwargs


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
        "--max-waiting", type=int, default=1024, help="requests queued beyond the running batch; more get 429"
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=8 * 1024 * 1024, help="larger bodies get 413"
    )
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


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _resolve_model(model: str | None) -> tuple[str, str]:
    """(model directory, default served name); the embedded model when none is given."""
    if model is not None:
        return model, model
    from tilellm.assets import default_model_path

    path = str(default_model_path())
    print(f"tilellm serve: no MODEL given, serving the embedded default model at {path}", file=sys.stderr)
    return path, os.path.basename(os.path.normpath(path))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.uvicorn_log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.max_waiting < 1 or args.max_request_bytes < 1:
        print("tilellm serve: --max-waiting and --max-request-bytes must be positive", file=sys.stderr)
        return 2
    model, default_name = _resolve_model(args.model)
    if not os.path.isfile(os.path.join(model, "config.json")):
        print(f"tilellm serve: {model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if not args.skip_tokenizer_init and not any(
        os.path.isfile(os.path.join(model, f)) for f in _TOKENIZER_FILES
    ):
        print(
            f"tilellm serve: {model} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); "
            "add one or pass --skip-tokenizer-init",
            file=sys.stderr,
        )
        return 2

    from tilellm.server.app import ServerConfig, create_app
    from tilellm.server.launcher import make_server

    kwargs = dict(
        engine_kwargs(args), load_format=args.load_format, skip_tokenizer_init=args.skip_tokenizer_init
    )
    if args.engine_process:
        from tilellm.server.engine_process import EngineProcess

        try:
            engine = EngineProcess(model, kwargs, async_scheduling=args.async_scheduling)
        except RuntimeError as exc:
            print(f"tilellm serve: {exc}", file=sys.stderr)
            return 1
    else:
        from tilellm.engine.llm_engine import LLMEngine

        engine = LLMEngine(model, **kwargs)
        # As `LLM` does on CUDA: outputs lag one step, nothing else changes (see LLMEngine).
        is_cuda = bool(getattr(engine.runner, "is_cuda", False))
        engine.async_scheduling = is_cuda if args.async_scheduling is None else args.async_scheduling
    config = ServerConfig(
        served_model_name=args.served_model_name or default_name,
        api_key=args.api_key or None,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        model_root=model,
    )
    app = create_app(engine, config)
    server = make_server(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        graceful_timeout=args.graceful_shutdown_timeout,
    )
    server.run()
    return 0 if server.started else 1
