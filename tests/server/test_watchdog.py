"""The engine watchdog (`server/watchdog.py`): a stopped engine process (SIGSTOP) turns /health
503 and fails the requests waiting on it with engine_stalled, and both recover when it goes on
(SIGCONT); an idle engine is not taken for a stalled one; `request_timeout` aborts a request
with a 504 (for a stream: an error event, then [DONE]) and frees what it held in the engine."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.server import conftest
from tests.server.conftest import assert_error
from tests.server.fake_engine import BatchedFakeEngine
from tests.server.helpers import ServerThread

NAME = "tiny-watchdog"


def _stream_events(http, body: dict) -> list[str]:
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        return [ln for ln in resp.iter_lines() if ln.startswith("data: ")]


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stopped_engine_process_is_reported_and_recovers(tiny_model_dir):
    from tilellm.server import ServerConfig, create_app
    from tilellm.server.engine_process import EngineProcess

    engine = EngineProcess(tiny_model_dir, dict(conftest.ENGINE_KWARGS, max_num_seqs=8))
    app = create_app(engine, ServerConfig(NAME, engine_stall_timeout=1.0))
    with ServerThread(app) as s, s.client(timeout=30) as http:
        assert http.get("/health").status_code == 200
        body = {"model": NAME, "prompt": [4] * 8, "max_tokens": 240, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))
            os.kill(engine.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                rest = [ln for ln in lines if ln.startswith("data: ")]
                waited = time.monotonic() - t0
                health = http.get("/health")
                refused = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
            finally:
                os.kill(engine.pid, signal.SIGCONT)
        assert rest[-1] == "data: [DONE]", rest[-3:]
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_stalled"
        assert waited < 10, waited  # found within a few ticks of the 1 s stall timeout
        assert assert_error(health, 503)["code"] == "engine_stalled"
        assert assert_error(refused, 503)["code"] == "engine_stalled"
        _wait_for(lambda: http.get("/health").status_code == 200)
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.fixture
def fake_server(tokenizer, request):
    from tilellm.server import ServerConfig, create_app

    engine = BatchedFakeEngine(tokenizer, max_num_seqs=8, step_s=0.02)
    app = create_app(engine, ServerConfig(NAME, **request.param))
    with ServerThread(app) as s, s.client(timeout=30) as http:
        s.engine, s.http = engine, http
        yield s


@pytest.mark.parametrize("fake_server", [dict(engine_stall_timeout=0.3)], indirect=True)
def test_an_idle_engine_is_not_stalled(fake_server):
    """Silence while there is no work says nothing: the first request after a quiet spell longer
    than the stall timeout is served."""
    http = fake_server.http
    time.sleep(1.0)
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("fake_server", [dict(request_timeout=0.5)], indirect=True)
def test_request_timeout_aborts_with_a_504(fake_server):
    http, engine = fake_server.http, fake_server.engine
    long = {"model": NAME, "prompt": "hi", "max_tokens": 500}  # 500 steps of 20 ms: 10 s
    t0 = time.monotonic()
    err = assert_error(http.post("/v1/completions", json=long), 504)
    assert err["code"] == "request_timeout" and "0.5 s" in err["message"]
    assert time.monotonic() - t0 < 5
    _wait_for(lambda: not engine.reqs)  # aborted in the engine: what it held is free
    events = _stream_events(http, {**long, "stream": True})
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
    _wait_for(lambda: not engine.reqs)
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
