"""E1 through a running `tilellm serve` with the plainest client: one asyncio + httpx client that
sends every request at once to `/v1/completions` and waits for all of them.

    python benchmarks/plain_client.py --base-url http://127.0.0.1:8011 [--stream]
        [--max-connections N] [--prompt-id-offset K] [--scale S] [--json F]

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from tilellm.bench.throughput import e1


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


async def run(args: argparse.Namespace) -> dict:
    w = e1(args.scale)
    limits = httpx.Limits(max_connections=args.max_connections or None, max_keepalive_connections=None)
    sent: list[float] = []

    async def on_request(request: httpx.Request) -> None:
        if request.url.path.endswith("/completions"):
            sent.append(time.perf_counter())

    opts = {"timeout": None, "limits": limits, "event_hooks": {"request": [on_request]}}
    async with httpx.AsyncClient(base_url=args.base_url, **opts) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        bodies = [
            {
                "model": model,
                "prompt": [(t + args.prompt_id_offset) % 10000 for t in p],
                "max_tokens": m,
                "temperature": 0.6,
                "ignore_eos": True,
            }
            for p, m in zip(w.prompts, w.max_tokens)
        ]
        t0, cpu0 = time.perf_counter(), time.process_time()
        tokens = await asyncio.gather(*(_one(client, b, args.stream) for b in bodies))
        seconds = time.perf_counter() - t0
        client_cpu_s = time.process_time() - cpu0
    return {
        "requests": len(bodies),
        "stream": args.stream,
        "max_connections": args.max_connections or None,
        "output_tokens": sum(tokens),
        "seconds": seconds,
        "output_tok_s": sum(tokens) / seconds,
        "client_cpu_s": client_cpu_s,
        "last_request_sent_s": max(sent) - t0 if sent else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--stream", action="store_true", help="stream the responses (SSE)")
    ap.add_argument(
        "--max-connections", type=int, default=0, help="httpx's limit (0: none; httpx's default: 100)"
    )
    ap.add_argument("--prompt-id-offset", type=int, default=0, help="added to every prompt token id")
    ap.add_argument("--scale", type=float, default=1.0, help="E1 scaled down (as bench throughput --scale)")
    ap.add_argument("--json", default=None, help="write the result to this file")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    mode = "streamed" if args.stream else "not streamed"
    limit = args.max_connections or "no limit"
    print(
        f"plain client ({mode}, max_connections {limit}): {result['output_tokens']} output tokens in "
        f"{result['seconds']:.2f} s = {result['output_tok_s']:,.0f} tok/s; client CPU "
        f"{result['client_cpu_s']:.2f} s, last request sent at {result['last_request_sent_s'] or 0:.3f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
