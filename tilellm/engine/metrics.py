"""The engine's metrics as vLLM spells them: named gauges, counters and vectors of counters.

    for m in llm.get_metrics():          # LLM.get_metrics(), as vLLM's
        print(m.name, m.value if not isinstance(m, Vector) else m.values)

One list, built from the one record of the engine's counts (`EngineStats`), serves both the
offline `LLM.get_metrics()` and the server's Prometheus `/metrics`, which exports a counter
`tilellm:x` as `tilellm:x_total` and a vector as one counter per position label.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tilellm.engine.stats import EngineStats

PREFIX = "tilellm:"


@dataclass
class Metric:
    name: str
    help: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Counter(Metric):
    value: float = 0  # a count, or seconds summed


@dataclass
class Vector(Metric):
    """Counters indexed by position (vLLM: acceptance per draft position)."""

    values: list[int] = field(default_factory=list)


def engine_metrics(s: EngineStats, labels: dict[str, str] | None = None) -> list[Metric]:
    """The engine's metrics from one stats record; speculative decoding's only when it is on."""
    labels = dict(labels or {})
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
    usage = s.num_kv_blocks_used / s.num_kv_blocks_total if s.num_kv_blocks_total else 0.0

    def gauge(name: str, help: str, value: float) -> Gauge:
        return Gauge(PREFIX + name, help, labels, value)

    def counter(name: str, help: str, value: float) -> Counter:
        return Counter(PREFIX + name, help, labels, value)

    out: list[Metric] = [
        gauge("num_requests_running", "Requests in the running batch.", s.num_running),
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
        gauge("kv_blocks_used", "KV cache blocks in use.", s.num_kv_blocks_used),
        gauge("kv_blocks_total", "KV cache blocks in the pool.", s.num_kv_blocks_total),
        gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", usage),
        gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since start (0-1).", hit_rate),
        counter("prefix_cache_queries", "Prefix cache lookups (tokens).", s.prefix_cache_queries),
        counter("prefix_cache_hits", "Prefix cache hits (tokens).", s.prefix_cache_hits),
        counter("num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
        counter("prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total),
        counter("generation_tokens", "Tokens generated.", s.generation_tokens_total),
        counter("engine_steps", "Engine steps run.", s.num_steps),
        counter("engine_step_schedule_seconds", "Engine steps' time in the scheduler.", s.step_schedule_s),
        counter(
            "engine_step_prepare_seconds",
            "Engine steps' time preparing inputs and launching the forward.",
            s.step_prepare_s,
        ),
        counter(
            "engine_step_execute_seconds",
            "Engine steps' time waiting for the step's sampled tokens (the device, when it bounds).",
            s.step_execute_s,
        ),
        counter(
            "engine_step_postprocess_seconds",
            "Engine steps' time appending tokens, checking stops and building outputs.",
            s.step_postprocess_s,
        ),
        counter(
            "engine_step_device_seconds",
            "Engine steps' time on the device, by CUDA events (TILELLM_TIME_DEVICE=1; else 0).",
            s.step_device_s,
        ),
        counter(
            "engine_busy_seconds",
            "Time in which the server's engine had requests to run (0 offline).",
            s.busy_s,
        ),
    ]
    if s.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding is on
        out += [
            counter(
                "spec_decode_num_drafts",
                "Drafts verified (one per sequence and step).",
                s.spec_decode_num_drafts,
            ),
            counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_decode_num_draft_tokens),
            counter(
                "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_decode_num_accepted_tokens
            ),
            Vector(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft (label position).",
                labels,
                list(s.spec_decode_num_accepted_tokens_per_pos),
            ),
        ]
    return out
