"""Run the embedded model on a batch and check its accuracy.

Offline, on the GPU when there is one, else the CPU: requests sharing an instruction prefix
arrive a few per step; each step prints running / waiting requests, tokens computed, prefix-cache
hits, KV blocks in use and preemptions; then the answers, their accuracy (checked by program)
and throughput.
Exits 1 when the accuracy is below the threshold recorded with the model (tilellm_demo.json).

    tilellm demo
    tilellm demo --num-kv-blocks 12          # a small pool: watch the scheduler preempt
    tilellm demo --device cuda --attention-backend triton --num-requests 256
    tilellm demo --speculative               # n-gram speculative decoding on the record-editing model
    tilellm demo --kv-cache-dtype fp8        # the KV cache in FP8 (e4m3): the accuracy gate still holds
"""

from __future__ import annotations

import argparse
import os
import sys

from tilellm.commands.common import UsageError, check_demo_model, resolve_device
from tilellm.config import KV_CACHE_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(__doc__.splitlines()[2:])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--arrivals-per-step", type=int, default=8, help="requests added before each step")
    parser.add_argument(
        "--model", default=None, metavar="DIR", help="model directory (default: the embedded model)"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "reference"])
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV pool size (default 4 per running request); small values preempt",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache values: auto (the model's dtype) or fp8 (e4m3, scales measured on the first prompt)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=2024, help="which held-out problems are asked")
    parser.add_argument("--quiet", action="store_true", help="print only the verdict line")
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="n-gram speculative decoding (prompt lookup), with acceptance in every step line; the "
        "default model is then the embedded record-editing one, whose answers copy the prompt",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        metavar="K",
        help="draft tokens per step (--speculative)",
    )


def main(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.arrivals_per_step < 1:
        raise UsageError("--num-requests and --arrivals-per-step must be >= 1")
    if args.model is not None:
        check_demo_model(args.model)
    engine_kwargs: dict = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.speculative:
        if args.num_speculative_tokens < 1:
            raise UsageError("--num-speculative-tokens must be >= 1")
        if args.model is None:
            from tilellm.assets import copy_model_path

            args.model = str(copy_model_path())
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
        engine_kwargs["speculative_config"] = {**spec, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    device = resolve_device(args.device)
    if args.attention_backend == "triton" and device == "cpu":
        # The Triton kernels run on the CPU only under the interpreter, set before triton loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tilellm.demo import run_demo

    try:
        result = run_demo(
            model=args.model,
            num_requests=args.num_requests,
            arrivals_per_step=args.arrivals_per_step,
            device=device,
            attention_backend=args.attention_backend,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            seed=args.seed,
            out=None if args.quiet else sys.stdout,
            engine_kwargs=engine_kwargs,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    if args.quiet:
        verdict = "PASS" if result.passed else "FAIL"
        print(
            f"tilellm demo: accuracy {result.num_correct}/{len(result.problems)} = {result.accuracy:.1%} "
            f"(threshold {result.threshold:.0%}) {verdict}; {result.output_tokens / result.seconds:.0f} "
            f"output tok/s, {len(result.steps)} steps, {result.preemptions} preemptions"
        )
    return 0 if result.passed else 1
