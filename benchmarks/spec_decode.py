"""Speculative decoding on the embedded record-editing model (tiny-copy): output tok/s with and
without n-gram drafts at several batch sizes, acceptance, tokens per step, and bf16 identity.

    python benchmarks/spec_decode.py --json spec_decode.json        # on a GPU
    python benchmarks/spec_decode.py --kv-cache-dtype fp8             # over an FP8 KV cache

Batch B: B * ROUNDS held-out problems, at most B running at once (max_num_seqs=B), greedy, the
answer's length plus EOS as the limit. Each configuration runs once to warm up (compiles, graphs,
the prefix cache's instruction block), then once timed on other problems.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

ROUNDS = 8


def run(batch: int, spec: dict | None, problems_warm, problems, kv_cache_dtype: str = "auto") -> dict:
    from tilellm import LLM, SamplingParams
    from tilellm.assets import copy_model_path

    # (one engine alive at a time)
    kwargs = {"max_num_seqs": batch, "gpu_memory_utilization": 0.3, "kv_cache_dtype": kv_cache_dtype}
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(str(copy_model_path()), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=160)
    llm.generate([p.prompt for p in problems_warm], params, use_tqdm=False)
    engine = llm.llm_engine
    engine.timings.reset()
    s0 = engine.spec_stats.copy()
    gen0 = engine.generation_tokens_total
    t0 = time.perf_counter()
    outs = llm.generate([p.prompt for p in problems], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = engine.generation_tokens_total - gen0
    st = engine.spec_stats
    drafts = st.num_drafts - s0.num_drafts
    draft_tokens = st.num_draft_tokens - s0.num_draft_tokens
    accepted = st.num_accepted_tokens - s0.num_accepted_tokens
    texts = [o.outputs[0].text for o in outs]
    result = {
        "batch": batch,
        "speculative": spec is not None,
        "seconds": dt,
        "output_tokens": tokens,
        "output_tok_s": tokens / dt,
        "steps": engine.timings.num_steps,
        "tokens_per_step_per_seq": tokens / max(1, engine.timings.num_steps) / batch,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "accuracy": sum(p.is_correct(t) for p, t in zip(problems, texts)) / len(problems),
        "graph_replays": dict(getattr(engine.runner, "graph_replays", {})),
        "texts": texts,
    }
    llm.shutdown()
    del llm, engine, outs
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from tilellm.demo import copy_task

    meta = {"prefix": "Rewrite the record with the change.\n"}
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    rows = []
    print("batch  spec   out tok/s   steps  tok/step/seq  accept  mean len  accuracy  same text as off")
    for batch in [int(b) for b in args.batches.split(",")]:
        n = batch * ROUNDS
        problems = copy_task.problems_for_model(meta, 2 * n, seed=batch)
        warm, timed = problems[n:], problems[:n]
        off = run(batch, None, warm[: max(batch, 4)], timed, args.kv_cache_dtype)
        on = run(batch, spec, warm[: max(batch, 4)], timed, args.kv_cache_dtype)
        on["same_text_as_off"] = sum(a == b for a, b in zip(off["texts"], on["texts"])) / n
        on["speedup"] = on["output_tok_s"] / off["output_tok_s"]
        for r in (off, on):
            mode = "on " if r["speculative"] else "off"
            print(
                f"{batch:5d}  {mode}  {r['output_tok_s']:10.0f}  {r['steps']:6d}  "
                f"{r['tokens_per_step_per_seq']:12.2f}  {r['acceptance_rate']:6.1%}  "
                f"{r['mean_acceptance_length']:8.2f}  {r['accuracy']:8.1%}  "
                f"{r.get('same_text_as_off', 1.0):.1%}"
            )
            r.pop("texts")
            rows.append(r)
        print(f"       speedup x{on['speedup']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            report = {"k": args.k, "rounds": ROUNDS, "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
