"""Middlewares of `app.py` against slow and unauthenticated clients: the API key is checked
before any of the body is read, a body that does not arrive in time is a 408, a connection that
never finishes its request head is closed; and GET /version."""

from __future__ import annotations

import socket
import time

import pytest

from tests.server.fake_engine import FakeEngine
from tests.server.helpers import ServerThread


@pytest.fixture(scope="module")
def slow_client_server(tokenizer):
    from tilellm.server import ServerConfig, create_app

    config = ServerConfig("fake", api_key="k", body_read_timeout=0.5)
    with ServerThread(create_app(FakeEngine(tokenizer), config), header_timeout=0.5) as s:
        yield s


def _raw(server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(data)
    return sock


def _response(sock: socket.socket) -> bytes:
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = sock.recv(65536)
        if not chunk:
            break
        out += chunk
    return out


def _head(path: str, length: int, key: str | None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_the_api_key_is_checked_before_the_body_is_read(slow_client_server):
    start = time.monotonic()
    sock = _raw(slow_client_server, _head("/v1/completions", 8_000_000, None))  # no body sent
    head = _response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 401"), head
    assert time.monotonic() - start < 0.4  # answered at once, not after the body timeout


def test_a_body_that_does_not_arrive_in_time_is_a_408(slow_client_server):
    sock = _raw(slow_client_server, _head("/v1/completions", 100, "k") + b'{"prompt": ')
    start = time.monotonic()
    head = _response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert 0.3 < time.monotonic() - start < 5


def test_a_half_sent_request_head_is_closed(slow_client_server):
    sock = _raw(slow_client_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    assert sock.recv(100) == b""  # closed by the server
    assert time.monotonic() - start < 5
    sock.close()


def test_version(slow_client_server):
    import httpx

    from tilellm import __version__

    assert httpx.get(slow_client_server.url + "/version").json() == {"version": __version__}
