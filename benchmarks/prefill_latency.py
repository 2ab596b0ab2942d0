"""Prefill latency: the time to a request's first token when the GPU is otherwise idle, with
prefill and mixed steps in piecewise CUDA graphs and without them.

    python benchmarks/prefill_latency.py [--prompt-lens 16,128,512,2048,4000,8192] [--repeat 7] [--json F]

(with tilellm installed, or from the repository root with `PYTHONPATH=.`)

Qwen3-0.6B's architecture with random weights (`load_format="dummy"`), bf16, a 16384-token step
budget. For each `cudagraph_mode` (full_and_piecewise, full_decode_only) one engine is built;
for each prompt length L it times `LLM.generate` of one L-token prompt with `max_tokens=1`
(random tokens, a new prompt each time: no prefix-cache hits), best and median of `--repeat`,
after one untimed call. A second case, "beside decodes", times one prompt's prefill step while 8
requests decode (a mixed step: the decode and paged kernels between the pieces): the wall time of
the `LLMEngine.step()` that carries the prompt. Also printed: the runner's host time to launch
the forward of those steps (`launch_us_*`), the part that graphs cut. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time

import torch

from tilellm import LLM, SamplingParams
from tilellm.testing import QWEN3_0_6B_CONFIG, make_random_model_dir

MODES = ("full_and_piecewise", "full_decode_only")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, 100000) for _ in range(n)]


def _forward_launch_us(runner) -> dict[str, float]:
    times = runner.host_times
    return {
        path: round(times[f"{path}.forward"] / times[f"{path}.steps"] * 1e6, 1)
        for path in ("piecewise", "eager")
        if times.get(f"{path}.steps")
    }


def _first_token_s(llm: LLM, rng: random.Random, n: int, repeat: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([_prompt(rng, n)], params, use_tqdm=False)  # untimed: this length's first call
    times = []
    for _ in range(repeat):
        prompt = _prompt(rng, n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return times


def _step_beside_decodes_s(llm: LLM, rng: random.Random, n: int, repeat: int) -> list[float]:
    engine = llm.llm_engine
    times = []
    for r in range(repeat + 1):
        for i in range(8):
            engine.add_request(
                f"d{n}-{r}-{i}", _prompt(rng, 64), SamplingParams(max_tokens=64, ignore_eos=True)
            )
        for _ in range(4):  # the 8 prompts' prefill, then decoding
            engine.step()
        engine.add_request(f"p{n}-{r}", _prompt(rng, n), SamplingParams(max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()  # schedules the prompt beside the 8 decodes
        engine.step()  # with asynchronous scheduling the step's tokens arrive with the next
        torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-lens", default="16,128,512,2048,4000,8192")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    lens = [int(x) for x in args.prompt_lens.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_random_model_dir(tmp, QWEN3_0_6B_CONFIG))
        for mode in MODES:
            t0 = time.perf_counter()
            llm = LLM(
                model, load_format="dummy", dtype="bfloat16", max_num_batched_tokens=16384,
                skip_tokenizer_init=True, cudagraph_mode=mode, gpu_memory_utilization=0.4,
            )  # fmt: skip
            runner = llm.llm_engine.runner
            buckets = len(runner.piecewise_graphs.buckets)
            print(f"{mode}: engine built in {time.perf_counter() - t0:.1f} s, {buckets} piecewise buckets")
            rng = random.Random(11)
            for n in lens:
                for case, fn in (("alone", _first_token_s), ("beside decodes", _step_beside_decodes_s)):
                    runner.host_times.clear()
                    t = sorted(fn(llm, rng, n, args.repeat))
                    row = dict(mode=mode, prompt_len=n, case=case, best_ms=t[0] * 1e3)
                    row.update(median_ms=t[len(t) // 2] * 1e3, launch_us=_forward_launch_us(runner))
                    results.append(row)
                    print(
                        f"{mode:<19} L={n:<6} {case:<15} best {row['best_ms']:8.2f} ms  "
                        f"median {row['median_ms']:8.2f} ms  forward launch {row['launch_us']}",
                        flush=True,
                    )
            del llm, runner
            gc.collect()  # the engine's objects hold cycles: free its pool before the next one
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
