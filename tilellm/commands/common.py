"""Engine flags shared by `generate`, `chat`, `serve` and the benchmarks (vLLM spelling)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_MODEL_HELP = "Hugging Face model directory (default: the embedded model)"


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Add the flags that configure `LLM(...)` / the engine."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None, help=_MODEL_HELP)
    else:
        parser.add_argument("--model", default=None, help=_MODEL_HELP)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size (blocks)")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share cached prefix blocks",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "reference"])
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `tilellm.LLM` from parsed flags (model resolved by the caller)."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend,
        seed=args.seed,
    )


class ModelNotFound(Exception):
    """No --model given and the embedded model is not installed."""


def resolve_model(model: str | None, command: str) -> str:
    """`model`, or the embedded default model (announced on stderr) when it is None."""
    if model is not None:
        return model
    try:
        from tilellm.assets import default_model_path

        path = Path(default_model_path())
    except (ImportError, AttributeError) as e:
        raise ModelNotFound(
            f"tilellm {command}: no --model given and no embedded model available ({e})"
        ) from e
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"tilellm {command}: no --model given and the embedded model is missing at {path}; "
            "pass --model DIR (a Hugging Face model directory)"
        )
    print(f"tilellm {command}: no --model given, using the embedded model at {path}", file=sys.stderr)
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
