"""Stop strings are bounded (count and total length: a 400 naming the limit, a ValueError offline)
and matched incrementally: only the text a token added, with a window of the longest stop string."""

from __future__ import annotations

import pytest

from tests.server.conftest import assert_error


def test_too_many_stop_strings_are_a_400_naming_the_limit(http):
    from tilellm.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    many = [f"s{i}" for i in range(5000)]  # (the shared server takes 64 KiB bodies)
    err = assert_error(http.post("/v1/completions", json={**body, "stop": many}), 400, "stop")
    assert str(MAX_STOP_STRINGS) in err["message"]
    long = ["x" * (MAX_STOP_CHARS // 2 + 1)] * 2
    err = assert_error(http.post("/v1/completions", json={**body, "stop": long}), 400, "stop")
    assert str(MAX_STOP_CHARS) in err["message"]
    ok = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert http.post("/v1/completions", json={**body, "stop": ok}).status_code == 200


def test_offline_stop_limits():
    from tilellm import SamplingParams
    from tilellm.engine.sampling_params import MAX_STOP_STRINGS

    with pytest.raises(ValueError, match="stop has"):
        SamplingParams(stop=["a"] * (MAX_STOP_STRINGS + 1))
    assert SamplingParams(stop=["ab", "abcd"]).longest_stop == 4


def test_find_stop_string_looks_only_at_the_new_text_and_its_window():
    from tilellm.engine.llm_engine import find_stop_string

    # "END" wholly inside the old text was already reported: not found again
    assert find_stop_string("xx END yy" + "z", 1, ["END"], 3) is None
    # a stop string that the new characters complete, begun in the old text
    text = "hello EN" + "D!"
    assert find_stop_string(text, 2, ["END"], 3) == (6, "END")
    # the earliest of several matches
    assert find_stop_string("aaXYbZ", 4, ["bZ", "XY"], 2) == (2, "XY")
