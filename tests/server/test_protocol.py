"""Strict request types, as OpenAI validates them: no string, float or bool passes for an integer,
no string for a number or a boolean; the offline API rejects the same values."""

from __future__ import annotations

import pytest

from tests.server.conftest import assert_error

BAD = [
    ("max_tokens", "5"),
    ("max_tokens", 4.0),
    ("max_tokens", True),
    ("temperature", "0.5"),
    ("n", "2"),
    ("n", 2.0),
    ("seed", "1"),
    ("top_k", 5.0),
    ("min_tokens", False),
    ("stream", "yes"),
    ("stream", 1),
    ("ignore_eos", "true"),
    ("stop", 5),
    ("stop_token_ids", [1.0]),
    ("prompt", [True, False]),
    ("prompt", [1, True]),  # one bool among ints
    ("prompt", [4.0, 5.0]),
    ("prompt", [[1, 2], [3, -1]]),  # a negative id in the second prompt
    ("prompt", 5),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_the_server_rejects_coerced_types(http, field, value):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, field: value}
    err = assert_error(http.post("/v1/completions", json=body), 400)
    assert err["param"].startswith(field), err


def test_an_int_is_a_valid_float(http):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0, "top_p": 1}
    assert http.post("/v1/completions", json=body).status_code == 200


OFFLINE = [(f, v) for f, v in BAD if f not in ("stream", "prompt")]


@pytest.mark.parametrize("field,value", OFFLINE, ids=[f"{f}={v!r}" for f, v in OFFLINE])
def test_offline_sampling_params_reject_the_same(field, value):
    from tilellm import SamplingParams

    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("prompt", [[True, False], [4.0, 5.0]])
def test_offline_prompts_reject_the_same(server, prompt):
    from tilellm import SamplingParams

    with pytest.raises(ValueError, match="token ids must be integers"):
        server.engine.add_request("strict", prompt, SamplingParams(max_tokens=2))
