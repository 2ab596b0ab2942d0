"""Engine flags shared by `generate`, `chat`, `serve` and the benchmarks (vLLM spelling), and the
checks that turn a user's mistake into a `UsageError` (one line from `tilellm`, no traceback)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

_MODEL_HELP = "Hugging Face model directory (default: the embedded model)"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# `owner/name` with no such path here: a hub id, which tilellm does not download.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class UsageError(Exception):
    """A mistake on the command line (a flag's value, a missing file, no GPU for --device cuda).

    `tilellm` prints `tilellm COMMAND: error: MESSAGE` on stderr and exits with `exit_code`, without
    a traceback; the message names the problem and the fix, and flags rather than Python fields.
    """

    exit_code = 2


class ModelNotFound(UsageError):
    """--model names no usable model directory, or none is given and the embedded one is missing."""


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, model_positional: bool = False, defaults: dict[str, Any] | None = None
) -> None:
    """Add `--model` and the flags that configure `LLM(...)` / the engine (generated from
    `tilellm.config.EngineConfig` by `EngineArgs.add_cli_args`: each default is written once).

    `model_positional`: the model also as an optional positional argument (`tilellm serve DIR`, as
    `vllm serve`), stored as `model_positional`; `merge_model_arguments` reconciles the two.
    `defaults`: this command's own defaults for some settings (the help shows both).
    """
    from tilellm.engine.arg_utils import EngineArgs

    if model_positional:
        parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help=_MODEL_HELP)
    parser.add_argument("--model", default=None, metavar="DIR", help=_MODEL_HELP)
    EngineArgs.add_cli_args(parser.add_argument_group("engine"), defaults=defaults)


def merge_model_arguments(args: argparse.Namespace) -> str | None:
    """The model of `tilellm serve DIR` or `--model DIR`; UsageError when both name different ones."""
    positional, flag = getattr(args, "model_positional", None), args.model
    if positional is not None and flag is not None and Path(positional).resolve() != Path(flag).resolve():
        raise UsageError(
            f"two models given ({positional} and --model {flag}); give one: `MODEL` or `--model MODEL`"
        )
    return flag if flag is not None else positional


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `tilellm.LLM` from parsed flags (model resolved by the caller).

    Checks them first: a bad value or `--device cuda` without a GPU raises UsageError naming the flag.
    """
    from tilellm.engine.arg_utils import EngineArgs

    kwargs = EngineArgs.from_cli_args(args)
    check_device(args.device)
    import dataclasses

    from tilellm.config import EngineConfig

    try:
        EngineConfig(model="", **kwargs)
    except ValueError as e:
        raise flag_error(e, tuple(f.name for f in dataclasses.fields(EngineConfig))) from None
    return kwargs


def flag_error(
    exc: ValueError, fields: tuple[str, ...] = (), flags: dict[str, str] | None = None
) -> UsageError:
    """`exc`'s message with Python field names as CLI flags: `SamplingParams.top_p must ...` becomes
    `--top-p must ...`, and so does a message that starts with one of `fields` (`block_size must`)."""
    flags = flags or {}

    def flag(name: str) -> str:
        return flags.get(name, "--" + name.replace("_", "-"))

    text = re.sub(r"\bSamplingParams\.(\w+)", lambda m: flag(m.group(1)), str(exc))
    # A key of a JSON-valued flag: "speculative_config.method must" -> "--speculative-config's method must".
    text = re.sub(r"\bspeculative_config\.(\w+)", r"--speculative-config's \1", text)
    text = re.sub(r"\bspeculative_config\b", "--speculative-config", text)
    first = text.split(" ", 1)[0]
    if first in fields:
        text = flag(first) + text[len(first) :]
    return UsageError(text.replace(" or None", ""))  # a flag left out is the None


def check_device(device: str | None) -> None:
    """UsageError unless `device` is None, cpu, or a CUDA device that this machine has."""
    if device is None:
        return
    kind, _, index = str(device).partition(":")
    if kind not in ("cuda", "cpu") or (index and (kind == "cpu" or not index.isdigit())):
        raise UsageError(f"--device must be cuda, cuda:N or cpu, got {device!r}")
    if kind == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise UsageError(f"--device {device}: {why}; use --device cpu, or leave --device out")
    if index and int(index) >= count:
        raise UsageError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 ..)")


