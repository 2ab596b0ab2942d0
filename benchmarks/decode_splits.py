"""Decode of a small batch over short contexts by split-KV segment count, as a decode graph runs it.

    python benchmarks/decode_splits.py [--batches 1,8] [--contexts 160,256,512,1024] [--json F]

(with tilellm installed, or from the repository root with `PYTHONPATH=.`)

A small batch's decode step plans its split-KV segments (`tilellm.kernels.schedule`:
`_plan_small_batch`, at least `SMALL_BATCH_MIN_KEYS` keys a segment) for the longest context its
CUDA graph may meet, and a captured split call merges its segments in a second launch: at batch 1
on Qwen3-0.6B's shape the 28 paged calls and their 28 merges take about 8 us a layer for contexts
of 130-290 keys (docs/benchmarks.md, "One-row linear layers"). This times `decode_attention` on
Qwen3-0.6B's heads (16 query heads over 8 KV heads, head dim 128, bf16, pages of 16 keys) for
every batch size and context length given: the plan a graph step gets (planned for 4096 keys, so
short requests leave most segments empty) and each forced count of 1 to 16 segments planned for
the context itself. A decode graph step whose contexts are all shorter than MIN_CONTEXT_TO_SPLIT
replays the bucket's "short" graph where one was captured (`tilellm.worker.cuda_graphs`): its plan,
made for MIN_CONTEXT_TO_SPLIT - 1 keys, is the "short graph plan". Each variant's 28 calls, on
caches of their own, are captured in one CUDA graph and its replay timed
(`tilellm.bench.timing.graph_replay_us`); every variant's output is checked against the
one-segment call first. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from tilellm.bench.timing import graph_replay_us
from tilellm.kernels import decode_attention
from tilellm.kernels.schedule import MIN_CONTEXT_TO_SPLIT

NUM_LAYERS = 28
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
GRAPH_MAX_KEYS = 4096  # what the plan of a graph step is made for
SPLITS = (1, 2, 3, 4, 8, 16)


def _layer_inputs(batch: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(q [B, Hq, D], k_cache, v_cache [blocks, PAGE, Hkv, D], block_table [B, blocks a request])
    of one layer, the blocks shuffled."""
    per_request = -(-context // PAGE)
    blocks = batch * per_request + 4
    shape = (blocks, PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(blocks, device="cuda", generator=gen)[: batch * per_request]
    block_table = order.view(batch, per_request).to(torch.int32)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, block_table


def measure(batch: int, context: int) -> dict[str, float]:
    """us per call of each variant (the graph step's plan, then forced segment counts)."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    layers = [_layer_inputs(batch, context, gen) for _ in range(NUM_LAYERS)]
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    variants: dict[str, tuple[int | None, int]] = {
        f"graph plan ({GRAPH_MAX_KEYS} keys)": (None, GRAPH_MAX_KEYS)
    }
    if context < MIN_CONTEXT_TO_SPLIT:  # a step whose contexts are all this short replays the "short" graph
        variants[f"short graph plan ({MIN_CONTEXT_TO_SPLIT - 1} keys)"] = (None, MIN_CONTEXT_TO_SPLIT - 1)
    variants |= {f"{n} segment{'s' if n > 1 else ''}": (n, context) for n in SPLITS if n * PAGE <= context}
    reference = decode_attention(*layers[0], seq_lens, num_splits=1, max_seqlen_k=context).float()
    row = {}
    for label, (splits, max_keys) in variants.items():
        out = decode_attention(*layers[0], seq_lens, num_splits=splits, max_seqlen_k=max_keys).float()
        err = (out - reference).abs().max().item()
        if err > 2e-2:
            raise AssertionError(
                f"batch {batch}, {context} keys, {label}: max error {err:.3g} against 1 segment"
            )
        outs = [torch.empty_like(layer[0]) for layer in layers]
        calls = [
            lambda layer=layer, o=o, splits=splits, max_keys=max_keys: decode_attention(
                *layer, seq_lens, num_splits=splits, max_seqlen_k=max_keys, out=o
            )
            for layer, o in zip(layers, outs)
        ]
        row[label] = graph_replay_us(calls)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="160,256,512,1024")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_splits.py needs a CUDA GPU")
        return 1
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            row = results[f"batch {batch}, {context} keys"] = measure(batch, context)
            print(
                f"batch {batch:2d}, {context:5d} keys: " + " | ".join(f"{k} {v:.2f}" for k, v in row.items())
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "us_per_call": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
