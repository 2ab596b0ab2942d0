"""Admission and fairness: a request is charged what it will cost (prompts x n sequences, prompt +
max_tokens tokens each); one that alone exceeds a limit is a 400 naming it, one that does not fit
beside the queue a 429 with Retry-After; and a small request behind a huge one is served at once."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import assert_error
from tests.server.fake_engine import BatchedFakeEngine
from tests.server.helpers import ServerThread


def _serve(tokenizer, **config):
    from tilellm.server import ServerConfig, create_app

    engine = BatchedFakeEngine(tokenizer, max_num_seqs=8, step_s=0.002)
    s = ServerThread(create_app(engine, ServerConfig("fake", **config)))
    s.engine = engine
    return s


def test_a_request_over_the_per_request_limits_is_a_400_naming_them(tokenizer):
    with _serve(tokenizer, max_request_seqs=64, max_request_tokens=1500) as s, s.client() as http:
        err = assert_error(
            http.post("/v1/completions", json={"prompt": ["a"] * 10, "n": 8, "max_tokens": 2}), 400, "n"
        )
        assert "80 sequences" in err["message"] and "max_request_seqs" in err["message"]
        body = {"prompt": [[5] * 100] * 10, "max_tokens": 100}  # 10 x (100 + 100) tokens
        err = assert_error(http.post("/v1/completions", json=body), 400, "max_tokens")
        assert "max_request_tokens" in err["message"]
        assert (
            http.post("/v1/completions", json={"prompt": ["a"] * 8, "n": 8, "max_tokens": 2}).status_code
            == 200
        )


def test_a_full_queue_is_a_429_with_retry_after(tokenizer):
    with _serve(tokenizer, max_waiting=40, engine_seqs=8) as s, s.client(timeout=60) as http:
        # 40 sequences: 8 run (the engine's batch), 32 wait; 9 more do not fit beside them
        big = {"prompt": ["x"] * 40, "max_tokens": 60}

        done = threading.Event()
        threading.Thread(target=lambda: (http.post("/v1/completions", json=big), done.set())).start()
        deadline = time.monotonic() + 10
        while not s.engine.added:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with s.client() as other:
            r = other.post("/v1/completions", json={"prompt": ["y"] * 9, "max_tokens": 2})
            fits = other.post("/v1/completions", json={"prompt": ["y"] * 2, "max_tokens": 2})
        assert fits.status_code == 200, fits.text
        err = assert_error(r, 429)
        assert err["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
        assert done.wait(60)


def test_a_small_request_behind_a_huge_one_is_served_first(tokenizer):
    """The huge request (48 prompts x n=4) alone would hold the engine's 8-sequence batch for
    ~24 rounds of 40 steps; the small one must not wait for them (the engine sees it early)."""
    with _serve(tokenizer) as s, s.client(timeout=120) as http:
        huge = {"prompt": [[i + 3] * 4 for i in range(48)], "n": 4, "max_tokens": 40}
        result: dict[str, float] = {}

        def run_huge() -> None:
            r = http.post("/v1/completions", json=huge)
            assert r.status_code == 200, r.text
            result["huge"] = time.monotonic()

        t = threading.Thread(target=run_huge)
        t.start()
        deadline = time.monotonic() + 10
        while len(s.engine.added) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        with s.client(timeout=60) as other:
            r = other.post("/v1/completions", json={"prompt": "small", "max_tokens": 4})
        result["small"] = time.monotonic()
        t.join(120)
        assert r.status_code == 200, r.text
        assert result["small"] < result["huge"], "the small request waited for the huge one"
        assert result["small"] - start < 5.0
        small_at = next(i for i, rid in enumerate(s.engine.added) if rid.endswith("-0") and i > 0)
        assert small_at <= 16, f"the engine got {small_at} of the huge request's prompts first"


@pytest.mark.parametrize("n_clients", [4])
def test_queued_counts_return_to_zero(tokenizer, n_clients):
    with _serve(tokenizer) as s, s.client(timeout=60) as http:
        threads = [
            threading.Thread(
                target=lambda: http.post(
                    "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 3}
                )
            )
            for _ in range(n_clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        feeder = s.server.config.app.state.feeder
        assert (feeder.pending_seqs, feeder.pending_tokens, feeder.engine_seqs, feeder.num_open) == (
            0,
            0,
            0,
            0,
        )
        assert httpx.get(s.url + "/health").status_code == 200
