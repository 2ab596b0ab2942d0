"""GET /openapi.json is a valid OpenAPI document, and its request schemas drive a fuzz test: a
body the schema accepts is answered (never a 500), a body it rejects is a 400."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.fake_engine import FakeEngine
from tests.server.helpers import ServerThread


@pytest.fixture(scope="module")
def fake_server(tokenizer):
    from tilellm.server import ServerConfig, create_app

    with ServerThread(create_app(FakeEngine(tokenizer), ServerConfig("fake"))) as s, s.client() as http:
        s.http = http
        yield s


@pytest.fixture(scope="module")
def document(fake_server):
    r = fake_server.http.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def test_openapi_document_is_valid_and_the_connection_lives_on(fake_server, document):
    from openapi_spec_validator import validate

    validate(document)
    assert "/v1/completions" in document["paths"] and "/inspect" in document["paths"]
    # the same keep-alive connection serves the next request
    assert fake_server.http.get("/health").status_code == 200


def _strategy(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values for a JSON schema of the OpenAPI document (the subset pydantic emits), plus junk."""
    if "$ref" in schema:
        return _strategy(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of([_strategy(s, defs, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum", -3), schema.get("maximum", 8)
        return st.integers(lo, min(hi, lo + 10))
    if kind == "number":
        return st.floats(-0.5, 2.0) | st.integers(0, 2)
    if kind == "string":
        return st.text(min_size=1, max_size=6)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        item = _strategy(schema.get("items", {}), defs, depth + 1) if depth < 3 else st.none()
        return st.lists(item, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object" and "properties" in schema and depth < 3:
        props = {k: _strategy(v, defs, depth + 1) for k, v in schema["properties"].items()}
        required = {k: props.pop(k) for k in schema.get("required", [])}
        return st.fixed_dictionaries(required, optional=props)
    return st.none() | st.integers() | st.text(max_size=3)


junk = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=3)


def _fuzz(fake_server, document, model: str, path: str):
    defs = document["components"]["schemas"]
    schema = defs[model]

    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(
        body=_strategy(schema, defs),
        key=st.sampled_from(sorted(schema["properties"])),
        value=junk,
        mutate=st.booleans(),
    )
    def run(body, key, value, mutate):
        if mutate:
            body = {**body, key: value}
        if "max_tokens" in body and not isinstance(body["max_tokens"], int):
            body["max_tokens"] = 2
        body.setdefault("max_tokens", 2)
        body["stream"] = False
        body["model"] = "fake"
        r = fake_server.http.post(
            path, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        assert r.status_code < 500, r.text
        try:
            jsonschema.validate(body, {**schema, "components": document["components"]})
        except jsonschema.ValidationError:  # the schema rejects it: so must the server
            assert r.status_code == 400, (body, r.text)

    run()


def test_fuzz_completions_from_the_schema(fake_server, document):
    _fuzz(fake_server, document, "CompletionRequest", "/v1/completions")


def test_fuzz_chat_from_the_schema(fake_server, document):
    _fuzz(fake_server, document, "ChatCompletionRequest", "/v1/chat/completions")
