"""Engine flags shared by `generate`, `chat`, `serve` and the benchmarks (vLLM spelling)."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Add the flags that configure `LLM(...)` / the engine."""
    if model_positional:
        parser.add_argument("model", nargs="?", default=None, help="Hugging Face model directory (default: the embedded model)")
    else:
        parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size (blocks)")
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="share cached prefix blocks"
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
