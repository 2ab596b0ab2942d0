"""Run an app under uvicorn with a graceful, exit-0 shutdown on SIGINT/SIGTERM.

On the first signal uvicorn stops accepting connections, lets in-flight responses finish for up
to `graceful_timeout` seconds, then cancels what is left (each cancelled stream aborts its engine
request) and runs the app's lifespan shutdown, which stops the engine thread. Unlike uvicorn's
default, the signal is not re-raised afterwards, so the process exits with status 0.
A second SIGINT forces an immediate exit.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def make_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    access_log: bool = True,
    graceful_timeout: float = 30.0,
) -> GracefulServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=graceful_timeout,
        lifespan="on",
    )
    return GracefulServer(config)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one); pass it to `server.run(sockets=[sock])`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
