"""What the plain client costs at a run's edges, with no engine behind it.

A stub server (uvicorn + Starlette, in its own process) answers `/v1/completions` after holding
each request for `--hold` seconds and records when each request's body was read. E1's 256 bodies
(token-id prompts, as `benchmarks/plain_client.py` sends them) go to it at once from the plain
client (one asyncio + httpx client, no connection limit) and from a bare asyncio client (one raw
HTTP/1.1 connection a request), each `--runs` times. Per run: when the first and the last request
reached the server after the client started, and when the client had read every response, less
the hold. The server's part is the same for both clients, so the difference between them is the
httpx client's own cost: before the first request is on the wire (its connection pool assigning
256 requests) and after the last answer.

    python benchmarks/client_edges.py [--runs 3] [--hold 2.0] [--port 8123]

`benchmarks/serve_overhead.sh` splits a served run into the engine's busy time and what lies
before and after it; this script says how much of the latter the client brings with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time

import httpx
import plain_client


def _serve(port: int, hold: float) -> None:
    """The stub server: each completion held `hold` seconds; GET /arrivals returns (and forgets) the
    `time.perf_counter()` at which each body was read (the system's monotonic clock: it compares
    across processes)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    arrivals: list[float] = []

    async def completions(request):
        await request.json()
        arrivals.append(time.perf_counter())
        await asyncio.sleep(hold)
        return JSONResponse({"usage": {"completion_tokens": 1}})

    async def models(request):
        return JSONResponse({"data": [{"id": "stub"}]})

    async def read_arrivals(request):
        out = sorted(arrivals)
        arrivals.clear()
        return JSONResponse(out)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/arrivals", read_arrivals),
    ]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def _bare_client(port: int, payloads: list[bytes]) -> tuple[float, float]:
    """Every body on its own raw HTTP/1.1 connection, all at once: (start, end)."""

    async def one(payload: bytes) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: stub\r\nContent-Type: application/json\r\n"
        writer.write(head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        headers = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(h.split(b":")[1]) for h in headers.split(b"\r\n") if h.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in payloads))
    return start, time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hold", type=float, default=2.0, help="seconds the server holds each request")
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = mp.get_context("spawn").Process(target=_serve, args=(args.port, args.hold), daemon=True)
    server.start()
    try:
        for _ in range(100):
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        client_args = argparse.Namespace(
            base_url=url, stream=False, max_connections=0, num_clients=1, prompt_id_offset=0, scale=1.0
        )
        bodies = plain_client._bodies(client_args, "stub")
        payloads = [json.dumps(b).encode() for b in bodies]
        print(f"{len(bodies)} E1 requests, each held {args.hold:.1f} s; ms after the client started")
        # "last hook": when httpx's request hook saw the last request (plain_client's "last request sent")
        print(f"{'client':<22}{'last hook':>10}{'first in':>10}{'last in':>10}{'done - hold':>13}")
        for _ in range(args.runs):
            for name in ("plain (httpx)", "bare asyncio"):
                if name == "bare asyncio":
                    start, end = asyncio.run(_bare_client(args.port, payloads))
                    hook = "-"
                else:
                    result = asyncio.run(plain_client._send(client_args, bodies))
                    start, end = result["start"], result["end"]
                    hook = f"{(result['last_sent'] - start) * 1e3:.0f}"
                arrivals = httpx.get(url + "/arrivals").json()
                first, last = (arrivals[0] - start) * 1e3, (arrivals[-1] - start) * 1e3
                done = (end - start - args.hold) * 1e3
                print(f"{name:<22}{hook:>10}{first:>10.0f}{last:>10.0f}{done:>13.0f}")
    finally:
        server.terminate()
        server.join(10)


if __name__ == "__main__":
    main()
