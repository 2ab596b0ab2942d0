"""The engine thread against a scripted engine: failures, idling, aborts (no model needed)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import assert_error
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import ServerThread


class CountingEngine(FakeEngine):
    """Counts how often the engine thread polls it (to catch busy-waiting)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.polls = 0
        self.lock = threading.Lock()

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            self.polls += 1
        return super().has_unfinished_requests()


@pytest.fixture(scope="module")
def fake(tokenizer):
    from tilellm.server import ServerConfig, create_app

    engine = CountingEngine(tokenizer)
    with ServerThread(create_app(engine, ServerConfig("fake"))) as s:
        s.engine = engine
        with httpx.Client(base_url=s.url, timeout=30) as c:
            s.http = c
            yield s


def _completion(http, **kw):
    body = {"prompt": "Hello", "max_tokens": 4, **kw}
    return http.post("/v1/completions", json=body)


def test_engine_step_failure_is_a_500_and_the_server_recovers(fake):
    fake.engine.fail_on_step = True
    err = assert_error(_completion(fake.http), 500)
    assert err["type"] == "server_error"
    assert "injected" not in err["message"]  # internal detail stays in the log
    assert _completion(fake.http).status_code == 200
    assert fake.http.get("/health").status_code == 200


def test_engine_step_failure_mid_stream_sends_an_error_event(fake):
    fake.engine.fail_on_step = True
    with fake.http.stream(
        "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": True}
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and '"server_error"' in lines[-2]
    assert _completion(fake.http).status_code == 200


def test_engine_thread_sleeps_when_idle(fake):
    assert _completion(fake.http).status_code == 200
    time.sleep(0.2)
    before = fake.engine.polls
    time.sleep(0.5)
    assert fake.engine.polls - before <= 2  # woken only by new work, not polling


def test_uncaught_handler_error_is_an_opaque_500(fake, monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(fake.engine.tokenizer.__class__, "encode", boom, raising=True)
    try:
        err = assert_error(_completion(fake.http), 500)
    finally:
        monkeypatch.undo()
    assert "secret" not in err["message"]
    assert _completion(fake.http).status_code == 200


def test_full_responses_get_one_update_and_a_true_ttft(tiny_model_dir):
    """A non-streamed request's engine requests hand the server one update each, when they
    finish (`RequestOutputKind.FINAL_ONLY`), a streamed one an update per step; the TTFT metric
    of the non-streamed one is still the time to its first token, not to its last."""
    from tests.server.conftest import MODEL_NAME, make_engine, read_metrics
    from tilellm.server import ServerConfig, async_engine, create_app

    engine = make_engine(tiny_model_dir)
    real_step = engine.step

    def paced_step():  # 20 ms a step: a 20-token answer takes >= 0.4 s, its first token ~0.04 s
        time.sleep(0.02)
        return real_step()

    engine.step = paced_step
    delivered: list[int] = []  # updates per message the server received
    real_deliver = async_engine._deliver

    def counting_deliver(routed):
        delivered.append(len(routed))
        real_deliver(routed)

    # two prompts: two engine requests per HTTP request
    body = {"model": MODEL_NAME, "prompt": [[5] * 12, [6] * 12], "max_tokens": 20, "ignore_eos": True}
    app = create_app(engine, ServerConfig(MODEL_NAME))
    with ServerThread(app) as s, httpx.Client(base_url=s.url) as http:
        async_engine._deliver = counting_deliver
        try:
            full = http.post("/v1/completions", json=body, timeout=60).json()
            full_updates, delivered[:] = sum(delivered), []
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                streamed_tokens = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
            streamed_updates = sum(delivered)
        finally:
            async_engine._deliver = real_deliver
        metrics = read_metrics(http)
    assert [len(c["text"]) > 0 for c in full["choices"]] == [True, True]
    assert full["usage"]["completion_tokens"] == 40
    assert full_updates == 2, f"{full_updates} updates for 2 engine requests that want their final one only"
    assert streamed_updates >= 20 and streamed_tokens >= 20
    # 4 first tokens (2 HTTP requests x 2 prompts) within a few steps; 4 e2e latencies of >= 20 steps
    ttft, e2e = metrics["time_to_first_token_seconds_sum"], metrics["e2e_request_latency_seconds_sum"]
    assert metrics["time_to_first_token_seconds_count"] == 4
    assert ttft < 0.4 * e2e, f"TTFT {ttft:.3f} s against e2e {e2e:.3f} s (summed over 4)"


def test_stream_interval_sends_fewer_events_with_the_same_text(tiny_model_dir):
    """`--stream-interval 4`: a streamed answer's first token comes in its own event, then one
    event per 4 tokens; the text is the non-streamed answer's."""
    from tests.server.conftest import MODEL_NAME, make_engine
    from tilellm.server import ServerConfig, create_app

    app = create_app(make_engine(tiny_model_dir, stream_interval=4), ServerConfig(MODEL_NAME))
    body = {"model": MODEL_NAME, "prompt": [5] * 12, "max_tokens": 13, "ignore_eos": True, "temperature": 0}
    with ServerThread(app) as s, httpx.Client(base_url=s.url) as http:
        full = http.post("/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        texts = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    texts += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(texts) == full
    assert len(texts) == 4, texts  # 1 + 4 + 4 + 4 tokens


def test_a_full_response_aborted_after_its_first_token_counts_in_ttft(tiny_model_dir):
    """A non-streamed request whose client leaves mid-answer (aborted: it never had an update)
    still records its time to first token."""
    from tests.server.conftest import MODEL_NAME, make_engine, read_metrics
    from tilellm.server import ServerConfig, create_app

    engine = make_engine(tiny_model_dir)
    real_step = engine.step

    def paced_step():  # 20 ms a step: 200 tokens take >= 4 s, the client leaves after 0.5 s
        time.sleep(0.02)
        return real_step()

    engine.step = paced_step
    body = {"model": MODEL_NAME, "prompt": [5] * 12, "max_tokens": 200, "ignore_eos": True}
    app = create_app(engine, ServerConfig(MODEL_NAME))
    with ServerThread(app) as s, httpx.Client(base_url=s.url) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while read_metrics(http).get("num_requests_running", 1) != 0:
            assert time.monotonic() < deadline, "the request kept running after its client left"
            time.sleep(0.05)
        metrics = read_metrics(http)
    assert metrics["time_to_first_token_seconds_count"] == 1
    assert 0 < metrics["time_to_first_token_seconds_sum"] < 0.5
