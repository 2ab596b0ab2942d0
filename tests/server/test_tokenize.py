"""POST /tokenize, POST /detokenize and GET /version: the ids are the tokenizer's (a chat the
very prompt /v1/chat/completions runs on), errors are OpenAI's body naming the field, and the
API key guards the two tokenizer routes as it guards /v1."""

from __future__ import annotations

import copy
import socket
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, assert_error
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import ServerThread

TEXTS = ["Hello, world!", "The quick brown fox", "Café, naïve, 東京 🙂", "", "  two  spaces\nand a line"]

CHAT = [
    {"role": "system", "content": "You count."},
    {"role": "user", "content": "One, two, three?"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "then?"}]},
]


def _plain(messages: list[dict]) -> list[dict]:
    """The messages as the chat template sees them (text parts joined)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        out.append({"role": m["role"], "content": content})
    return out


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = tokenizer.apply_chat_template(
        _plain(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """The tiny tokenizer, adding `<|endoftext|>` in front of every text it encodes with special tokens."""
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert tok.encode("Hello")[0] == bos and tok.encode("Hello", add_special_tokens=False)[0] != bos
    return tok


@pytest.fixture(scope="module")
def bos_http(bos_tokenizer):
    from tilellm.server import ServerConfig, create_app

    with ServerThread(create_app(FakeEngine(bos_tokenizer), ServerConfig("fake"))) as s, s.client() as c:
        yield c


@pytest.fixture(scope="module")
def no_tokenizer_http():
    from tilellm.server import ServerConfig, create_app

    with ServerThread(create_app(FakeEngine(None), ServerConfig("fake"))) as s, s.client() as c:
        yield c


def _tokenize(http: httpx.Client, **body) -> dict:
    r = http.post("/tokenize", json={"model": MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}, out
    assert out["count"] == len(out["tokens"])
    return out


# ---- /tokenize: a text prompt ----


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_a_prompt_gives_the_tokenizers_ids(http, tokenizer, text):
    out = _tokenize(http, prompt=text)
    assert out["tokens"] == tokenizer.encode(text)
    assert out["max_model_len"] == MAX_MODEL_LEN
    assert out["token_strs"] is None
    no_special = _tokenize(http, prompt=text, add_special_tokens=False)
    assert no_special["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_add_special_tokens(bos_http, bos_tokenizer):
    bos = bos_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    plain = bos_tokenizer.encode("Hello world", add_special_tokens=False)
    with_special = _tokenize(bos_http, model="fake", prompt="Hello world")
    assert with_special["tokens"] == [bos, *plain] == bos_tokenizer.encode("Hello world")
    assert with_special["count"] == len(plain) + 1
    without = _tokenize(bos_http, model="fake", prompt="Hello world", add_special_tokens=False)
    assert without["tokens"] == plain and without["count"] == len(plain)


def test_tokenize_counts_what_a_completion_is_charged(http):
    """`count` is the prompt's `usage.prompt_tokens` in /v1/completions."""
    prompt = "Once upon a time there was a little robot"
    out = _tokenize(http, prompt=prompt)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == out["count"]


def test_return_token_strs(http, tokenizer):
    text = "Héllo world, 東京"
    out = _tokenize(http, prompt=text, return_token_strs=True)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
    assert len(out["token_strs"]) == out["count"]
    chat = _tokenize(http, messages=CHAT, return_token_strs=True)
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    assert _tokenize(http, prompt=text, return_token_strs=False)["token_strs"] is None


# ---- /tokenize: messages ----


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_messages_render_as_the_chat_template_does(http, tokenizer, add_generation_prompt):
    out = _tokenize(http, messages=CHAT, add_generation_prompt=add_generation_prompt)
    assert out["tokens"] == _chat_ids(tokenizer, CHAT, add_generation_prompt)
    assert out["max_model_len"] == MAX_MODEL_LEN


def test_messages_default_to_a_generation_prompt(http, tokenizer):
    assert _tokenize(http, messages=CHAT)["tokens"] == _chat_ids(tokenizer, CHAT, True)


def test_messages_give_the_prompt_of_a_chat_completion(http):
    """`count` is the `usage.prompt_tokens` /v1/chat/completions reports for the same messages."""
    for add_generation_prompt in (True, False):
        out = _tokenize(http, messages=CHAT, add_generation_prompt=add_generation_prompt)
        body = {
            "model": MODEL_NAME,
            "messages": CHAT,
            "add_generation_prompt": add_generation_prompt,
            "max_tokens": 1,
            "temperature": 0,
        }
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == out["count"]


