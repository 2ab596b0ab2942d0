"""The engine thread against a scripted engine: failures, idling, aborts (no model needed)."""

from __future__ import annotations

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
