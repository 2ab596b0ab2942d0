"""Run an app under uvicorn with a graceful, exit-0 shutdown on SIGINT/SIGTERM.

On the first signal uvicorn stops accepting connections, lets in-flight responses finish for up
to `graceful_timeout` seconds, then cancels what is left (each cancelled stream aborts its engine
request) and runs the app's lifespan shutdown, which stops the engine thread. Unlike uvicorn's
default, the signal is not re-raised afterwards, so the process exits with status 0.
A second SIGINT forces an immediate exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tilellm.server.app import ServerConfig

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# After the grace period the app fails what is still open (`app.state.on_grace_expired`): this is
# how long its handlers then have to write those errors before uvicorn cancels them.
WIND_DOWN_S = 5.0


class GracefulServer(uvicorn.Server):
    """`exit_code`: what the process should exit with (`request_exit` sets it, e.g. when the
    engine died); 0 after a signal."""

    exit_code = 0

    def request_exit(self, code: int) -> None:
        self.exit_code = code
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        hook = getattr(getattr(self.config.app, "state", None), "on_grace_expired", None)
        grace = self.config.timeout_graceful_shutdown
        if hook is None or grace is None:
            return await super().shutdown(sockets)
        # uvicorn waits `grace` s and then cancels every task (a plain-text 500, a stream cut
        # short, a traceback each); instead the app answers them at the end of the grace period
        # and uvicorn's own deadline comes WIND_DOWN_S later, with nothing left to cancel.
        timer = asyncio.get_running_loop().call_later(grace, hook)
        self.config.timeout_graceful_shutdown = grace + WIND_DOWN_S
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            self.config.timeout_graceful_shutdown = grace

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


class _HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers: a connection that has not sent
    a whole request head within `header_timeout` seconds of opening (or of its previous response)
    is closed. uvicorn alone waits forever for a client that sends half a request line."""

    header_timeout = 10.0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def make_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    access_log: bool = True,
    graceful_timeout: float = 30.0,
    timeout_keep_alive: float = ServerConfig.timeout_keep_alive,
    header_timeout: float = ServerConfig.header_timeout,
) -> GracefulServer:
    """`timeout_keep_alive`: an idle keep-alive connection is closed after this many seconds;
    `header_timeout`: so is one that does not send a whole request head within this many."""
    protocol = type("HeaderTimeoutProtocol", (_HeaderTimeoutProtocol,), {"header_timeout": header_timeout})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=graceful_timeout,
        timeout_keep_alive=timeout_keep_alive,
        http=protocol,
        lifespan="on",
    )
    server = GracefulServer(config)
    state = getattr(app, "state", None)
    if state is not None:  # the app asks the server to stop (a dead engine: `create_app`)
        state.request_exit = server.request_exit
    return server


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one); pass it to `server.run(sockets=[sock])`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
