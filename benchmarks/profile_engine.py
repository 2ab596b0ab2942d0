"""Where an E1 engine step spends its device and host time (GPU only).

    python benchmarks/profile_engine.py [--out DIR] [--requests 64] [--max-tokens 24]

Runs the random Qwen3-0.6B engine of `tilellm bench throughput` on the first `--requests` prompts
of E1 under torch.profiler, and prints the kernels by device time and the host calls by host time
(synchronisations and allocator calls show up there). Writes `profile_engine.json` (the tables)
under `--out`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tilellm import SamplingParams
from tilellm.bench import throughput as tp


def _table(prof, sort_by: str, limit: int) -> list[dict]:
    rows = []
    for ev in sorted(prof.key_averages(), key=lambda e: getattr(e, sort_by), reverse=True)[:limit]:
        rows.append(
            {
                "name": ev.key[:90],
                "count": ev.count,
                "self_device_ms": round(getattr(ev, "self_device_time_total", 0.0) / 1e3, 3),
                "self_cpu_ms": round(ev.self_cpu_time_total / 1e3, 3),
            }
        )
    return rows


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'name':90} {'count':>7} {'dev ms':>9} {'cpu ms':>9}")
    for r in rows:
        print(f"{r['name']:90} {r['count']:>7} {r['self_device_ms']:>9.2f} {r['self_cpu_ms']:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    tp.add_arguments(ap)
    args = ap.parse_args([a for a in __import__("sys").argv[1:]])
    w = tp.e1()
    with tempfile.TemporaryDirectory() as tmp:
        model, fmt = tp._model_dir(args, tmp)
        llm = tp._make_llm(args, model, fmt, max_model_len=tp._needed_len(w))
        prompts = w.prompts[: args.requests]
        params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True)
        warm = [[(t + 1) % 10000 for t in p] for p in prompts]
        llm.generate(warm, params, use_tqdm=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    by_device = _table(prof, "self_device_time_total", 30)
    by_cpu = _table(prof, "self_cpu_time_total", 30)
    title = f"kernels by device time ({args.requests} E1 prompts, {args.max_tokens} tokens, {wall:.2f} s)"
    _print(title, by_device)
    _print("host calls by host time", by_cpu)
    out = pathlib.Path(args.out) / "profile_engine.json"
    out.write_text(json.dumps({"wall_s": wall, "by_device": by_device, "by_cpu": by_cpu}, indent=1))


if __name__ == "__main__":
    main()