def resolve_device(device: str | None) -> str:
    """`device` checked, or, for None, "cuda" when a GPU is available and "cpu" otherwise."""
    check_device(device)
    if device is not None:
        return str(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_model_dir(
    model: str,
    *,
    weights: bool = True,
    tokenizer: bool = True,
    weights_fix: str = "",
    tokenizer_fix: str = "",
) -> Path:
    """`model` as a Path when it is a Hugging Face model directory; else ModelNotFound saying why.

    It needs config.json (a JSON object) and, where asked, *.safetensors weights and tokenizer
    files; `weights_fix` / `tokenizer_fix` name the flag that lifts that need (e.g. for `serve`).
    Only local directories are read: a hub id gets the command that downloads one.
    """
    path = Path(model).expanduser()
    if not path.exists():
        if _HUB_ID.fullmatch(model) and not model.startswith("."):
            raise ModelNotFound(
                f"--model {model}: no such directory (tilellm reads local model directories only, it "
                f"downloads nothing).\nOn a machine with internet: "
                f"`huggingface-cli download {model} --local-dir DIR`, then --model DIR"
            )
        raise ModelNotFound(f"--model {model}: no such directory; pass a Hugging Face model directory")
    if not path.is_dir():
        parent = f" (did you mean --model {path.parent}?)" if path.name == "config.json" else ""
        raise ModelNotFound(f"--model {model} is a file, not a model directory{parent}")
    config = path / "config.json"
    if not config.is_file():
        raise ModelNotFound(
            f"--model {model} is not a model directory (no config.json); pass the directory that holds "
            "config.json, the *.safetensors weights and the tokenizer"
        )
    try:
        ok = isinstance(json.loads(config.read_text(encoding="utf-8")), dict)
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise ModelNotFound(f"--model {model}: {config} is not a JSON object")
    if (
        weights
        and not any(path.glob("*.safetensors"))
        and not (path / "model.safetensors.index.json").is_file()
    ):
        raise ModelNotFound(
            f"--model {model} has no *.safetensors weights{weights_fix and '; ' + weights_fix}"
        )
    if tokenizer and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelNotFound(
            f"--model {model} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); "
            + (tokenizer_fix or "copy the model's tokenizer files into it")
        )
    return path


def check_demo_model(model: str) -> Path:
    """`check_model_dir(model)`, which must also hold the demo's task (tilellm_demo.json)."""
    path = check_model_dir(model)
    if not (path / "tilellm_demo.json").is_file():
        raise ModelNotFound(
            f"--model {model} has no tilellm_demo.json (the task the demo asks and checks); "
            "leave --model out for the embedded model"
        )
    return path


def resolve_model(model: str | None, command: str, **checks: Any) -> str:
    """`model` checked by `check_model_dir(model, **checks)`, or the embedded default model
    (announced on stderr) when it is None."""
    if model is not None:
        return str(check_model_dir(model, **checks))
    try:
        from tilellm.assets import default_model_path

        path = Path(default_model_path())
    except (ImportError, AttributeError) as e:
        raise ModelNotFound(f"no --model given and no embedded model available ({e})") from e
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"no --model given and the embedded model is missing at {path}; "
            "pass --model DIR (a Hugging Face model directory)"
        )
    print(f"tilellm {command}: no --model given, using the embedded default model at {path}", file=sys.stderr)
    return str(path)


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int = 64) -> None:
    """Flags for `SamplingParams` (vLLM names)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampled tokens")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        n=args.n,
    )


def sampling_params(args: argparse.Namespace, **overrides: Any) -> Any:
    """`SamplingParams` from the sampling flags (and `overrides`); UsageError naming the flag."""
    from tilellm.engine.sampling_params import SamplingParams

    try:
        return SamplingParams(**{**sampling_kwargs(args), **overrides})
    except ValueError as e:
        raise flag_error(e, {"seed": "--sampling-seed"}) from None
