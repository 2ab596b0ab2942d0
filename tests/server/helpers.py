"""Run an app under a real uvicorn server on 127.0.0.1 (free port) in a background thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx

from tilellm.server.launcher import bind_socket, make_server


class ServerThread:
    def __init__(self, app, graceful_timeout: float = 5.0, **server_kw):
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(
            app,
            port=self.port,
            log_level="warning",
            access_log=False,
            graceful_timeout=graceful_timeout,
            **server_kw,
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 60, **kw})


@contextlib.contextmanager
def scripted_tool_client(tokenizer, script: str) -> Iterator:
    """The `openai` client of a server whose engine writes `script` (a `ScriptedEngine`), served
    with `--reasoning-parser qwen3 --tool-call-parser hermes --enable-auto-tool-choice`."""
    import openai

    from tests.server.fake_engine import ScriptedEngine
    from tilellm.server import ServerConfig, create_app

    config = ServerConfig(
        "fake", reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    with ServerThread(create_app(ScriptedEngine(tokenizer, script, max_model_len=2048), config)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
