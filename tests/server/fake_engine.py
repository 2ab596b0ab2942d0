"""A deterministic stand-in for `LLMEngine`, for tests that must make the engine misbehave.

Token t of a sequence is `(sum(prompt) * 31 + 7 * t + index) % 200 + 32` (printable bytes of the
tiny tokenizer); `fail_on_step` makes the next `step()` raise. It takes the real `tilellm.SamplingParams`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tilellm.engine.stats import EngineStats


@dataclass
class FakeCompletion:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class FakeOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class _Req:
    prompt: list[int]
    params: Any
    tokens: list[list[int]] = field(default_factory=list)


class FakeEngine:
    def __init__(self, tokenizer, max_model_len: int = 256, vocab_size: int = 384):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_config = type("Cfg", (), {"vocab_size": vocab_size})()
        self.reqs: dict[str, _Req] = {}
        self.fail_on_step = False
        self.stats = EngineStats(num_kv_blocks_total=64)

    def add_request(self, request_id, prompt, params) -> None:
        if request_id in self.reqs:
            raise ValueError(f"request_id {request_id} already exists")
        self.reqs[request_id] = _Req(list(prompt), params, [[] for _ in range(params.n)])
        self.stats.prompt_tokens_total += len(prompt)

    def abort_request(self, request_id) -> bool:
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def get_stats(self) -> EngineStats:
        self.stats.num_running = len(self.reqs)
        self.stats.num_kv_blocks_used = len(self.reqs)
        return self.stats

    def step(self) -> list[FakeOutput]:
        if self.fail_on_step:
            self.fail_on_step = False
            raise RuntimeError("injected failure")
        outs = []
        for rid, req in list(self.reqs.items()):
            comps = []
            for i, toks in enumerate(req.tokens):
                t = (sum(req.prompt) * 31 + 7 * len(toks) + i) % 200 + 32
                toks.append(t)
                self.stats.generation_tokens_total += 1
                lps = None
                if req.params.logprobs is not None:
                    lps = [{tok: math.log(0.5)} for tok in toks]
                done = len(toks) >= req.params.max_tokens
                comps.append(
                    FakeCompletion(
                        i, self.tokenizer.decode(toks), list(toks), None, lps, "length" if done else None
                    )
                )
            finished = all(c.finish_reason for c in comps)
            if finished:
                del self.reqs[rid]
            outs.append(FakeOutput(rid, None, req.prompt, comps, finished))
        return outs


class BatchedFakeEngine(FakeEngine):
    """A FakeEngine with a bounded running batch (`max_num_seqs` sequences) filled first come,
    first served from its waiting queue, as the real scheduler does; `step_s` paces each step."""

    def __init__(self, tokenizer, max_num_seqs: int = 8, step_s: float = 0.0, **kw):
        super().__init__(tokenizer, **kw)
        self.config = type("Cfg", (), {"max_num_seqs": max_num_seqs})()
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.added: list[str] = []  # request ids in the order the engine received them

    def add_request(self, request_id, prompt, params) -> None:
        super().add_request(request_id, prompt, params)
        self.waiting.append(request_id)
        self.added.append(request_id)

    def abort_request(self, request_id) -> bool:
        for q in (self.waiting, self.running):
            if request_id in q:
                q.remove(request_id)
        return super().abort_request(request_id)

    def get_stats(self) -> EngineStats:
        self.stats.num_running = sum(self.reqs[r].params.n for r in self.running)
        self.stats.num_waiting = sum(self.reqs[r].params.n for r in self.waiting)
        return self.stats

    def step(self) -> list[FakeOutput]:
        import time

        if self.step_s:
            time.sleep(self.step_s)
        busy = sum(self.reqs[r].params.n for r in self.running)
        while self.waiting and busy + self.reqs[self.waiting[0]].params.n <= self.max_num_seqs:
            rid = self.waiting.pop(0)
            self.running.append(rid)
            busy += self.reqs[rid].params.n
        hidden = {r: self.reqs.pop(r) for r in self.waiting}
        try:
            outs = super().step()
        finally:
            self.reqs.update(hidden)
        self.running = [r for r in self.running if r in self.reqs]
        return outs


class ScriptedEngine(FakeEngine):
    """Emits the tokens of `text` (the tiny byte-level tokenizer's), a few per step."""

    def __init__(self, tokenizer, text: str, **kw):
        super().__init__(tokenizer, **kw)
        self.text = text

    def step(self) -> list[FakeOutput]:
        outs = []
        script = self.tokenizer.encode(self.text, add_special_tokens=False)
        for rid, req in list(self.reqs.items()):
            comps = []
            for i, toks in enumerate(req.tokens):
                toks.extend(script[len(toks) : min(len(toks) + 3, req.params.max_tokens)])
                done = len(toks) >= min(len(script), req.params.max_tokens)
                reason = ("stop" if len(toks) >= len(script) else "length") if done else None
                comps.append(FakeCompletion(i, self.tokenizer.decode(toks), list(toks), None, None, reason))
            if all(c.finish_reason for c in comps):
                del self.reqs[rid]
            outs.append(FakeOutput(rid, None, req.prompt, comps, all(c.finish_reason for c in comps)))
        return outs
