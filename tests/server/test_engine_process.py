"""The server with its engine in a separate process (`EngineProcess`, `tilellm serve`'s default):
the same answers as the in-process engine, errors and disconnects handled across the pipe, and a
dead engine process turns /health red and fails the requests in flight instead of hanging them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.server import conftest
from tests.server.conftest import MAX_MODEL_LEN, assert_error, read_metrics
from tests.server.helpers import ServerThread

KEY = "process-key"
NAME = "tiny-process"
ENGINE_KWARGS = dict(conftest.ENGINE_KWARGS, max_num_seqs=64)


def _start(model_dir: str, max_waiting: int = 128, **overrides):
    from tilellm.server import ServerConfig, create_app
    from tilellm.server.engine_process import EngineProcess

    engine = EngineProcess(model_dir, dict(ENGINE_KWARGS, **overrides))
    config = ServerConfig(NAME, api_key=KEY, max_waiting=max_waiting)
    return engine, ServerThread(create_app(engine, config))


def _assert_drained(engine) -> None:
    """Nothing in flight: the server side's routing tables and queue count are back to empty."""
    deadline = time.monotonic() + 20
    while engine._queues or engine._qid_of or engine._futures or engine._pending_adds:
        assert time.monotonic() < deadline, (
            engine._queues,
            engine._qid_of,
            engine._futures,
            engine._pending_adds,
        )
        time.sleep(0.05)


@pytest.fixture(scope="module")
def proc_server(tiny_model_dir):
    engine, thread = _start(tiny_model_dir)
    with thread as s:
        s.engine = engine
        yield s
        _assert_drained(engine)  # after every test of the module
    assert not engine._proc.is_alive(), "the engine process outlived the server"


def _returns_a_lock(engine):  # a call() result that cannot be pickled
    import threading

    return threading.Lock()


def _num_waiting(engine):
    return engine.scheduler.num_waiting


@pytest.fixture
def http(proc_server):
    with httpx.Client(base_url=proc_server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_answers_equal_the_in_process_engine(proc_server, server):
    """Greedy completions, streamed and not, and chat, as the thread-backed server gives them."""
    import openai

    here = openai.OpenAI(base_url=proc_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    there = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key", max_retries=0, timeout=60)
    for prompt in ["Hello there", "1 2 3 4", "z"]:
        kw = dict(prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
        a = here.completions.create(model=NAME, **kw)
        b = there.completions.create(model="tiny", **kw)
        assert a.choices[0].text == b.choices[0].text
        assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
        assert a.usage == b.usage
        streamed = "".join(
            c.choices[0].text for c in here.completions.create(model=NAME, stream=True, **kw) if c.choices
        )
        assert streamed == a.choices[0].text
    msgs = [{"role": "user", "content": "Say something"}]
    a = here.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0, n=2)
    b = there.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, n=2)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_concurrent_streams_each_equal_alone(proc_server):
    import openai

    client = openai.AsyncOpenAI(base_url=proc_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    prompts = [[5 + i, 9, 11 + i % 7, 3] for i in range(24)]

    async def one(p, stream):
        kw = dict(model=NAME, prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            r = await client.completions.create(**kw)
            return r.choices[0].text
        parts = []
        async for c in await client.completions.create(stream=True, **kw):
            parts += [ch.text for ch in c.choices]
        return "".join(parts)

    async def run():
        together = await asyncio.gather(*(one(p, True) for p in prompts))
        alone = [await one(p, False) for p in prompts[:6]]
        return together, alone

    together, alone = asyncio.run(run())
    assert together[:6] == alone
    assert all(together)


def test_errors_cross_the_pipe_and_serving_goes_on(proc_server, http):
    r = http.post(
        "/v1/completions", json={"model": NAME, "prompt": [7] * (MAX_MODEL_LEN + 1), "max_tokens": 1}
    )
    assert_error(r, 400)
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_disconnect_frees_blocks_and_inspect_works(proc_server, http):
    body = {"model": NAME, "prompt": [4] * 40, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))
        assert read_metrics(http)["kv_blocks_used"] > 0
    deadline = time.monotonic() + 20
    while read_metrics(http)["kv_blocks_used"] > 0:  # the abort travels to the engine process
        assert time.monotonic() < deadline, "blocks of the disconnected request were not freed"
        time.sleep(0.05)
    m = read_metrics(http)
    assert m["num_requests_running"] == 0 and m["request_success_total"] >= 1
    page = http.get("/inspect")  # a function call run in the engine process
    assert page.status_code == 200 and "<html" in page.text.lower()


def test_calls_whose_function_or_result_cannot_cross(proc_server, http):
    engine = proc_server.engine
    with pytest.raises(RuntimeError, match="cannot send"):
        asyncio.run_coroutine_threadsafe(engine.call(lambda e: 1), engine._loop).result(20)
    with pytest.raises(RuntimeError, match="cannot cross"):
        asyncio.run_coroutine_threadsafe(engine.call(_returns_a_lock), engine._loop).result(20)
    assert asyncio.run_coroutine_threadsafe(engine.call(_num_waiting), engine._loop).result(20) == 0
    _assert_drained(engine)
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_queue_full_across_the_pipe(tiny_model_dir):
    """429 once the waiting queue is full, then every table drains and the server still serves."""
    engine, thread = _start(tiny_model_dir, max_waiting=3, max_num_seqs=2)
    with thread as s:

        async def burst():
            headers = {"Authorization": f"Bearer {KEY}"}
            body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=s.url, headers=headers, timeout=60) as c:
                rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))
            return [r.status_code for r in rs], rs

        codes, rs = asyncio.run(burst())
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        assert_error(next(r for r in rs if r.status_code == 429), 429)
        _assert_drained(engine)
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
        assert r.status_code == 200