def test_messages_add_no_special_tokens_of_their_own(bos_http, bos_tokenizer):
    """The chat template writes the special tokens; the tokenizer's BOS is not added on top."""
    out = _tokenize(bos_http, model="fake", messages=CHAT)
    assert out["tokens"] == _chat_ids(bos_tokenizer, CHAT)
    assert out["tokens"][0] != bos_tokenizer.convert_tokens_to_ids("<|endoftext|>")


def test_neutral_values_of_the_chat_options_are_accepted(http, tokenizer):
    out = _tokenize(
        http,
        messages=CHAT,
        continue_final_message=False,
        add_special_tokens=False,
        chat_template_kwargs={},
        unknown_field=1,  # ignored, as on the other endpoints
    )
    assert out["tokens"] == _chat_ids(tokenizer, CHAT)
    assert _tokenize(http, messages=CHAT, chat_template_kwargs=None)["tokens"] == out["tokens"]


def test_chat_template_options_reach_the_template(http, tokenizer):
    """chat_template_kwargs (Qwen3's enable_thinking) and continue_final_message, as the chat
    completions path renders them."""
    no_think = _tokenize(http, messages=CHAT, chat_template_kwargs={"enable_thinking": False})["tokens"]
    text = tokenizer.apply_chat_template(
        _plain(CHAT), tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == tokenizer.encode(text, add_special_tokens=False)
    assert no_think != _chat_ids(tokenizer, CHAT)  # the template saw it
    cont = _tokenize(http, messages=CHAT, add_generation_prompt=False, continue_final_message=True)["tokens"]
    text = tokenizer.apply_chat_template(_plain(CHAT), tokenize=False, continue_final_message=True)
    assert cont == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "option, param",
    [
        ({"continue_final_message": True}, "continue_final_message"),  # needs add_generation_prompt false
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"add_special_tokens": True}, "add_special_tokens"),
    ],
)
def test_chat_options_that_cannot_apply_are_a_400(http, option, param):
    r = http.post("/tokenize", json={"model": MODEL_NAME, "messages": CHAT, **option})
    assert_error(r, 400, param)


# ---- /detokenize ----


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(http, text):
    ids = _tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    r = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


def test_detokenize_is_the_tokenizers_decode(http, tokenizer):
    ids = _tokenize(http, messages=CHAT)["tokens"]  # special tokens included
    r = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert r.json() == {"prompt": tokenizer.decode(ids)}
    assert "<|im_start|>" in r.json()["prompt"]
    top = [0, 1, 200, 383]  # the vocabulary's last id included
    r = http.post("/detokenize", json={"tokens": top})  # `model` may be left out
    assert r.json() == {"prompt": tokenizer.decode(top)}


# ---- errors ----


def test_an_unknown_model_is_a_404_naming_model(http):
    for path, body in [
        ("/tokenize", {"prompt": "hi"}),
        ("/tokenize", {"messages": CHAT}),
        ("/detokenize", {"tokens": [1, 2]}),
    ]:
        err = assert_error(http.post(path, json={"model": "nope", **body}), 404, "model")
        assert err["code"] == "model_not_found"


def test_a_token_id_outside_the_vocabulary_is_a_400_naming_tokens(http, server):
    vocab = server.engine.model_config.vocab_size
    r = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": [1, vocab, 2]})
    err = assert_error(r, 400, "tokens")
    assert str(vocab) in err["message"]
    assert_error(http.post("/detokenize", json={"tokens": [1, 10**12]}), 400, "tokens")
    assert_error(http.post("/detokenize", json={"tokens": [1, -1]}), 400, "tokens[1]")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"model": MODEL_NAME}, "prompt"),
        ("/tokenize", {"prompt": None}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": 1}, "add_special_tokens"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": "true"}, "return_token_strs"),
        ("/tokenize", {"prompt": "hi", "model": 3}, "model"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"messages": None}, "messages"),
        ("/tokenize", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": 0}, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "return_token_strs": 1}, "return_token_strs"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": None}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
        ("/detokenize", {"tokens": [1.0]}, "tokens[0]"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]"),
        ("/detokenize", {"tokens": [1], "model": ["tiny"]}, "model"),
    ],
)
def test_missing_fields_and_wrong_types_are_a_400_naming_the_field(http, path, body, param):
    err = assert_error(http.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_body_that_is_not_an_object_is_a_400(http, path):
    for content in (b"[1, 2]", b'"hi"', b"{not json", b""):
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert_error(r, 400, None)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
        [{"role": "user", "content": "hi", "name": 1}],
        [{"role": "user", "content": "hi"}, "hi"],
    ],
)
def test_bad_messages_are_named_as_chat_completions_names_them(http, messages):
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages})
    expected = assert_error(chat, 400)
    r = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert assert_error(r, 400, expected["param"]) == expected
    assert expected["param"].startswith("messages[")


