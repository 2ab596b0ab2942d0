"""The request path of `serving.py`: tokenization off the event loop, and a text prompt too long
to fit refused by its length in characters before any of it is tokenized."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import assert_error
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import ServerThread


class SlowTokenizer:
    """The tiny tokenizer, with an `encode` that holds its thread for `delay` s (a huge prompt)."""

    def __init__(self, tokenizer, delay: float):
        self._tok = tokenizer
        self.delay = delay
        self.encoded_chars = 0

    def encode(self, text, **kw):
        self.encoded_chars += len(text)
        time.sleep(self.delay)
        return self._tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


def _serve(tokenizer):
    from tilellm.server import ServerConfig, create_app

    engine = FakeEngine(tokenizer)
    s = ServerThread(create_app(engine, ServerConfig("fake")))
    s.engine = engine
    return s


def test_tokenizing_does_not_block_the_event_loop(tokenizer):
    slow = SlowTokenizer(tokenizer, delay=2.0)
    with _serve(slow) as s, s.client() as http:
        t = threading.Thread(
            target=lambda: http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        )
        t.start()
        while not slow.encoded_chars:
            time.sleep(0.01)
        start = time.monotonic()
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - start < 1.0, "/health waited for a tokenization"
        t.join(30)


def test_a_prompt_with_too_many_characters_is_refused_before_tokenizing(tokenizer):
    from tilellm.server.serving import longest_token_chars

    slow = SlowTokenizer(tokenizer, delay=0.0)
    limit = 256 * longest_token_chars(tokenizer)
    with _serve(slow) as s, s.client() as http:
        for body, path in [
            ({"prompt": "a" * (limit + 1)}, "/v1/completions"),
            ({"messages": [{"role": "user", "content": "a" * (limit + 1)}]}, "/v1/chat/completions"),
        ]:
            err = assert_error(http.post(path, json=body), 400)
            assert f"at most {limit} characters" in err["message"]
        assert slow.encoded_chars == 0
        # at the bound it is tokenized (and here too long in tokens: a 400 from the token count)
        assert_error(http.post("/v1/completions", json={"prompt": "a " * (limit // 2)}), 400)
        assert slow.encoded_chars == 2 * (limit // 2)


def test_longest_token_chars_bounds_every_token(tokenizer):
    from tilellm.server.serving import longest_token_chars

    longest = longest_token_chars(tokenizer)
    for i in range(len(tokenizer)):
        assert len(tokenizer.decode([i])) <= longest
