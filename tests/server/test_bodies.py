"""Large bodies parsed in the worker process (`tilellm.server.bodies`) answer exactly what FastAPI's
own path answers: every body is sent twice, once parsed on the event loop and once by the worker,
and the two responses must be equal (status, OpenAI error body, the ignored-fields header, the
generated text). A dead worker costs nothing but a fallback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, make_engine
from tests.server.helpers import ServerThread

MAX_MODEL_LEN = 256
PROMPT_IDS = [5, 17, 33, 8, 21, 40]
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from tilellm.server import ServerConfig, create_app

    app = create_app(make_engine(tiny_model_dir), ServerConfig(MODEL_NAME))
    with ServerThread(app) as s:
        s.app = app
        yield s


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


OK = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
TOO_LONG = {**OK, "prompt": [5] * (MAX_MODEL_LEN + 50)}

# (name, path, body): each answered the same by both paths
CASES = [
    ("invalid_json", "/v1/completions", b'{"model": "tiny", "prompt": '),
    ("not_utf8", "/v1/completions", b"\xff\xfe{}"),
    ("not_an_object", "/v1/completions", b"[1, 2]"),
    ("json_string", "/v1/completions", b'"text"'),
    ("deeply_nested", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    ("max_tokens_string", "/v1/completions", _j({**OK, "max_tokens": "5"})),
    ("max_tokens_float", "/v1/completions", _j({**OK, "max_tokens": 4.0})),
    ("temperature_string", "/v1/completions", _j({**OK, "temperature": "0.5"})),
    ("n_zero", "/v1/completions", _j({**OK, "n": 0})),
    ("prompt_bools", "/v1/completions", _j({**OK, "prompt": [True, False]})),
    ("prompt_negative_id", "/v1/completions", _j({**OK, "prompt": [5, -1]})),
    ("prompt_missing", "/v1/completions", _j({"model": MODEL_NAME})),
    ("unknown_model", "/v1/completions", _j({**OK, "model": "no-such-model"})),
    ("token_ids_over_max_model_len", "/v1/completions", _j(TOO_LONG)),
    ("unknown_model_and_too_long", "/v1/completions", _j({**TOO_LONG, "model": "no-such-model"})),
    ("completion", "/v1/completions", _j(OK)),
    ("completion_unknown_fields", "/v1/completions", _j({**OK, "x_extra": 1, "y": [1]})),
    ("completion_batch", "/v1/completions", _j({**OK, "prompt": [PROMPT_IDS, PROMPT_IDS[:3]]})),
    ("messages_string", "/v1/chat/completions", _j({**CHAT, "messages": "hi"})),
    ("messages_empty", "/v1/chat/completions", _j({**CHAT, "messages": []})),
    ("bad_role", "/v1/chat/completions", _j({**CHAT, "messages": [{"role": "wizard", "content": "1"}]})),
    ("chat_stop_int", "/v1/chat/completions", _j({**CHAT, "stop": 5})),
    ("chat", "/v1/chat/completions", _j(CHAT)),
    (
        "responses",
        "/v1/responses",
        _j({"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, "temperature": 0}),
    ),
    ("responses_bad_input", "/v1/responses", _j({"model": MODEL_NAME, "input": 5})),
    ("tokenize", "/tokenize", _j({"model": MODEL_NAME, "prompt": "Hello"})),
    ("tokenize_bad_role", "/tokenize", _j({"messages": [{"role": "wizard", "content": "1"}]})),
    ("detokenize", "/detokenize", _j({"tokens": PROMPT_IDS})),
    ("detokenize_negative", "/detokenize", _j({"tokens": [1, -2]})),
]

_VOLATILE = ("id", "created", "created_at", "system_fingerprint")  # differ between any two responses


def _comparable(resp: httpx.Response) -> tuple:
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in _VOLATILE}
        if isinstance(body.get("output"), list):  # /v1/responses: items carry ids too
            body["output"] = [{k: v for k, v in item.items() if k != "id"} for item in body["output"]]
    return resp.status_code, body, resp.headers.get("x-ignored-fields")


class _CountingJSON:
    """Stands in for `json` in Starlette's and FastAPI's request modules: counts the bodies they
    parse (whichever of the two parses a body in a given version)."""

    def __init__(self):
        self.calls = 0

    def loads(self, *args, **kwargs):
        self.calls += 1
        return json.loads(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(json, name)


def _send(
    served, path: str, body: bytes, inline_max_bytes: int, content_type: str | None = "application/json"
) -> tuple[tuple, int, int]:
    """(the comparable response, bodies the worker answered, bodies Starlette parsed itself)."""
    import fastapi.routing
    import starlette.requests

    parser = served.app.state.body_parser
    parser.inline_max_bytes = inline_max_bytes
    before = parser.offloaded
    counting = _CountingJSON()
    modules = (starlette.requests, fastapi.routing)
    for module in modules:
        module.json = counting
    try:
        with served.client() as http:
            headers = {"content-type": content_type} if content_type else {}
            resp = http.post(path, content=body, headers=headers)
    finally:
        parser.inline_max_bytes = 1 << 62
        for module in modules:
            module.json = json
    return _comparable(resp), parser.offloaded - before, counting.calls


@pytest.mark.parametrize("name,path,body", CASES, ids=[c[0] for c in CASES])
def test_worker_answers_as_fastapi_does(served, name, path, body):
    inline, inline_offloaded, inline_parsed = _send(served, path, body, 1 << 62)
    worker, worker_offloaded, worker_parsed = _send(served, path, body, 0)
    assert inline_offloaded == 0 and inline_parsed == 1
    assert worker == inline
    if name not in ("not_utf8", "deeply_nested"):  # FastAPI's own path answers those two
        assert worker_offloaded == 1, "the body was not parsed by the worker"
        assert worker_parsed == 0, "the worker's model was not used: the body was parsed again on the loop"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json; charset=utf-8"])
def test_content_types_are_treated_as_fastapi_treats_them(served, content_type):
    for body in (_j(OK), _j({**OK, "max_tokens": "5"})):
        inline = _send(served, "/v1/completions", body, 1 << 62, content_type)[0]
        worker = _send(served, "/v1/completions", body, 0, content_type)[0]
        assert worker == inline


def test_a_worker_that_keeps_failing_is_given_up():
    from tilellm.server.bodies import MAX_FAILURES, BodyParser

    class Unpicklable:  # a local class: the call cannot reach the worker
        pass

    async def run() -> list:
        parser = BodyParser(0)
        try:
            return [await parser.parse("POST /x", Unpicklable, b"{}") for _ in range(MAX_FAILURES)]
        finally:
            parser.close()

    parser_answers = asyncio.run(run())
    assert parser_answers == [None] * MAX_FAILURES  # each body falls back to FastAPI's path
    parser = BodyParser(0)
    parser.failures = MAX_FAILURES
    assert not parser.wants(b"{}")
    parser.failures = 0
    assert parser.wants(b"{}")
    parser.close()
    assert not parser.wants(b"{}")  # closed: parsed on the loop


def test_a_dead_worker_is_replaced(served):
    known = {p.pid for p in multiprocessing.active_children()}
    body = _j(OK)
    expected = _send(served, "/v1/completions", body, 1 << 62)[0]
    assert _send(served, "/v1/completions", body, 0)[:2] == (expected, 1)
    workers = [p for p in multiprocessing.active_children() if p.pid not in known]
    if not workers:  # it was started by an earlier test
        workers = [p for p in multiprocessing.active_children() if p.name.startswith("SpawnProcess")]
    assert workers, "no worker process found"
    for p in workers:
        with contextlib.suppress(ProcessLookupError):  # a process of another test may have exited
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    time.sleep(0.2)
    # The request that finds the worker dead is parsed on the loop; the next one by a new worker.
    assert _send(served, "/v1/completions", body, 0)[0] == expected
    assert _send(served, "/v1/completions", body, 0)[:2] == (expected, 1)
