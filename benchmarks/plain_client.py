"""E1 through a running `tilellm serve` with the plainest client: one asyncio + httpx client that
sends every request at once to `/v1/completions` and waits for all of them.

    python benchmarks/plain_client.py --base-url http://127.0.0.1:8011 [--stream]
        [--max-connections N] [--num-clients K] [--prompt-id-offset K] [--scale S] [--json F]

E1's 256 prompts as token ids (shifted by `--prompt-id-offset`, so that no earlier run's prompts
are in the prefix cache), each with its own `max_tokens`, temperature 0.6 and `ignore_eos`.
Reported: output tokens (from each response's `usage`, or the streamed chunks' token counts) over
the wall time from the first request sent to the last response read; and, to tell the client's
own cost from the server's, the client's CPU time over the run and when its last request started
to go out (httpx's request hook).

`--max-connections` is httpx's connection limit. httpx's default is 100 connections, and HTTP/1.1
carries one request at a time per connection, so a default client never has more than 100
requests at the server: the rest wait in the client. `0` (the default here) lifts the limit, so all
256 are in flight at once, as in the offline run.

`--num-clients K` runs K such clients in K processes, client k sending every K-th request, all
starting together; the wall time runs from the first request sent by any to the last response read
by any. One asyncio + httpx client reading 256 streams at once is bound by its own CPU (httpcore's
connection pool scans every pooled connection for each request and response; docs/benchmarks.md),
so a streamed run with one client measures the client; with several, the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from tilellm.bench.throughput import e1

_READY_TIMEOUT_S = 120.0  # client processes waiting for each other at the start


async def _one(client: httpx.AsyncClient, body: dict, stream: bool) -> int:
    """Send one completion request; the output tokens it got."""
    if not stream:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])
    tokens = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return tokens


def _bodies(args: argparse.Namespace, model: str) -> list[dict]:
    """E1's requests as `/v1/completions` bodies, prompt ids shifted by --prompt-id-offset."""
    w = e1(args.scale)
    return [
        {
            "model": model,
            "prompt": [(t + args.prompt_id_offset) % 10000 for t in p],
            "max_tokens": m,
            "temperature": 0.6,
            "ignore_eos": True,
        }
        for p, m in zip(w.prompts, w.max_tokens)
    ]


def _client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=args.max_connections or None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits)


async def _model(args: argparse.Namespace) -> str:
    async with _client(args) as client:
        return (await client.get("/v1/models")).json()["data"][0]["id"]


async def _send(args: argparse.Namespace, bodies: list[dict], ready=None) -> dict:
    """Send `bodies` at once from one client, after every client process reached `ready` (a
    barrier; None for one process). Times are `time.perf_counter()`, the system's monotonic clock,
    so the processes' times compare."""
    sent: list[float] = []

    async def on_request(request: httpx.Request) -> None:
        if request.url.path.endswith("/completions"):
            sent.append(time.perf_counter())

    async with _client(args) as client:
        client.event_hooks = {"request": [on_request]}
        if ready is not None:
            ready.wait(_READY_TIMEOUT_S)
        t0, cpu0 = time.perf_counter(), time.process_time()
        tokens = await asyncio.gather(*(_one(client, b, args.stream) for b in bodies))
        end = time.perf_counter()
        cpu_s = time.process_time() - cpu0
    last_sent = max(sent, default=t0)
    return {"tokens": sum(tokens), "start": t0, "end": end, "cpu_s": cpu_s, "last_sent": last_sent}


def _client_process(args: argparse.Namespace, bodies: list[dict], ready, queue) -> None:
    try:
        queue.put(asyncio.run(_send(args, bodies, ready)))
    except BaseException as exc:  # reported by the parent, which must not wait forever
        ready.abort()
        queue.put(f"{type(exc).__name__}: {exc}")


def _send_from_processes(args: argparse.Namespace, bodies: list[dict]) -> list[dict]:
    """--num-clients K > 1: K client processes, client k sending every K-th request."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    k_clients = args.num_clients
    ready, queue = ctx.Barrier(k_clients), ctx.Queue()
    procs = [
        ctx.Process(target=_client_process, args=(args, bodies[k::k_clients], ready, queue), daemon=True)
        for k in range(k_clients)
    ]
    for p in procs:
        p.start()
    parts: list = []
    while len(parts) < k_clients:
        try:
            parts.append(queue.get(timeout=1.0))
        except queue_mod.Empty:
            # a client killed before it reported (signal, out of memory) must not hang the run
            dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode != 0]
            if dead and queue.empty():
                ready.abort()
                msg = f"a client process exited with status {dead[0]} without a result"
                raise RuntimeError(msg) from None
    for p in procs:
        p.join(10)
    errors = [p for p in parts if isinstance(p, str)]
    if errors:
        raise RuntimeError("; ".join(errors))
    return parts


def run(args: argparse.Namespace) -> dict:
    model = asyncio.run(_model(args))
    bodies = _bodies(args, model)
    if args.num_clients > 1:
        parts = _send_from_processes(args, bodies)
    else:
        parts = [asyncio.run(_send(args, bodies))]
    start = min(p["start"] for p in parts)
    seconds = max(p["end"] for p in parts) - start
    tokens = sum(p["tokens"] for p in parts)
    return {
        "requests": len(bodies),
        "stream": args.stream,
        "max_connections": args.max_connections or None,
        "num_clients": args.num_clients,
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "client_cpu_s": sum(p["cpu_s"] for p in parts),
        "last_request_sent_s": max(p["last_sent"] for p in parts) - start,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--stream", action="store_true", help="stream the responses (SSE)")
    ap.add_argument(
        "--max-connections", type=int, default=0, help="httpx's limit (0: none; httpx's default: 100)"
    )
    ap.add_argument(
        "--num-clients",
        type=int,
        default=1,
        help="client processes, each sending every K-th request (its own event loop and connections)",
    )
    ap.add_argument("--prompt-id-offset", type=int, default=0, help="added to every prompt token id")
    ap.add_argument("--scale", type=float, default=1.0, help="E1 scaled down (as bench throughput --scale)")
    ap.add_argument("--json", default=None, help="write the result to this file")
    args = ap.parse_args()
    if args.num_clients < 1:
        ap.error("--num-clients must be >= 1")
    result = run(args)
    mode = "streamed" if args.stream else "not streamed"
    limit = args.max_connections or "no limit"
    print(
        f"plain client ({mode}, max_connections {limit}, {args.num_clients} process(es)): "
        f"{result['output_tokens']} output tokens in "
        f"{result['seconds']:.2f} s = {result['output_tok_s']:,.0f} tok/s; client CPU "
        f"{result['client_cpu_s']:.2f} s, last request sent at {result['last_request_sent_s'] or 0:.3f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
