"""/health, /metrics (exact token counters, latency histograms) and /inspect."""

from __future__ import annotations

import time

import httpx

from tests.server.conftest import MODEL_NAME, read_metrics

METRICS = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_cache_usage_perc",
    "prefix_cache_hit_rate",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count",
    "request_time_per_output_token_seconds_count",
    "e2e_request_latency_seconds_count",
    "request_success_total",
    "engine_steps_total",
    "engine_step_schedule_seconds_total",
    "engine_step_prepare_seconds_total",
    "engine_step_execute_seconds_total",
    "engine_step_postprocess_seconds_total",
    "engine_step_device_seconds_total",
    "engine_busy_seconds_total",
]


def test_health(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200


def test_metrics_count_tokens_and_latencies_exactly(http):
    before = read_metrics(http)
    started = time.monotonic()
    assert set(METRICS) <= set(before), set(METRICS) - set(before)
    assert not any(name.startswith("time_per_output_token") for name in before)  # deprecated in vLLM
    assert before["kv_blocks_total"] == 512
    body = {"model": MODEL_NAME, "prompt": [9] * 37, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200
    body["prompt"] = [9] * 37 + [10]  # shares the first two full blocks
    assert http.post("/v1/completions", json=body).status_code == 200
    after = read_metrics(http)
    elapsed = time.monotonic() - started
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 75
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 12
    for name in (
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert after[f"{name}_count"] - before[f"{name}_count"] == 2
        assert after[f"{name}_sum"] > before[f"{name}_sum"]
    itl = after["inter_token_latency_seconds_count"] - before["inter_token_latency_seconds_count"]
    assert itl == 2 * (6 - 1)  # one per interval between two output tokens
    assert after["request_success_total"] - before["request_success_total"] == 2
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 32
    assert 0 < after["prefix_cache_hit_rate"] <= 1
    assert after["num_requests_running"] == after["num_requests_waiting"] == after["kv_blocks_used"] == 0
    # the engine's steps: at least one a token of each request, and time in every phase
    assert after["engine_steps_total"] - before["engine_steps_total"] >= 2 * 6
    in_steps = 0.0
    for phase in ("schedule", "prepare", "execute", "postprocess"):
        name = f"engine_step_{phase}_seconds_total"
        assert after[name] > before[name], name
        in_steps += after[name] - before[name]
    # busy from each request's admission to its last step: around its steps, inside the test's time
    busy = after["engine_busy_seconds_total"] - before["engine_busy_seconds_total"]
    assert in_steps <= busy <= elapsed, (in_steps, busy, elapsed)
    # the device is timed only with TILELLM_TIME_DEVICE=1 on a GPU (this server: the CPU)
    assert after["engine_step_device_seconds_total"] == before["engine_step_device_seconds_total"] == 0


def test_inspect_page(server, http):
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    r = http.get("/inspect")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<svg" in r.text or "<html" in r.text.lower()
    assert httpx.get(server.url + "/inspect").status_code == 401  # behind the API key like /v1
