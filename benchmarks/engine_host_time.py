"""The engine's host work per decode step, without the model: microseconds a step by batch size.

    python benchmarks/engine_host_time.py [--batches 1,8,32] [--steps 40] [--repeat N] [--json F]

(with tilellm installed, or from the repository root with `PYTHONPATH=.`)

The embedded tiny model (`tilellm.assets.default_model_path`), eager, greedy, with the runner's
forward replaced by one that returns constant logits at once: what is left of a step is the host's
work around the model (scheduling, building the step's inputs, the sampler, reading back the
tokens, detokenization, stop checks, the request outputs), which bounds a small batch's step once
its device time is below it. For each batch size B: B requests of 16 prompt tokens, 5 steps to warm
up, then up to `--steps` decode steps timed; the engine's own split of the step (schedule /
prepare / postprocess) beside the total. On a CUDA machine the runner still stages the inputs and
samples on the device (the forward's graph replay is what is skipped); on a CPU machine the
sampler runs on the CPU. Runs on any machine; the figures are the host's, not the GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tilellm import LLM, SamplingParams
from tilellm.assets import default_model_path


def _constant_forward(vocab_size: int, device: torch.device):
    def forward(x, num_prompt_logprobs: int = -1):
        return torch.zeros(x.logits_indices.shape[0], vocab_size, device=device), None

    return forward


def measure(llm: LLM, batch: int, steps: int, run: int) -> dict[str, float]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{run}-{i}", list(range(5, 21)), params)
    for _ in range(5):
        engine.step()
    tm = engine.timings
    tm.reset()
    n = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests() and n < steps:
        engine.step()
        n += 1
    total = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    per = 1e6 / max(tm.num_steps, 1)
    return {
        "us_per_step": total / n * 1e6,
        "schedule_us": tm.schedule_s * per,
        "prepare_us": tm.prepare_s * per,
        "postprocess_us": tm.postprocess_s * per,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3, help="times each batch size is measured")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=str(default_model_path()), enforce_eager=True, max_num_seqs=max(batches))
    runner = llm.llm_engine.runner
    runner._forward = _constant_forward(runner.vocab_size, runner.device)
    results = {}
    for batch in batches:
        runs = [measure(llm, batch, args.steps, r) for r in range(args.repeat)]
        results[batch] = runs
        steps = [r["us_per_step"] for r in runs]
        best = min(runs, key=lambda r: r["us_per_step"])
        print(
            f"batch {batch:3d}: {min(steps):6.0f} us a step "
            f"(median {statistics.median(steps):.0f} of {len(runs)}); "
            f"best run: schedule {best['schedule_us']:.0f}, prepare {best['prepare_us']:.0f}, "
            f"postprocess {best['postprocess_us']:.0f} us"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(runner.device), "batches": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
