"""Where an E1 engine step spends its device and host time (GPU only).

    python benchmarks/profile_engine.py [--out DIR] [--requests 256] [--decode-steps 24]

Runs the random Qwen3-0.6B engine of `tilellm bench throughput` on the first `--requests` prompts
of E1 under torch.profiler, in two phases: prefill (until every request has its first token) and
then `--decode-steps` decode steps with all requests running. For each it prints the kernels by
device time and the host calls by host time (synchronisations and allocator calls show up there).
Then the prefill phase once more (prompt ids shifted: no prefix-cache hits) under cProfile
instead: the Python functions by own and cumulative host time, and the runner's per-phase host
times of its eager steps (`host_times`), which show whether a mixed step's launch is bound by
the host. Writes `profile_engine.json` (the tables) and `cprofile_prefill.txt` under `--out`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
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
        while engine.has_unfinished_requests():
            engine.step()

        runner = engine.runner if hasattr(engine, "runner") else None
        host_before = dict(getattr(runner, "host_times", {}) or {})
        started.clear()

        def prefill_again() -> None:
            for i, p in enumerate(prompts):
                engine.add_request(f"c{i}", [(t + 2) % 10000 for t in p], params)
            while len(started) < len(prompts):
                started.update(o.request_id for o in engine.step())

        _sync()
        t0 = time.perf_counter()
        pr = cProfile.Profile()
        pr.enable()
        prefill_again()
        _sync()
        pr.disable()
        wall = time.perf_counter() - t0
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(pr, stream=text).sort_stats(key).print_stats(35)
        host_after = dict(getattr(runner, "host_times", {}) or {})
        delta = {k: host_after.get(k, 0.0) - host_before.get(k, 0.0) for k in host_after}
        steps = delta.get("eager.steps", 0.0)
        per_step = {
            k: round(v / steps * 1e3, 3) for k, v in delta.items() if k.startswith("eager.") and steps
        }
        head = f"prefill under cProfile: {wall * 1e3:.1f} ms; eager steps {steps:.0f}; "
        head += f"host ms per eager step {per_step}"
        print("\n" + head)
        print("\n".join(text.getvalue().splitlines()[:140]))
        (pathlib.Path(args.out) / "cprofile_prefill.txt").write_text(head + "\n" + text.getvalue())
        report["prefill_cprofile"] = {"wall_s": wall, "eager_host_ms_per_step": per_step}
        for i in range(len(prompts)):
            engine.abort_request(f"c{i}")
    out = pathlib.Path(args.out) / "profile_engine.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
