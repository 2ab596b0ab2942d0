"""Serving a config-only model (`load_format="dummy"`, random weights), as the serving benchmark does:
without a tokenizer (`--skip-tokenizer-init`: token ids in, `token_ids` out, empty text), and with
a tokenizer whose vocabulary is smaller than the model's (ids it cannot decode give no text)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.server.conftest import assert_error, make_engine
from tests.server.helpers import ServerThread

# Qwen3's architecture at toy size; 1000 ids, more than the embedded model's tokenizer knows.
DUMMY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "eos_token_id": 999,
}


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory) -> str:
    from tilellm.testing import make_random_model_dir

    return str(make_random_model_dir(tmp_path_factory.mktemp("dummy"), DUMMY_CONFIG))


def _serve(model_dir: str, **engine_overrides) -> ServerThread:
    from tilellm.server import ServerConfig, create_app

    engine = make_engine(model_dir, load_format="dummy", **engine_overrides)
    return ServerThread(create_app(engine, ServerConfig("dummy")))


def _stream(http: httpx.Client, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.fixture(scope="module")
def no_tokenizer(dummy_dir):
    with _serve(dummy_dir, skip_tokenizer_init=True) as s:
        with s.client() as http:
            yield http


def test_stream_token_ids_without_tokenizer(no_tokenizer):
    prompt = [3, 141, 592, 653, 589, 793, 238, 462, 643, 383, 279, 502]
    body = {"model": "dummy", "prompt": prompt, "max_tokens": 9, "ignore_eos": True, "temperature": 0.6}
    chunks = _stream(no_tokenizer, {**body, "stream_options": {"include_usage": True}})
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert len(ids) == 9 and all(0 <= t < 1000 for t in ids)
    assert all(ch["text"] == "" for c in chunks for ch in c["choices"])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}

    r = no_tokenizer.post("/v1/completions", json={**body, "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 9
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "Hello"}, "prompt"),
        ({"prompt": [1, 2, 3], "echo": True}, "echo"),
        ({"prompt": [1, 2, 3], "stop": ["x"]}, "stop"),
        ({"prompt": [1, 2, 1000]}, "prompt"),  # outside the model's vocabulary
    ],
    ids=["text-prompt", "echo", "stop-string", "id-out-of-vocab"],
)
def test_what_needs_a_tokenizer_is_a_400(no_tokenizer, body, param):
    r = no_tokenizer.post("/v1/completions", json={"model": "dummy", "max_tokens": 2, **body})
    assert_error(r, 400, param)


def test_chat_without_tokenizer_is_a_400(no_tokenizer):
    r = no_tokenizer.post(
        "/v1/chat/completions", json={"model": "dummy", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert "--skip-tokenizer-init" in assert_error(r, 400, "messages")["message"]


def test_tokenizer_smaller_than_the_vocabulary(dummy_dir, tmp_path):
    """Ids the tokenizer does not know decode to nothing: no crash, usage stays exact."""
    from tilellm.assets import default_model_path

    model = tmp_path / "dummy-with-tokenizer"
    shutil.copytree(dummy_dir, model)
    src = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, model / name)
    with _serve(str(model)) as s, s.client() as http:
        body = {"model": "dummy", "prompt": [5, 900, 6, 7], "max_tokens": 12, "ignore_eos": True}
        chunks = _stream(http, {**body, "return_token_ids": True})
        assert sum(len(ch["token_ids"]) for c in chunks for ch in c["choices"]) == 12
        r = http.post("/v1/completions", json={**body, "prompt": "1+2=", "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        assert "token_ids" not in r.json()["choices"][0]  # only when asked, with a tokenizer


def test_serve_needs_a_tokenizer_or_the_flag(dummy_dir, capsys):
    from tilellm.cli import main

    assert main(["serve", dummy_dir, "--load-format", "dummy"]) == 2
    assert "--skip-tokenizer-init" in capsys.readouterr().err


def test_serve_dummy_cli_and_bench_serve(dummy_dir, tmp_path):
    """The serving benchmark's path: `tilellm serve --load-format dummy --skip-tokenizer-init`, then
    `tilellm bench serve` with E1's lengths scaled down, SIGTERM, exit 0."""
    import signal
    import subprocess
    import sys

    from tests.server.test_cli import _free_port, _wait_healthy
    from tilellm.cli import main

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tilellm.cli", "serve", dummy_dir, "--port", str(port), "--device", "cpu"]
    cmd += ["--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "64"]
    cmd += ["--num-kv-blocks", "64", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, url)
        out = tmp_path / "bench.json"
        argv = ["bench", "serve", "--base-url", url, "--scale", "0.02", "--token-id-max", "999"]
        argv += ["--prompt-id-offset", "7", "--json", str(out)]
        assert main(argv) == 0
        result = json.loads(out.read_text())
        from tilellm.bench.serve import make_workload

        work = make_workload(5, None, None, 999, 0, scale=0.02)
        assert result["completed"] == 5 and result["failed"] == 0
        assert result["total_output_tokens"] == sum(work.max_tokens)
        assert result["total_input_tokens"] == sum(len(p) for p in work.prompts)
        assert result["p50_ttft_ms"] > 0 and result["output_throughput"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_serve_workload_matches_throughput_e1():
    from tilellm.bench.serve import make_workload
    from tilellm.bench.throughput import e1

    for scale in (1.0, 0.02):
        w = e1(scale)
        ours = make_workload(len(w.prompts), None, None, 10000, 0, scale=scale)
        assert ours.prompts == w.prompts and ours.max_tokens == w.max_tokens
    shifted = make_workload(4, None, None, 10000, 0, scale=0.02, prompt_id_offset=3)
    base = make_workload(4, None, None, 10000, 0, scale=0.02)
    assert shifted.max_tokens == base.max_tokens
    assert shifted.prompts == [[(t + 3) % 10001 for t in p] for p in base.prompts]


def test_async_scheduling_streams_the_same_tokens(dummy_dir):
    """`tilellm serve` turns asynchronous scheduling on on CUDA; through the engine thread it gives
    the same greedy tokens as synchronous steps, and a stream cut mid-way leaves the server serving."""
    prompts = [[7, 8, 9, 10, 11], [400, 401, 402], [5] * 20]
    body = {"model": "dummy", "max_tokens": 10, "ignore_eos": True, "temperature": 0}
    results = []
    for async_scheduling in (False, True):
        from tilellm.server import ServerConfig, create_app

        engine = make_engine(dummy_dir, load_format="dummy", skip_tokenizer_init=True)
        engine.async_scheduling = async_scheduling
        with ServerThread(create_app(engine, ServerConfig("dummy"))) as s, s.client() as http:
            r = http.post("/v1/completions", json={**body, "prompt": prompts})
            assert r.status_code == 200, r.text
            results.append([c["token_ids"] for c in r.json()["choices"]])
            streamed = [
                [
                    t
                    for c in _stream(http, {**body, "prompt": p})
                    for ch in c["choices"]
                    for t in ch["token_ids"]
                ]
                for p in prompts
            ]
            assert streamed == results[-1]
            with http.stream(
                "POST", "/v1/completions", json={**body, "prompt": prompts[0], "stream": True}
            ) as resp:
                next(ln for ln in resp.iter_lines() if ln.startswith("data: "))  # then hang up
            r = http.post("/v1/completions", json={**body, "prompt": prompts[1], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == results[-1][1][:3]
    assert results[0] == results[1] and all(len(ids) == 10 for ids in results[0])
