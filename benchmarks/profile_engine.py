"""Where does an E1 engine step spend its time? Kernels by device time, host calls by host time.

    python benchmarks/profile_engine.py [--out DIR] [--requests 256] [--decode-steps 24]

(with tilellm installed, `pip install -e .`, or from the repository root with `PYTHONPATH=.`)

E1 reaches about 70% of its roofline (docs/benchmarks.md); this says which kernels and which host
calls the rest goes to. It builds the engine `tilellm bench throughput` builds for E1 (Qwen3-0.6B's
architecture with random weights, bf16, a 16384-token step budget, CUDA graphs for decode) through
`tilellm.LLM`, then drives its `LLMEngine` over the first `--requests` prompts of E1 under
torch.profiler, in two phases: prefill (until every request has its first token), then
`--decode-steps` decode steps with all requests running. For each phase it prints the kernels by
device time and the host calls by host time (synchronisations and allocator calls show up there).
Then the prefill phase once more (prompt ids shifted: no prefix-cache hits) under cProfile: the
Python functions by own and by cumulative time. Writes `profile_engine.json` (the tables) and
`cprofile_prefill.txt` under `--out`. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from tilellm import LLM, SamplingParams
from tilellm.bench.throughput import e1
from tilellm.testing import QWEN3_0_6B_CONFIG, make_random_model_dir


def _table(prof: profile, sort_by: str, limit: int) -> list[dict]:
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


def _profiled(fn: Callable[[], None]) -> tuple[profile, float]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall


def _shifted(prompt: list[int], shift: int) -> list[int]:
    """The same prompt with every token id moved: the same work, no prefix-cache hits."""
    return [(t + shift) % 10000 for t in prompt]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="artifacts", help="directory for the JSON and cProfile text")
    ap.add_argument("--requests", type=int, default=256, help="the first N of E1's 256 prompts")
    ap.add_argument("--decode-steps", type=int, default=24, help="decode steps profiled after prefill")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="as bench throughput")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_engine.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if not 1 <= args.requests <= 256:
        ap.error(f"--requests {args.requests}: E1 has 256 prompts; choose 1-256")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    w = e1()
    prompts = w.prompts[: args.requests]
    params = SamplingParams(temperature=0.6, max_tokens=args.decode_steps + 64, ignore_eos=True)
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            str(make_random_model_dir(tmp, QWEN3_0_6B_CONFIG)),
            dtype="bfloat16",
            load_format="dummy",
            skip_tokenizer_init=True,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max(map(len, w.prompts)) + max(w.max_tokens),
        )
        engine = llm.llm_engine
        llm.generate([_shifted(p, 1) for p in prompts[:32]], params, use_tqdm=False)  # warm-up
        started: set[str] = set()

        def prefill(prefix: str, shift: int) -> None:  # until every request has its first token
            for i, p in enumerate(prompts):
                engine.add_request(f"{prefix}{i}", _shifted(p, shift), params)
            while len(started) < len(prompts):
                started.update(o.request_id for o in engine.step())

        def decode() -> None:
            for _ in range(args.decode_steps):
                engine.step()

        def finish(prefix: str) -> None:
            for i in range(len(prompts)):
                engine.abort_request(f"{prefix}{i}")
            while engine.has_unfinished_requests():
                engine.step()
            started.clear()

        for phase, fn in (("prefill", lambda: prefill("r", 0)), ("decode", decode)):
            prof, wall = _profiled(fn)
            by_device = _table(prof, "self_device_time_total", 25)
            by_cpu = _table(prof, "self_cpu_time_total", 20)
            title = f"{phase}: {args.requests} E1 prompts, {wall * 1e3:.1f} ms"
            if phase == "decode":
                title += f" for {args.decode_steps} steps ({wall / args.decode_steps * 1e3:.2f} ms/step)"
            _print(title + " - kernels by device time", by_device)
            _print(phase + " - host calls by host time", by_cpu)
            report[phase] = {"wall_s": wall, "by_device": by_device, "by_cpu": by_cpu}
        finish("r")

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pr = cProfile.Profile()
        pr.enable()
        prefill("c", 2)
        torch.cuda.synchronize()
        pr.disable()
        wall = time.perf_counter() - t0
        finish("c")
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(pr, stream=text).sort_stats(key).print_stats(35)
        head = f"prefill under cProfile: {wall * 1e3:.1f} ms"
        print("\n" + head)
        print("\n".join(text.getvalue().splitlines()[:140]))
        (out_dir / "cprofile_prefill.txt").write_text(head + "\n" + text.getvalue())
        report["prefill_cprofile"] = {"wall_s": wall}
        llm.shutdown()
    (out_dir / "profile_engine.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
