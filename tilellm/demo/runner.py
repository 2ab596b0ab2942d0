"""`tilellm demo`: the embedded model answers a batch of addition problems through the engine.

Requests arrive a few per step (as on a server), so the view shows continuous batching: new
prompts are prefilled in the same step as running requests decode, every request after the first
wave finds the shared instruction prefix in the prefix cache, and a small KV pool
(`--num-kv-blocks`) makes the scheduler preempt. The answers are checked by program.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tilellm.demo.task import Problem, problems_for_model


@dataclass
class StepLine:
    """What one engine step did (one line of the live view)."""

    step: int
    kind: str
    num_running: int
    num_waiting: int
    num_seqs: int  # sequences in the step
    num_tokens: int  # tokens computed
    prefill_tokens: int  # of which prompt tokens
    cache_hit_tokens: int  # prompt tokens found in the prefix cache at admission this step
    kv_used: int
    kv_total: int
    preemptions: int  # cumulative
    finished: int  # cumulative
    seconds: float


@dataclass
class DemoResult:
    problems: list[Problem]
    answers: dict[int, str]
    steps: list[StepLine] = field(default_factory=list)
    seconds: float = 0.0
    load_seconds: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    threshold: float = 0.0
    device: str = ""

    @property
    def num_correct(self) -> int:
        return sum(p.is_correct(self.answers.get(i, "")) for i, p in enumerate(self.problems))

    @property
    def accuracy(self) -> float:
        return self.num_correct / max(1, len(self.problems))

    @property
    def passed(self) -> bool:
        return self.accuracy >= self.threshold


def run_demo(
    *,
    model: str | Path | None = None,
    num_requests: int = 64,
    arrivals_per_step: int = 8,
    device: str | None = "cpu",
    attention_backend: str = "auto",
    num_kv_blocks: int | None = None,
    max_num_seqs: int = 64,
    block_size: int = 16,
    seed: int = 2024,
    out: TextIO | None = None,
    engine_kwargs: dict | None = None,
) -> DemoResult:
    """Run the demo; print the live view to `out` (None: silent). Returns everything measured."""
    from tilellm.assets import default_model_path, demo_metadata
    from tilellm.engine.llm_engine import LLMEngine
    from tilellm.engine.sampling_params import SamplingParams

    model_dir = Path(model) if model is not None else default_model_path()
    meta = demo_metadata(model_dir)
    problems = problems_for_model(meta, num_requests, seed)
    max_answer = max(len(p.answer) for p in problems)
    params = SamplingParams(temperature=0.0, max_tokens=max_answer + 2)

    def say(text: str = "") -> None:
        if out is not None:
            print(text, file=out, flush=True)

    if num_kv_blocks is None:
        num_kv_blocks = max(64, 4 * max_num_seqs)  # room for every running request: no preemption
    t0 = time.perf_counter()
    engine = LLMEngine(
        str(model_dir),
        device=device,
        attention_backend=attention_backend,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        **(engine_kwargs or {}),
    )
    load_s = time.perf_counter() - t0
    runner = engine.runner
    result = DemoResult(
        problems,
        {},
        load_seconds=load_s,
        threshold=float(meta["accuracy_threshold"]),
        device=str(runner.device),
    )
    prefix_tokens = len(engine.tokenizer.encode(meta["prefix"]))
    say(
        f"tilellm demo: {model_dir.name} ({meta.get('task', 'addition')}), {num_requests} requests, "
        f"{arrivals_per_step} arriving per step, on {runner.device} "
        f"(attention: {engine.config.attention_backend}, {str(runner.dtype).replace('torch.', '')})"
    )
    say(
        f"  every prompt starts with the same {prefix_tokens}-token instruction "
        f"({prefix_tokens // block_size} full KV blocks of {block_size}); "
        f"KV pool {runner.num_kv_blocks} blocks; model loaded in {load_s:.1f}s"
    )
    say()
    say(" step  kind     run  wait  seqs  tokens  prefill  cache-hit  kv blocks  preempt  done")

    next_req = 0
    step = 0
    finished = 0
    prev_hits = 0
    start = time.perf_counter()
    while next_req < num_requests or engine.has_unfinished_requests():
        for _ in range(arrivals_per_step):
            if next_req < num_requests:
                engine.add_request(f"q{next_req}", problems[next_req].prompt, params)
                next_req += 1
        t_step = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t_step
        step += 1
        for o in outputs:
            if o.finished:
                finished += 1
                result.answers[int(o.request_id[1:])] = o.outputs[0].text
        stats = engine.get_stats()
        snap = engine.last_step
        q_lens = snap.query_lens if snap is not None else []
        line = StepLine(
            step=step,
            kind=snap.kind if snap is not None else "",
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_seqs=len(q_lens),
            num_tokens=sum(q_lens),
            prefill_tokens=sum(q for q, s in zip(q_lens, snap.seq_lens) if q > 1 or s <= q) if snap else 0,
            cache_hit_tokens=stats.prefix_cache_hits - prev_hits,
            kv_used=stats.num_kv_blocks_used,
            kv_total=stats.num_kv_blocks_total,
            preemptions=stats.num_preemptions,
            finished=finished,
            seconds=dt,
        )
        prev_hits = stats.prefix_cache_hits
        result.steps.append(line)
        say(
            f"{line.step:5d}  {line.kind:7s} {line.num_running:4d} {line.num_waiting:5d} {line.num_seqs:5d} "
            f"{line.num_tokens:7d} {line.prefill_tokens:8d} {line.cache_hit_tokens:10d} "
            f"{line.kv_used:5d}/{line.kv_total:<5d} {line.preemptions:7d} {line.finished:5d}"
        )
    result.seconds = time.perf_counter() - start
    stats = engine.get_stats()
    result.prompt_tokens = stats.prompt_tokens_total
    result.output_tokens = stats.generation_tokens_total
    result.prefix_cache_queries = stats.prefix_cache_queries
    result.prefix_cache_hits = stats.prefix_cache_hits
    result.preemptions = stats.num_preemptions
    if out is not None:
        _print_answers(result, out)
        _print_summary(result, out)
    return result


def _print_answers(result: DemoResult, out: TextIO) -> None:
    print("\nanswers (checked by program):", file=out)
    cells = []
    for i, p in enumerate(result.problems):
        got = result.answers.get(i, "").strip()
        mark = "ok" if p.is_correct(got) else f"WRONG, expected {p.answer}"
        cells.append(f"{p.question}={got} {mark}")
    width = max(len(c) for c in cells) + 3
    per_line = max(1, 96 // width)
    for i in range(0, len(cells), per_line):
        print("  " + "".join(c.ljust(width) for c in cells[i : i + per_line]).rstrip(), file=out)


def _print_summary(result: DemoResult, out: TextIO) -> None:
    hit_rate = result.prefix_cache_hits / max(1, result.prefix_cache_queries)
    verdict = "PASS" if result.passed else "FAIL"
    print(
        f"\naccuracy {result.num_correct}/{len(result.problems)} = {result.accuracy:.1%} "
        f"(threshold for this model {result.threshold:.0%}): {verdict}",
        file=out,
    )
    secs = max(result.seconds, 1e-9)
    print(
        f"{len(result.steps)} steps in {result.seconds:.2f}s: "
        f"{result.output_tokens / secs:.0f} output tok/s, "
        f"{(result.prompt_tokens + result.output_tokens) / secs:.0f} tok/s in all; prefix cache "
        f"{result.prefix_cache_hits}/{result.prefix_cache_queries} prompt tokens ({hit_rate:.0%}); "
        f"{result.preemptions} preemptions",
        file=out,
    )
