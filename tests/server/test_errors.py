"""Every error the server answers: status, OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server.conftest import (
    API_KEY,
    MAX_MODEL_LEN,
    MAX_REQUEST_BYTES,
    MODEL_NAME,
    assert_error,
    assert_serving,
    make_engine,
)
from tests.server.helpers import ServerThread

COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
LONG_TEXT = "hi " * 300  # more tokens than MAX_MODEL_LEN
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes lone surrogates and writes Infinity, as some clients do; httpx's json= would refuse.
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"tilellm:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {**COMPLETION, "top_k": -7}, "top_k"),
        ("/v1/completions", {**COMPLETION, "min_p": 2}, "min_p"),
        ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
        ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {**COMPLETION, "logprobs": 99}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "stop": ""}, "stop"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [10**6]}, "stop_token_ids"),
        ("/v1/completions", {**COMPLETION, "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {**COMPLETION, "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {**COMPLETION, "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"1": 500}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"one": 5}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"1000000": 5}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"model": MODEL_NAME, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 10**6]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, -2]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1] * MAX_MODEL_LEN}, "prompt"),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [10**6]}, "stop_token_ids"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),
        ("/v1/completions", {**COMPLETION, "seed": 2**70}, "seed"),
        ("/v1/completions", {**COMPLETION, "prompt": "ab\ud800"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "stop": ["\udfff"]}, "stop"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
        ),
        ("/v1/completions", {**COMPLETION, "temperature": float("inf")}, "temperature"),
        ("/v1/chat/completions", {"model": MODEL_NAME}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (
            "/v1/chat/completions",
            # tool_choice unset with tools is "auto", which needs --enable-auto-tool-choice
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
        ),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}, "messages"),
    ],
)
def test_invalid_field_is_400_naming_it(http, path, body, param):
    err = assert_error(_post(http, path, body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert_serving(http)


@pytest.mark.parametrize(
    "content", [b"{not json", b'{"prompt": "x",}', b"[1, 2]", b'"text"', b"", b"\xff\xfe"]
)
def test_malformed_json_is_400(http, content):
    resp = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(resp, 400)
    assert_serving(http)


def test_fields_that_are_neutral_or_unknown_are_accepted(http):
    body = {
        **COMPLETION,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "user": "u",
        "x_extra": 1,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.headers["x-ignored-fields"] == "x_extra"  # named, never silently dropped
    chat = {**CHAT, "guided_json": {}, "messages": [{"role": "user", "content": "hi", "weight": 1}]}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "guided_json, messages[0].weight"
    assert "x-ignored-fields" not in http.post("/v1/completions", json=COMPLETION).headers
    # names that are empty, spaced or beyond ASCII still make a valid header (no whitespace at
    # its ends, latin-1): a fuzzed body once ended it with ", " and the server dropped the connection
    r = http.post("/v1/completions", json={**COMPLETION, " a b ": 2, "\u00af\U0002ff0d": 3, "": 1})
    assert r.status_code == 200
    assert r.headers["x-ignored-fields"] == '%20a%20b%20, %C2%AF%F0%AF%BC%8D, ""'


def test_missing_or_wrong_api_key_is_401(server, http):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert_error(anon.post("/v1/completions", json=COMPLETION), 401)
        assert_error(anon.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer nope"}
        err = assert_error(anon.post("/v1/chat/completions", json=CHAT, headers=wrong), 401)
        assert err["code"] == "invalid_api_key"
        assert_error(anon.get("/v1/models", headers={"Authorization": API_KEY}), 401)  # no scheme
        assert anon.get("/health").status_code == 200  # only /v1 needs the key
        assert anon.get("/metrics").status_code == 200
    assert_serving(http)


def test_unknown_model_is_404(http):
    err = assert_error(http.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "model")
    assert_error(http.get("/v1/models/gpt-9"), 404, "model")
    assert_error(_post(http, "/v1/completions", {**COMPLETION, "model": "\ud800"}), 404, "model")
    assert_serving(http)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_serving(http)


def test_body_over_limit_is_413(http):
    big = {**COMPLETION, "prompt": "a" * (MAX_REQUEST_BYTES + 10)}
    assert_error(http.post("/v1/completions", json=big), 413)

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    assert_error(
        http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}), 413
    )
    assert_serving(http)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, http):
    def used_blocks() -> tuple[float, float]:
        text = http.get("/metrics").text
        return _metric(text, "kv_blocks_used"), _metric(text, "num_requests_running")

    body = {**COMPLETION, "prompt": [5] * 40, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30, headers=http.headers) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(3):
                next(lines)
            blocks, running = used_blocks()
            assert blocks >= 3 and running >= 1
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while used_blocks() != (0.0, 0.0):
        assert time.monotonic() < deadline, f"blocks not freed after the client left: {used_blocks()}"
        time.sleep(0.05)
    gen_total = _metric(http.get("/metrics").text, "generation_tokens_total")
    time.sleep(0.3)
    assert _metric(http.get("/metrics").text, "generation_tokens_total") == gen_total  # nothing runs on
    assert_serving(http)


def test_disconnect_while_waiting_for_a_full_response_aborts(server, http):
    # 64 samples of 226 tokens: a response that takes well over the client's 0.3 s (a non-streamed
    # request costs the server nothing per step, so a single short sample can finish in time).
    body = {**COMPLETION, "prompt": [7] * 30, "max_tokens": 226, "n": 64, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=0.3, headers=http.headers) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    deadline = time.monotonic() + 10
    while _metric(http.get("/metrics").text, "num_requests_running") != 0:
        assert time.monotonic() < deadline, "non-streaming request kept running after its client left"
        time.sleep(0.05)
    assert_serving(http)


@pytest.fixture(scope="module")
def one_slot_server(tiny_model_dir):
    """One running request at a time, one waiting: the third concurrent request gets 429."""
    from tilellm.server import ServerConfig, create_app

    engine = make_engine(tiny_model_dir, max_num_seqs=1, num_kv_blocks=64, enable_prefix_caching=False)
    real_step = engine.step

    def slow_step():
        # Pace the engine (20 ms a step) so the first request surely outlives the 429 check,
        # however fast or loaded the machine is.
        time.sleep(0.02)
        return real_step()

    engine.step = slow_step
    with ServerThread(create_app(engine, ServerConfig(MODEL_NAME, max_waiting=1))) as s:
        yield s


def test_full_waiting_queue_is_429(one_slot_server):
    long = {**COMPLETION, "prompt": [3] * 8, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=one_slot_server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=long) as running:
            # The first request holds the only slot. Keep its line iterator alive: a discarded
            # httpx iterator closes the response, which the server takes as a disconnect.
            lines = running.iter_lines()
            next(lines)
            with c.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # accepted, queued
                err = assert_error(c.post("/v1/completions", json=COMPLETION), 429)
                assert err["type"] == "rate_limit_error"
        # both streams closed (aborted): the queue drains and requests are accepted again
        deadline = time.monotonic() + 10
        while True:
            r = c.post("/v1/completions", json=COMPLETION)
            if r.status_code == 200:
                break
            assert r.status_code == 429 and time.monotonic() < deadline
            time.sleep(0.05)