def test_content_parts_other_than_text_are_a_400(http):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert_error(r, 400, "messages[0].content[0]")


def test_invalid_unicode_is_a_400(http):
    body = '{"prompt": "bad \\ud800 text"}'
    r = http.post("/tokenize", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, 400, "prompt")
    body = '{"messages": [{"role": "user", "content": "bad \\ud800"}]}'
    r = http.post("/tokenize", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, 400, "messages[0].content")


def test_a_text_that_can_never_fit_is_refused_before_it_is_tokenized(http, tokenizer):
    from tilellm.server.serving import longest_token_chars

    text = "a" * (MAX_MODEL_LEN * longest_token_chars(tokenizer) + 1)
    err = assert_error(http.post("/tokenize", json={"prompt": text}), 400, "prompt")
    assert "cannot fit" in err["message"]
    messages = [{"role": "user", "content": text}]
    assert_error(http.post("/tokenize", json={"messages": messages}), 400, "messages")


def test_without_a_tokenizer_it_is_a_400(no_tokenizer_http):
    r = no_tokenizer_http.post("/tokenize", json={"prompt": "hi"})
    assert "tokenizer" in assert_error(r, 400, "prompt")["message"]
    r = no_tokenizer_http.post("/tokenize", json={"messages": CHAT})
    assert_error(r, 400, "messages")
    r = no_tokenizer_http.post("/detokenize", json={"tokens": [1, 2]})
    assert_error(r, 400, "tokens")


# ---- the API key, /version, the OpenAPI document ----


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})])
def test_the_api_key_is_required(server, path, body):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        missing = assert_error(anon.post(path, json=body), 401)
        assert missing["code"] == "invalid_api_key"
        # the same bodies as the /v1 routes'
        assert missing == assert_error(anon.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer not-the-key"}
        assert assert_error(anon.post(path, json=body, headers=wrong), 401) == assert_error(
            anon.get("/v1/models", headers=wrong), 401
        )
        assert_error(anon.post(path, json=body, headers={"Authorization": API_KEY}), 401)  # no scheme
        ok = anon.post(path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text


def test_the_api_key_is_checked_before_the_body_is_read(server):
    """A head without its body is answered at once, not after the body read timeout."""
    head = (
        "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode())
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert time.monotonic() - start < 5


def test_version_needs_no_key(server):
    from tilellm import __version__

    r = httpx.get(server.url + "/version")
    assert r.status_code == 200
    assert r.json() == {"version": __version__}


def test_openapi_document_has_the_routes(http):
    from openapi_spec_validator import validate

    document = http.get("/openapi.json").json()
    validate(document)
    assert {"/tokenize", "/detokenize", "/version"} <= set(document["paths"])
    schemas = document["components"]["schemas"]
    assert {"TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"} <= set(schemas)
    assert set(schemas["TokenizeResponse"]["properties"]) == {
        "count",
        "max_model_len",
        "tokens",
        "token_strs",
    }


@pytest.fixture(scope="module")
def fake_server(tokenizer):
    from tilellm.server import ServerConfig, create_app

    with ServerThread(create_app(FakeEngine(tokenizer), ServerConfig("fake"))) as s, s.client() as c:
        s.http = c
        s.document = c.get("/openapi.json").json()
        yield s


@pytest.mark.parametrize(
    "schema, path",
    [
        ("TokenizeCompletionRequest", "/tokenize"),
        ("TokenizeChatRequest", "/tokenize"),
        ("DetokenizeRequest", "/detokenize"),
    ],
)
def test_fuzz_from_the_schema(fake_server, schema, path):
    """A body the schema accepts is answered (never a 500), a body it rejects is a 400."""
    from tests.server.test_openapi import _fuzz

    _fuzz(fake_server, fake_server.document, schema, path)


# ---- GET /tokenizer_info (serve --enable-tokenizer-info-endpoint) ----


def test_tokenizer_info(tokenizer):
    from tilellm.server import ServerConfig, create_app
    from tilellm.testing import CHATML_TEMPLATE

    config = ServerConfig("fake", api_key="k", enable_tokenizer_info_endpoint=True)
    with ServerThread(create_app(FakeEngine(tokenizer), config)) as s, s.client() as c:
        assert c.get("/tokenizer_info").status_code == 401  # the key guards it as /v1
        r = c.get("/tokenizer_info", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["tokenizer_class"] == type(tokenizer).__name__
        assert (info["eos_token"], info["bos_token"]) == ("<|endoftext|>", None)
        assert info["chat_template"] == CHATML_TEMPLATE
        assert info["model_max_length"] == 256  # the served max_model_len, not the tokenizer's own


def test_tokenizer_info_is_off_by_default(http):
    assert http.get("/tokenizer_info").status_code == 404
