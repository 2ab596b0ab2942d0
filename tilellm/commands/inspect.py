"""Show the tiles and pages of a batch (terminal or HTML).

tilellm inspect --batch "1:1328,5:18,129:463" --heads 32/8 --head-dim 128
tilellm inspect --batch "48:48,48:48" --shared-prefix 32 --html batch.html
tilellm inspect --demo --html step.html     # the embedded model's engine, last step
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_BATCH = "1:1328,5:18,129:463"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n".join(__doc__.splitlines()[2:])
    g = parser.add_argument_group("a described batch")
    g.add_argument(
        "--batch",
        default=DEFAULT_BATCH,
        help=f"q_len:kv_len per request, comma-separated; n alone = a prefill of n (default {DEFAULT_BATCH})",
    )
    g.add_argument("--heads", default="32/8", help="query/KV heads, e.g. 32/8 (default) or 16")
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--num-splits", type=int, default=None, help="force split-KV segments (default: heuristic)"
    )
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--kernel", default="auto", choices=["auto", "prefill", "paged"])
    g.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens of context every request shares via the prefix cache",
    )
    g.add_argument(
        "--num-blocks", type=int, default=None, help="KV pool size in blocks (default: a bit more)"
    )
    e = parser.add_argument_group("the live engine")
    e.add_argument(
        "--demo", action="store_true", help="run a few engine steps on the embedded model; show the last"
    )
    e.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model directory for --demo (default: the embedded model)",
    )
    e.add_argument("--device", default=None, help="device for --demo (default: cuda when available)")
    e.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "reference"])
    e.add_argument("--num-kv-blocks", type=int, default=64, help="KV pool for --demo (blocks)")
    o = parser.add_argument_group("output")
    o.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page")
    o.add_argument("--quiet", action="store_true", help="no terminal rendering")
    o.add_argument("--width", type=int, default=48, help="characters per request row in the terminal sketch")


def main(args: argparse.Namespace) -> int:
    from tilellm.inspect import describe_batch, parse_heads, render_html, render_text

    try:
        if args.demo:
            from tilellm.commands.common import check_demo_model, check_device
            from tilellm.inspect.engine import demo_inspection

            if args.model is not None:
                check_demo_model(args.model)
            check_device(args.device)

            insp = demo_inspection(
                model=args.model,
                device=args.device,
                attention_backend=args.attention_backend,
                num_kv_blocks=args.num_kv_blocks,
                block_size=args.block_size,
                num_splits=args.num_splits,
            )
        else:
            hq, hkv = parse_heads(args.heads)
            insp = describe_batch(
                args.batch,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_dim=args.head_dim,
                block_size=args.block_size,
                num_splits=args.num_splits,
                dtype=args.dtype,
                kernel=args.kernel,
                shared_prefix=args.shared_prefix,
                num_blocks=args.num_blocks,
            )
    except ValueError as exc:
        print(f"tilellm inspect: error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        sys.stdout.write(render_text(insp, width=args.width))
    if args.html:
        path = Path(args.html)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_html(insp), encoding="utf-8")
        print(f"wrote {path}")
    return 0
