"""Servers for the tests: a real uvicorn on 127.0.0.1 (free port, background thread) around a real
`LLMEngine` on a tiny random model, on CPU with a small KV pool."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import ServerThread

API_KEY = "test-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tilellm.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# The test engine: CPU, fp32, a small KV pool.
ENGINE_KWARGS = dict(
    device="cpu",
    dtype="float32",
    block_size=16,
    num_kv_blocks=512,
    max_num_seqs=96,
    max_model_len=MAX_MODEL_LEN,
    enable_prefix_caching=True,
    seed=0,
)


def make_engine(model_dir: str, **overrides):
    from tilellm.engine.llm_engine import LLMEngine

    return LLMEngine(model_dir, **{**ENGINE_KWARGS, **overrides})


def read_metrics(http: httpx.Client) -> dict[str, float]:
    """The server's `tilellm:` metrics, summed over labels (histogram buckets left out)."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("tilellm:") and "_bucket{" not in line:
            name = line[len("tilellm:") :].split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """The shared server: API key set, small body limit, room for 96 running requests."""
    from tilellm.server import ServerConfig, create_app

    engine = make_engine(tiny_model_dir)
    config = ServerConfig(MODEL_NAME, api_key=API_KEY, max_waiting=256, max_request_bytes=MAX_REQUEST_BYTES)
    with ServerThread(create_app(engine, config)) as s:
        s.engine = engine
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    """The response is `status` with OpenAI's error body; returns the error object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert "Traceback" not in err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


def assert_serving(http: httpx.Client) -> None:
    """The server still answers a normal request."""
    r = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """The tiny model with room for the tools' text in its prompts (1024 positions), `auto` on
    (`--tool-call-parser hermes --enable-auto-tool-choice`)."""
    from tilellm.server import ServerConfig, create_app
    from tilellm.testing import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tools_model"), max_position_embeddings=1024))
    engine = make_engine(model_dir, max_model_len=1024)
    config = ServerConfig(MODEL_NAME, tool_call_parser="hermes", enable_auto_tool_choice=True)
    with ServerThread(create_app(engine, config)) as s:
        yield s


@pytest.fixture(scope="module")
def tclient(tool_server):
    import openai

    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def thttp(tool_server):
    with tool_server.client() as c:
        yield c
