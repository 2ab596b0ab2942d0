"""The host's grammar work per step of E1-JSON, without the model: 256 matchers of
`E1_JSON_SCHEMA` over a synthetic byte-level vocabulary of Qwen3's 151,936 tokens walk the schema
on random allowed tokens; per step, the time of `GrammarBackend.bitmasks` (xgrammar's threaded
batch fill) and of advancing the matchers (`accept_token` one by one, and xgrammar's
`batch_accept_token`), averaged over windows of 50 steps.

    python benchmarks/grammar_masks.py [--rows 256] [--steps 300]

Compare the sum with the device's decode step at 256 running requests (docs/benchmarks.md):
the mask of a step can only be filled after the step before is read back, so when the grammar
work is longer than the step, the sampler waits for it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab-size", type=int, default=151936)
    args = p.parse_args()

    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tilellm.bench.throughput import E1_JSON_SCHEMA
    from tilellm.engine.sampling_params import StructuredOutputsParams
    from tilellm.engine.structured_output import GrammarBackend
    from tilellm.testing import save_synthetic_tokenizer

    n, vocab = args.rows, args.vocab_size
    tokenizer = AutoTokenizer.from_pretrained(save_synthetic_tokenizer(tempfile.mkdtemp(), vocab))
    backend = GrammarBackend(tokenizer, vocab, [tokenizer.eos_token_id])
    so = StructuredOutputsParams(json=E1_JSON_SCHEMA)
    one_by_one = [backend.matcher(so) for _ in range(n)]
    batched = [backend.matcher(so) for _ in range(n)]  # the same walk, advanced in one call
    batch = xgr.BatchGrammarMatcher(max_threads="auto")
    rng = torch.Generator().manual_seed(0)
    shifts = torch.arange(32, dtype=torch.int32)
    fill_s, accept_s, batch_s = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        mask = backend.bitmasks(one_by_one)
        t1 = time.perf_counter()
        allowed = ((mask[:, :, None] >> shifts) & 1).bool().reshape(n, -1)[:, :vocab]
        tokens = torch.rand(n, vocab, generator=rng).masked_fill(~allowed, -1).argmax(-1).tolist()
        t2 = time.perf_counter()
        for m, token in zip(one_by_one, tokens):
            if not m.is_terminated():
                m.accept_token(token)
        t3 = time.perf_counter()
        batch.batch_accept_token(batched, tokens)
        t4 = time.perf_counter()
        fill_s.append(t1 - t0)
        accept_s.append(t3 - t2)
        batch_s.append(t4 - t3)
        if (step + 1) % 50 == 0:
            live = sum(not m.is_terminated() for m in one_by_one)

            def ms(xs: list[float]) -> float:  # the last 50 steps' mean, in ms
                return sum(xs[-50:]) / 50 * 1e3

            print(
                f"steps {step - 49:3d}-{step:3d}: fill {ms(fill_s):.2f} ms, accept {ms(accept_s):.2f} ms "
                f"(batch_accept_token {ms(batch_s):.2f} ms) per {n} rows; {live} still open",
                flush=True,
            )


if __name__ == "__main__":
    main()