def test_dead_engine_process_fails_requests_and_stops_the_server(tiny_model_dir):
    """kill -9 of the engine process: the stream in flight ends with an error event (engine_dead)
    and [DONE], and the server stops by itself with exit status 1 (a supervisor restarts it)."""
    engine, thread = _start(tiny_model_dir)
    with thread as s:
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(s.url + "/health").status_code == 200
        body = {"model": NAME, "prompt": [4] * 8, "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers=headers, timeout=60) as resp:
            lines = resp.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))
            os.kill(engine.pid, signal.SIGKILL)
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        errors = [json.loads(ln[6:]) for ln in rest if ln != "data: [DONE]" and "error" in ln]
        assert errors and errors[0]["error"]["code"] == "engine_dead", rest[-3:]
        thread.thread.join(30)
        assert not thread.thread.is_alive(), "the server outlived its engine"
        assert thread.server.exit_code == 1


def test_engine_that_cannot_start_names_the_problem(tmp_path):
    from tilellm.server.engine_process import EngineProcess

    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(RuntimeError, match="NoSuchForCausalLM"):
        EngineProcess(str(tmp_path), {"device": "cpu", "skip_tokenizer_init": True})


def test_tensor_parallel_engine_process(tiny_model_dir, proc_server):
    """The engine process can itself start tensor-parallel workers (gloo on CPU): same greedy text
    as one rank, and no process left behind after stop."""
    import multiprocessing

    from tilellm.server import ServerConfig, create_app
    from tilellm.server.engine_process import EngineProcess

    engine = EngineProcess(tiny_model_dir, dict(ENGINE_KWARGS, tensor_parallel_size=2))
    body = {"model": NAME, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    with ServerThread(create_app(engine, ServerConfig(NAME, api_key=KEY))) as s:
        r = httpx.post(
            s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        assert r.status_code == 200, r.text
    one = httpx.post(
        proc_server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert r.json()["choices"][0]["text"] == one.json()["choices"][0]["text"]
    assert not engine._proc.is_alive()
    others = [c for c in multiprocessing.active_children() if c.pid != proc_server.engine._proc.pid]
    assert not others, others
