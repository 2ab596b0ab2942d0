"""Small-batch decode: milliseconds per step at batch 1 and 8, with the step's host and device time.

    python benchmarks/small_batch_decode.py [--batches 1,8] [--steps 256] [--cprofile N] [--ab NAME=VALUE]
        [--repeat N] [--quantization fp8] [--json F]

(with tilellm installed, or from the repository root with `PYTHONPATH=.`)

Qwen3-0.6B's architecture with random weights (`load_format="dummy"`), bf16, CUDA graphs for decode,
128-token prompts (`random.Random(7)`, tokens `randint(0, 10000)`), greedy, ignoring EOS. For each
batch size B the B requests are added, prefilled, decoded 32 steps to warm up, then `--steps` decode
steps are timed (wall clock over the `LLMEngine.step()` calls). Reported per step: the wall time, the
engine's host work (schedule, input preparation, postprocess) and the runner's host phases (staging,
inputs, forward launch, sampler launch), and the device span of the step from CUDA events (a
separate pass of the same length: events cost a little). The weights' floor is their bytes at the
copy rate (1.5 GB of bf16 at about 4 TB/s: 0.3-0.4 ms). `--cprofile N` also prints the N Python
functions that take the most host time at batch 1, `--kernels N` the N kernels of most device time
per step (torch.profiler over 32 steps), and the device's idle time between a step's kernels (from
the profile's kernel start and end times; `tilellm.bench.breakdown.kernel_gaps`). Needs a CUDA
GPU. `TILELLM_PDL=1 python benchmarks/small_batch_decode.py` runs the same with programmatic
dependent launch (`tilellm/kernels/pdl.py`); compare the two on one machine, one after the other.
`--ab TILELLM_GEMV=0 --repeat 2` does that in one command: an engine without the variable (the
default: `gemv.py`'s kernels for one-row steps), then one with it (cuBLAS), alternated twice,
each in a process of its own; `--ab TILELLM_GEMV=1` compares the default with those kernels at
every batch of up to 8.
`--quantization fp8` runs the same model with its linear layers quantized to FP8 at load
(block-scaled W8A8, 128 x 128).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time

import torch

from tilellm import LLM, SamplingParams
from tilellm.bench.breakdown import KernelGaps, kernel_gaps, kernel_spans_from_trace
from tilellm.testing import QWEN3_0_6B_CONFIG, make_random_model_dir

PROMPT_LEN = 128


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randint(0, 10000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _decode_steps(engine, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def measure(llm: LLM, batch: int, steps: int, cprofile: int = 0, kernels: int = 0) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 96, ignore_eos=True)
    for i, p in enumerate(_prompts(batch)):
        engine.add_request(f"b{batch}-{i}", p, params)
    _decode_steps(engine, 32)  # the prompts (one step) and a warm-up
    timings, runner = engine.timings, engine.runner
    timings.reset()
    runner.host_times.clear()
    per_step = _decode_steps(engine, steps)
    host = {
        "schedule_ms": timings.schedule_s / timings.num_steps * 1e3,
        "prepare_ms": timings.prepare_s / timings.num_steps * 1e3,
        "postprocess_ms": timings.postprocess_s / timings.num_steps * 1e3,
    }
    n = runner.host_times.get("graph.steps", 0.0)
    for phase in ("stage", "inputs", "forward", "sample"):
        host[f"runner_{phase}_ms"] = runner.host_times.get(f"graph.{phase}", 0.0) / max(n, 1) * 1e3
    runner.time_device = True
    timings.reset()
    _decode_steps(engine, steps)
    device_ms = timings.device_s / max(timings.num_steps, 1) * 1e3
    runner.time_device = False
    report = {
        "batch": batch,
        "ms_per_step": per_step * 1e3,
        "tok_per_s": batch / per_step,
        "device_ms_per_step": device_ms,
        "graph_steps": int(n),
        **host,
    }
    if kernels:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _decode_steps(engine, 32)
        rows = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
        report["kernels_per_step"] = [
            {"name": e.key[:80], "calls": e.count / 32, "us": e.self_device_time_total / 32}
            for e in rows[:kernels]
        ]
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            gaps = kernel_gaps(kernel_spans_from_trace(f"{tmp}/trace.json"), steps=32)
        report["kernel_gaps"] = dataclasses.asdict(gaps)
    if cprofile:
        pr = cProfile.Profile()
        pr.enable()
        _decode_steps(engine, steps)
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(cprofile)
        report["cprofile"] = text.getvalue()
    for req_id in list(engine.requests):
        engine.abort_request(req_id)
    while engine.has_unfinished_requests():
        engine.step()
    return report


def _report(label: str, r: dict) -> None:
    print(
        f"{label}batch {r['batch']:3d}: {r['ms_per_step']:.3f} ms/step ({r['tok_per_s']:.0f} tok/s), device "
        f"{r['device_ms_per_step']:.3f} ms; host: schedule {r['schedule_ms']:.3f} prepare "
        f"{r['prepare_ms']:.3f} postprocess {r['postprocess_ms']:.3f}; runner stage "
        f"{r['runner_stage_ms']:.3f} inputs {r['runner_inputs_ms']:.3f} forward "
        f"{r['runner_forward_ms']:.3f} sample {r['runner_sample_ms']:.3f} ms"
    )
    if "kernel_gaps" in r:
        print(f"  {KernelGaps(**r['kernel_gaps']).format()}")
    for k in r.get("kernels_per_step", []):
        print(f"  {k['us']:8.1f} us/step {k['calls']:6.1f} calls  {k['name']}")
    if "cprofile" in r:
        print(r["cprofile"])


def run_engine(batches: list[int], args: argparse.Namespace, label: str = "") -> list[dict]:
    """One engine (Qwen3-0.6B's shape, random weights) measured at each batch size, printed."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            str(make_random_model_dir(tmp, QWEN3_0_6B_CONFIG)),
            dtype="bfloat16",
            load_format="dummy",
            skip_tokenizer_init=True,
            max_num_seqs=max(batches),
            max_model_len=PROMPT_LEN + 4 * args.steps + 256,
            quantization=args.quantization,
        )
        for b in batches:
            r = measure(llm, b, args.steps, args.cprofile if b == batches[0] else 0, args.kernels)
            r["batch"] = b
            if label:
                r["setting"] = label.strip()
            results.append(r)
            _report(label, r)
        llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return results


