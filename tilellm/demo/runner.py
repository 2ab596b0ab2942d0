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

from tilellm.demo import copy_task, task
from tilellm.demo.task import Problem


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
    draft_tokens: int = 0  # speculative decoding: draft tokens verified in this step
    accepted_tokens: int = 0  # of which accepted


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
    num_drafts: int = 0  # speculative decoding: drafts verified, their tokens, accepted ones
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def num_correct(self) -> int:
        return sum(p.is_correct(self.answers.get(i, "")) for i, p in enumerate(self.problems))

    @property
    def accuracy(self) -> float:
        return self.num_correct / max(1, len(self.problems))

    @property
    def passed(self) -> bool:
        return self.accuracy >= self.threshold


def _prefill_tokens(snap) -> int:
    """Prompt tokens of a step: rows of more than one token that are not a draft's verification,
    and first tokens (a one-token prompt)."""
    if snap is None:
        return 0
    drafts = snap.num_drafts or [0] * len(snap.query_lens)
    return sum(q for q, s, d in zip(snap.query_lens, snap.seq_lens, drafts) if not d and (q > 1 or s <= q))


def _problems(meta: dict, n: int, seed: int) -> list:
    """Held-out problems of the model's task (its tilellm_demo.json says which)."""
    if meta.get("task") == "record-edit":
        return copy_task.problems_for_model(meta, n, seed)
    return task.problems_for_model(meta, n, seed)


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
    problems = _problems(meta, num_requests, seed)
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
    spec = engine.config.speculative_config
    if spec is not None:
        say(
            f"  speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} draft tokens "
            "per sequence and step; draft/accepted: this step's draft tokens and how many were accepted"
        )
    say()
    header = " step  kind     run  wait  seqs  tokens  prefill  cache-hit  kv blocks  preempt  done"
    say(header + ("  draft  accepted" if spec is not None else ""))
    prev_draft = prev_accepted = 0

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
            prefill_tokens=_prefill_tokens(snap),
            cache_hit_tokens=stats.prefix_cache_hits - prev_hits,
            kv_used=stats.num_kv_blocks_used,
            kv_total=stats.num_kv_blocks_total,
            preemptions=stats.num_preemptions,
            finished=finished,
            seconds=dt,
            draft_tokens=stats.spec_decode_num_draft_tokens - prev_draft,
            accepted_tokens=stats.spec_decode_num_accepted_tokens - prev_accepted,
        )
        prev_hits = stats.prefix_cache_hits
        prev_draft, prev_accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
        result.steps.append(line)
        say(
            f"{line.step:5d}  {line.kind:7s} {line.num_running:4d} {line.num_waiting:5d} {line.num_seqs:5d} "
            f"{line.num_tokens:7d} {line.prefill_tokens:8d} {line.cache_hit_tokens:10d} "
            f"{line.kv_used:5d}/{line.kv_total:<5d} {line.preemptions:7d} {line.finished:5d}"
            + (f"  {line.draft_tokens:5d}  {line.accepted_tokens:8d}" if spec is not None else "")
        )
    result.seconds = time.perf_counter() - start
    stats = engine.get_stats()
    result.prompt_tokens = stats.prompt_tokens_total
    result.output_tokens = stats.generation_tokens_total
    result.prefix_cache_queries = stats.prefix_cache_queries
    result.prefix_cache_hits = stats.prefix_cache_hits
    result.preemptions = stats.num_preemptions
    result.draft_tokens = stats.spec_decode_num_draft_tokens
    result.accepted_tokens = stats.spec_decode_num_accepted_tokens
    result.num_drafts = stats.spec_decode_num_drafts
    if out is not None:
        _print_answers(result, out)
        _print_summary(result, out)
    return result


def _print_answers(result: DemoResult, out: TextIO) -> None:
    print("\nanswers (checked by program):", file=out)
    cells = []
    for i, p in enumerate(result.problems):
        got = result.answers.get(i, "").strip()
        ok = p.is_correct(got)
        if "\n" in p.question:  # a record edit: its first line names the change, the record is long
            cells.append(f"{p.question.splitlines()[0]}: {'ok' if ok else 'WRONG'}")
        else:
            cells.append(f"{p.question}={got} {'ok' if ok else f'WRONG, expected {p.answer}'}")
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
    if result.num_drafts:
        print(
            f"speculative decoding: {result.accepted_tokens}/{result.draft_tokens} draft tokens accepted "
            f"({result.accepted_tokens / result.draft_tokens:.0%}), "
            f"{1 + result.accepted_tokens / result.num_drafts:.2f} tokens per sequence per verifying step",
            file=out,
        )
