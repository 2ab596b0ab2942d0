"""`EngineArgs`: the engine's settings as command-line flags, made from `EngineConfig`'s fields.

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)          # --dtype, --block-size, ... with EngineConfig's defaults
    args = parser.parse_args()
    llm = LLM(model, **EngineArgs.from_cli_args(args))

vLLM's pattern: one dataclass (`tilellm.config.EngineConfig`) holds every setting, its default
and its help; the flags are generated from it, so `LLM(...)`, the CLI, the server and the
benchmarks never restate a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from tilellm.config import EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(EngineConfig)
    hint = hints[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    return hint


def _json_flag(name: str):
    """argparse type of a JSON-valued flag: the parsed object, or an error naming the flag."""

    def parse(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None

    parse.__name__ = "JSON"
    return parse


class EngineArgs:
    """The engine's command-line flags (see the module docstring)."""

    @staticmethod
    def cli_fields(exclude: tuple[str, ...] = ()) -> list[dataclasses.Field]:
        """The settings the command line exposes, in `EngineConfig`'s order."""
        return [
            f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli") and f.name not in exclude
        ]

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        *,
        defaults: dict[str, Any] | None = None,
        exclude: tuple[str, ...] = (),
    ) -> None:
        """Add one flag per CLI setting. `defaults` overrides a default for this command only
        (`tilellm bench throughput` plans for a larger token budget), and the help says so;
        `exclude` leaves out settings the command sets itself."""
        defaults = defaults or {}
        for f in EngineArgs.cli_fields(exclude):
            default = defaults.get(f.name, f.default)
            help_text = f.metadata["help"]
            if f.name in defaults:
                help_text += f" (this command's default: {default}; the engine's: {f.default})"
            names = [_flag(f.name)] + ([f.metadata["short"]] if f.metadata.get("short") else [])
            kind = _value_type(f)
            if kind is bool:
                parser.add_argument(
                    *names, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
                continue
            if f.metadata.get("json"):
                parser.add_argument(
                    *names, type=_json_flag(f.name), default=default, help=help_text, metavar="JSON"
                )
                continue
            choices = f.metadata.get("choices")
            parser.add_argument(
                *names,
                type=kind,
                default=default,
                choices=choices,
                help=help_text,
                metavar=None if choices else f.name.upper(),
            )

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> dict[str, Any]:
        """The keyword arguments of `LLM(...)` / `LLMEngine(...)` from parsed flags (not `model`)."""
        return {f.name: getattr(args, f.name) for f in EngineArgs.cli_fields() if hasattr(args, f.name)}
