"""The server with speculative decoding: streamed text equals the unstreamed text (a step may
emit several tokens in one chunk), greedy output equals a server without it, and the
`spec_decode_*` metrics move."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, make_engine, read_metrics
from tests.server.helpers import ServerThread
from tilellm.assets import copy_model_path

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _prompts() -> list[str]:
    from tilellm.demo import copy_task

    meta = {"prefix": "Rewrite the record with the change.\n"}
    return [p.prompt for p in copy_task.problems_for_model(meta, 4, seed=3)]


@pytest.fixture(scope="module")
def servers():
    """One server with n-gram speculation and one without, on the embedded record-editing model."""
    from tilellm.server import ServerConfig, create_app

    config = ServerConfig(MODEL_NAME, api_key=API_KEY)
    with (
        ServerThread(
            create_app(make_engine(str(copy_model_path()), speculative_config=SPEC), config)
        ) as spec,
        ServerThread(create_app(make_engine(str(copy_model_path())), config)) as plain,
    ):
        yield spec, plain


def _client(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})


def _complete(http: httpx.Client, prompt: str) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 150, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_streamed_equals_unstreamed_and_plain_server(servers):
    import openai

    spec, plain = servers
    before = read_metrics(_client(spec))
    client = openai.OpenAI(base_url=spec.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    multi_token_chunks = 0
    for prompt in _prompts():
        with _client(spec) as http, _client(plain) as http_plain:
            whole = _complete(http, prompt)
            assert whole["text"] == _complete(http_plain, prompt)["text"]
        stream = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=150, temperature=0, stream=True
        )
        pieces = [c.choices[0].text for c in stream if c.choices]
        assert "".join(pieces) == whole["text"]
        multi_token_chunks += sum(len(p) > 1 for p in pieces)  # one character is one token here
    assert multi_token_chunks > 0
    after = read_metrics(_client(spec))
    assert after["spec_decode_num_drafts_total"] > before.get("spec_decode_num_drafts_total", 0)
    assert after["spec_decode_num_draft_tokens_total"] > before.get("spec_decode_num_draft_tokens_total", 0)
    accepted = after["spec_decode_num_accepted_tokens_total"]
    assert accepted > before.get("spec_decode_num_accepted_tokens_total", 0)
    # The per-position counters sum to the accepted tokens.
    assert after["spec_decode_num_accepted_tokens_per_pos_total"] == accepted
    assert "spec_decode_num_drafts_total" not in read_metrics(_client(plain))


def test_per_position_metrics_have_a_position_label(servers):
    spec, _ = servers
    text = _client(spec).get("/metrics").text
    lines = [
        ln for ln in text.splitlines() if ln.startswith("tilellm:spec_decode_num_accepted_tokens_per_pos")
    ]
    positions = sorted(ln.split('position="')[1].split('"')[0] for ln in lines if "position=" in ln)
    assert positions == ["0", "1", "2", "3"]


def test_serve_command_takes_the_flag(capsys):
    """`tilellm serve --speculative-config` with a bad key: one line naming it, exit 2."""
    from tilellm.cli import main

    assert main(["serve", "--device", "cpu", "--speculative-config", '{"method": "medusa"}']) == 2
    err = capsys.readouterr().err
    assert "--speculative-config's method must be one of ngram, draft_model" in err
    assert "Traceback" not in err
