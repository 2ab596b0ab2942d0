"""Where an E1 engine step spends its device and host time (GPU only).

    python benchmarks/profile_engine.py [--out DIR] [--requests 256] [--decode-steps 24]

Runs the random Qwen3-0.6B engine of `tilellm bench throughput` on the first `--requests` prompts
of E1 under torch.profiler, in two phases: prefill (until every request has its first token) and
then `--decode-steps` decode steps with all requests running. For each it prints the kernels by
device time and the host calls by host time (synchronisations and allocator calls show up there).
Writes `profile_engine.json` (the tables) under `--out`.
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled(fn) -> tuple[object, float]:
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t0
    return prof, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=24)
    tp.add_arguments(ap)
    args = ap.parse_args()
    w = tp.e1()
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, fmt = tp._model_dir(args, tmp)
        llm = tp._make_llm(args, model, fmt, max_model_len=tp._needed_len(w))
        engine = llm.llm_engine
        prompts = w.prompts[: args.requests]
        params = SamplingParams(temperature=0.6, max_tokens=args.decode_steps + 64, ignore_eos=True)
        llm.generate([[(t + 1) % 10000 for t in p] for p in prompts[:32]], params, use_tqdm=False)  # warm-up

        started: set[str] = set()

        def prefill_phase() -> None:  # until every request has its first token
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            while len(started) < len(prompts):
                started.update(o.request_id for o in engine.step())

        def decode_phase() -> None:
            for _ in range(args.decode_steps):
                engine.step()

        for phase, fn in (("prefill", prefill_phase), ("decode", decode_phase)):
            prof, wall = _profiled(fn)
            by_device = _table(prof, "self_device_time_total", 25)
            by_cpu = _table(prof, "self_cpu_time_total", 20)
            title = f"{phase}: {args.requests} E1 prompts, {wall * 1e3:.1f} ms"
            if phase == "decode":
                title += f" for {args.decode_steps} steps ({wall / args.decode_steps * 1e3:.2f} ms/step)"
            _print(title + " - kernels by device time", by_device)
            _print(phase + " - host calls by host time", by_cpu)
            report[phase] = {"wall_s": wall, "by_device": by_device, "by_cpu": by_cpu}
        for i in range(len(prompts)):
            engine.abort_request(f"r{i}")
    out = pathlib.Path(args.out) / "profile_engine.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
