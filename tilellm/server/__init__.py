"""OpenAI-compatible HTTP server (FastAPI + uvicorn) around `LLMEngine`.

`create_app(engine, ServerConfig(...))` builds the app; `tilellm serve` runs it. See `app.py`
for the routes, `async_engine.py` for how the engine thread and the event loop meet, and
`serving.py` for the request -> engine -> response path.
"""

from tilellm.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
