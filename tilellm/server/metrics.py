"""Prometheus metrics of one server (its own `CollectorRegistry`, so several apps can share a process).

Engine-level numbers (running/waiting requests, KV blocks, prefix cache, preemptions, token
counters, speculative decoding's drafts and acceptance) are read at scrape time from the stats
snapshot the engine thread publishes; latency histograms are observed by the engine thread as
requests get their first token and finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tilellm.engine.metrics import PREFIX, Gauge, Vector, engine_metrics
from tilellm.engine.metrics import Counter as EngineCounter
from tilellm.server.async_engine import StatsSnapshot

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    300.0,
)


class _EngineCollector(Collector):
    """The engine's metrics (`tilellm.engine.metrics.engine_metrics`, the names' one owner) at
    scrape time, as Prometheus families; a vector is one counter labelled by position."""

    def __init__(self, get_stats: Callable[[], StatsSnapshot], model_name: str):
        self._get_stats = get_stats
        self._labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        for m in engine_metrics(self._get_stats(), self._labels):
            if isinstance(m, Gauge):
                family: Metric = GaugeMetricFamily(m.name, m.help, labels=names)
                family.add_metric(values, m.value)
            elif isinstance(m, EngineCounter):
                family = CounterMetricFamily(m.name, m.help, labels=names)
                family.add_metric(values, m.value)
            else:
                assert isinstance(m, Vector)
                family = CounterMetricFamily(m.name, m.help, labels=names + ["position"])
                for position, v in enumerate(m.values):
                    family.add_metric(values + [str(position)], v)
            yield family


class ServerMetrics:
    """Owns the registry; the `AsyncEngine` calls `on_first_token`, `on_finished` and `on_aborted`
    from the engine thread."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._get_stats: Callable[[], StatsSnapshot] = StatsSnapshot
        self.registry.register(_EngineCollector(lambda: self._get_stats(), model_name))
        labels = ["model_name"]

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, help_text, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", _TTFT_BUCKETS
        )
        # vLLM's current names: inter-token latency per token interval (the deprecated
        # time_per_output_token_seconds), and each request's mean time per output token.
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between two consecutive output tokens of a request.",
            _TPOT_BUCKETS,
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _E2E_BUCKETS
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason (abort: the client left or the server stopped).",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):  # export zeros before the first request
            self._success.labels(model_name, reason)

    def bind(self, get_stats: Callable[[], StatsSnapshot]) -> None:
        self._get_stats = get_stats

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_finished(
        self, e2e: float, tpot: float | None, finish_reason: str, num_tokens: int | None = None
    ) -> None:
        """`tpot`: the request's mean time per output token after the first; `num_tokens`: its
        output tokens, so that the inter-token histogram counts each of their intervals (the
        engine reports one mean per request, not every interval: that is its sum, spread evenly)."""
        self.e2e.observe(e2e)
        if tpot is not None:
            self.request_tpot.observe(tpot)
            for _ in range(max(1, (num_tokens or 2) - 1)):
                self.itl.observe(tpot)
        self._success.labels(self._model_name, finish_reason).inc()

    def on_aborted(self) -> None:
        self._success.labels(self._model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
