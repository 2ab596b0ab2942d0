"""Penalties, logit_bias and allowed_token_ids through the server: the tokens of the offline
engine with the same SamplingParams (greedy), for completions and chat."""

from __future__ import annotations

import pytest

from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME, assert_serving
from tilellm import LLM, SamplingParams

OPTIONS = [
    {"presence_penalty": 1.2},
    {"frequency_penalty": 0.8, "presence_penalty": -0.3},
    {"repetition_penalty": 1.5},
    {"logit_bias": {"11": 30.0, "12": -100}},
    {"allowed_token_ids": [3, 4, 5, 200]},
]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE_KWARGS)


def _params(options: dict) -> SamplingParams:
    kw = dict(options)
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **kw)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
def test_completion_tokens_equal_offline(http, offline, options):
    body = {"model": MODEL_NAME, "prompt": "Hello hello hello", "max_tokens": 10, "temperature": 0}
    body.update(ignore_eos=True, return_token_ids=True, **options)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    want = offline.generate(["Hello hello hello"], _params(options), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    plain = offline.generate(["Hello hello hello"], _params({}), use_tqdm=False)[0].outputs[0].token_ids
    assert got != plain  # the option changed the output: the test would see it ignored


def test_chat_takes_the_penalties_through_the_openai_client(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "say it again and again"}],
        max_tokens=8,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={"7": 2.0},
        extra_body={"repetition_penalty": 1.2},
    )
    assert out.choices[0].message.content is not None


def test_a_neutral_request_still_serves(http):
    assert_serving(http)


def test_generation_config_defaults_fill_unset_fields(tiny_model_dir, tmp_path):
    """A server on a model whose generation_config.json asks for greedy decoding: requests that
    leave temperature unset are greedy; a request's own temperature wins."""
    import json
    import shutil

    import httpx

    from tests.server.conftest import API_KEY, make_engine
    from tests.server.helpers import ServerThread
    from tilellm.server import ServerConfig, create_app

    path = tmp_path / "m"
    shutil.copytree(tiny_model_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))
    app = create_app(make_engine(str(path)), ServerConfig(MODEL_NAME, api_key=API_KEY))
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon",
        "max_tokens": 8,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with ServerThread(app) as s:
        with httpx.Client(base_url=s.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            runs = [
                http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(3)
            ]
            assert runs[0] == runs[1] == runs[2]  # greedy
            hot = {**body, "temperature": 1.5}
            sampled = {
                tuple(http.post("/v1/completions", json=hot).json()["choices"][0]["token_ids"])
                for _ in range(4)
            }
            assert len(sampled) > 1