def _run_child(args: argparse.Namespace, name: str, setting: str | None) -> list[dict]:
    """One engine in a process of its own, with the variable `name` unset or set to `setting`:
    each engine then starts on a device no earlier engine holds memory of (its KV cache is sized
    from the memory free at start), and the settings do not share compiled kernels or caches."""
    env = dict(os.environ)
    env.pop(name, None)
    if setting is not None:
        env[name] = setting
    label = f"[{name}={setting}]" if setting is not None else f"[{name} unset]"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        cmd = [sys.executable, __file__, "--batches", args.batches, "--steps", str(args.steps)]
        cmd += [
            "--cprofile",
            str(args.cprofile),
            "--kernels",
            str(args.kernels),
            "--json",
            out,
            "--label",
            label,
        ]
        cmd += ["--quantization", args.quantization] if args.quantization else []
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=256, help="decode steps timed per batch size")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="the top N functions at batch 1")
    ap.add_argument("--kernels", type=int, default=0, metavar="N", help="the N kernels of most device time")
    ap.add_argument(
        "--ab",
        metavar="NAME=VALUE",
        help="time an engine without, then with, this environment variable (e.g. TILELLM_GEMV=0)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="with --ab: alternate the two this many times")
    ap.add_argument(
        "--quantization", default=None, help="`fp8`: the weights quantized to FP8 at load (block-scaled W8A8)"
    )
    ap.add_argument("--json", default=None, help="write the results to this file")
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)  # (--ab's child processes)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("small_batch_decode.py needs a CUDA GPU", file=sys.stderr)
        return 1
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    if args.ab is None:
        results = run_engine(batches, args, f"{args.label} " if args.label else "")
    else:
        name, sep, value = args.ab.partition("=")
        if not sep or not name:
            ap.error(f"--ab takes NAME=VALUE, got {args.ab!r}")
        for _ in range(args.repeat):
            for setting in (None, value):
                results += _run_child(args, name, setting)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
