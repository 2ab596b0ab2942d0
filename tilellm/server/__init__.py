"""OpenAI-compatible HTTP server (FastAPI + uvicorn) around `LLMEngine`.

`create_app(engine, ServerConfig(...))` builds the app; `tilellm serve` runs it. See `app.py`
for the routes, `async_engine.py` for the engine loop and the server's client of it (in a thread;
`engine_process.py`: in its own process), `admission.py` for what a request may cost and who is
fed next, `watchdog.py` for stalled and dead engines, and `serving.py` for the request -> engine
-> response path.
"""

from tilellm.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
