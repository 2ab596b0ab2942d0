"""`tilellm` command line: one subcommand per module, imported only when it runs.

Each command module defines `add_arguments(parser)` and `main(args) -> int`; its docstring's
first line is the command's help. A command raises `UsageError` for a user's mistake: `main`
prints it as one `tilellm COMMAND: error: ...` line and returns its exit code (any other exception
is a bug and keeps its traceback).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys

from tilellm.commands.common import UsageError

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tilellm.commands.generate", "Generate completions for prompts (offline, batched)."),
    "chat": ("tilellm.commands.chat", "Interactive chat with streaming output."),
    "serve": ("tilellm.commands.serve", "Run the OpenAI-compatible HTTP server."),
    "demo": ("tilellm.commands.demo", "Run the embedded model on a batch and check its accuracy."),
    "inspect": ("tilellm.commands.inspect", "Show the tiles and pages of a batch (terminal or HTML)."),
}

BENCHMARKS: dict[str, tuple[str, str]] = {
    "kernels": (
        "tilellm.bench.kernels",
        "Time attention kernels on workloads P1-P3, D1-D4, V1, C1, S1.",
    ),
    "mla": ("tilellm.bench.mla", "Time the MLA (latent-cache) decode and verification kernels, M1-M5."),
    "indexer": ("tilellm.bench.indexer", "Time DeepSeek-V3.2's indexer (scores + top-k) at 8k-128k context."),
    "sparse_mla": ("tilellm.bench.sparse_mla", "Time sparse MLA (top-2048) decode and prefill, S2 and S3."),
    "moe": ("tilellm.bench.moe", "Time the fused MoE layer on DeepSeek-V2-Lite and Qwen3-30B-A3B shapes."),
    "throughput": (
        "tilellm.bench.throughput",
        "Offline engine throughput on workloads E1-E3 (E5: E1 on an MoE --model-shape).",
    ),
    "serve": ("tilellm.bench.serve", "Drive a running server with a request rate and report latencies."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tilellm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="Benchmarks (kernels, throughput, serve).")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command in `argv` (None: this process's command line) and return its exit code."""
    if argv is None:
        # Registered first, so it runs last of the exit handlers: after the command's own output
        # and any real error, before the interpreter's teardown.
        atexit.register(_silence_teardown_stderr)
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # First pass finds the command; the command's own arguments are added before the real parse,
    # so `tilellm serve --help` shows serve's flags without importing every other command.
    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    module_name = getattr(known, "_module", None)
    if module_name is not None:
        module = importlib.import_module(module_name)
        target = _find_subparser(parser, known)
        module.add_arguments(target)
    args = parser.parse_args(argv)
    if args.version:
        from tilellm import __version__

        print(__version__)
        return 0
    if module_name is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(module.main(args) or 0)
    except UsageError as exc:
        print(f"{target.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{target.prog}: interrupted", file=sys.stderr)
        return 130


def _silence_teardown_stderr() -> None:
    """Point fd 2 at /dev/null for the interpreter's teardown.

    Triton's nanobind extension reports its objects still alive at teardown ("nanobind: leaked
    N instances/types/functions", dozens of lines) after every error message; Triton silences
    its own worker processes the same way. Everything written before this (flushed here) shows.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken (e.g. a pipe whose reader left)
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _find_subparser(parser: argparse.ArgumentParser, known: argparse.Namespace) -> argparse.ArgumentParser:
    sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub_action.choices[known.command]
    if known.command == "bench":
        bench_action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = bench_action.choices[known.bench_command]
    return p


if __name__ == "__main__":
    sys.exit(main())
