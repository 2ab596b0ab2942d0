"""Drive a running server with a request rate and report latencies.

Workload (E1 of docs/workloads.md, with the defaults): `random.seed(seed)`; first every prompt,
`randint(100, 1024)` random token ids each in `[0, --token-id-max]` (length drawn before its
tokens); then every `max_tokens`, `randint(100, 1024)`. `--input-len` / `--output-len` fix the
lengths instead; `--scale` shrinks lengths and count as `tilellm bench throughput --scale` does
(the same prompts). `--prompt-id-offset K` adds K to every prompt token id (modulo
`--token-id-max + 1`): the same lengths and work, but nothing for the prefix cache to find from
an earlier run over the same workload.

The workload fits the served model (from `/v1/models`): a vocabulary smaller than E1's ids takes
them modulo its size, as `bench throughput` does; the vocabulary size comes from the server when
it says, else from `--tokenizer DIR` (or `--model` naming a local directory), else from the
served model's directory when it is on this machine or is the embedded model. Drawn lengths
that exceed the model's `max_model_len` are scaled down until they fit (a note says so).
Requests go to `/v1/completions` as token ids, streamed, with `ignore_eos` and `return_token_ids`,
either all at once (`--request-rate inf`), as a Poisson process, and/or capped at
`--max-concurrency` in flight.

Per request: TTFT (send -> first chunk with tokens), inter-token latencies (gaps between such
chunks; a chunk may carry several tokens when the client falls behind), TPOT
((last - first chunk) / (output tokens - 1)) and end-to-end latency; output tokens come from
the server's `usage`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from tilellm.commands.common import UsageError

E1_TOKEN_ID_MAX = 10000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    parser.add_argument(
        "--model", default=None, help="model name as served (default: the server's first model)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="model or tokenizer directory whose vocabulary the prompt ids must fit (default: the "
        "--model directory, or the served one when it is on this machine or is the embedded model)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("TILELLM_API_KEY"), help="default: $TILELLM_API_KEY"
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 256 (times --scale)")
    parser.add_argument(
        "--input-len", type=int, default=None, help="fixed prompt length (default: randint(100, 1024))"
    )
    parser.add_argument(
        "--output-len", type=int, default=None, help="fixed max_tokens (default: randint(100, 1024))"
    )
    parser.add_argument(
        "--token-id-max",
        type=int,
        default=None,
        help=f"prompt token ids in [0, this] (default: E1's {E1_TOKEN_ID_MAX}, modulo a smaller vocabulary)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="shrink the default lengths and prompt count as `bench throughput --scale` does; 1 = E1",
    )
    parser.add_argument(
        "--prompt-id-offset",
        type=int,
        default=0,
        help="add this to every prompt token id (mod token-id-max + 1): no prefix-cache hits across runs",
    )
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (inf: all at once)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    parser.add_argument(
        "--num-clients",
        type=int,
        default=1,
        help="client processes sharing the requests (one Python event loop parses ~10-20k "
        "streamed chunks/s: use more at high token rates so the client does not bound the result)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


def make_workload(
    num_prompts: int,
    input_len: int | None,
    output_len: int | None,
    token_id_max: int,
    seed: int,
    scale: float = 1.0,
    prompt_id_offset: int = 0,
    vocab_size: int | None = None,
) -> Workload:
    """E1's draw order: all prompts (length, then tokens), then all output lengths.

    Lengths are `randint(lo, hi)` with lo, hi = 100, 1024 scaled as `bench throughput` scales E1.
    `vocab_size`: the ids taken modulo it where they reach it (as `bench throughput` fits a model).
    """
    random.seed(seed)
    lo, hi = max(1, round(100 * scale)), max(2, round(1024 * scale))
    prompts = []
    for _ in range(num_prompts):
        n = input_len if input_len is not None else random.randint(lo, hi)
        prompts.append([random.randint(0, token_id_max) for _ in range(n)])
    max_tokens = [
        output_len if output_len is not None else random.randint(lo, hi) for _ in range(num_prompts)
    ]
    if prompt_id_offset:
        mod = token_id_max + 1
        prompts = [[(t + prompt_id_offset) % mod for t in p] for p in prompts]
    if vocab_size is not None and token_id_max >= vocab_size:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return Workload(prompts, max_tokens)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _one_request(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    temperature: float,
    timeout: float,
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_len=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                result.error = (
                    f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                )
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices", [])):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = not result.error
    return result


async def _arrivals(n: int, rate: float, rng: random.Random):
    """Yields 0..n-1, sleeping exponential gaps (mean 1/rate) between them; inf: no gaps."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and i + 1 < n:
            await asyncio.sleep(rng.expovariate(rate))


async def _drive(
    args: argparse.Namespace,
    model: str,
    work: Workload,
    indices: list[int],
    rate: float,
    in_flight: int,
    arrival_seed: int,
    ready=None,
) -> tuple[list[RequestResult], float, float]:
    """Send the requests `indices` of `work` (arrivals at `rate`, at most `in_flight` at once);
    their results, and the perf_counter times of the first send and of the last completion.
    `ready` (a multiprocessing Barrier of all client processes) holds the first send until every
    client process has its workload and HTTP client."""
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=_headers(args), limits=limits, timeout=60
    ) as client:
        sem = asyncio.Semaphore(in_flight)

        async def limited(i: int) -> RequestResult:
            async with sem:
                return await _one_request(
                    client, model, work.prompts[i], work.max_tokens[i], args.temperature, args.timeout
                )

        if ready is not None:  # BrokenBarrierError when another client died or timed out
            await asyncio.to_thread(ready.wait, _READY_TIMEOUT_S)
        start = time.perf_counter()
        tasks = []
        async for j in _arrivals(len(indices), rate, random.Random(arrival_seed)):
            tasks.append(asyncio.create_task(limited(indices[j])))
        results = await asyncio.gather(*tasks)
        return list(results), start, time.perf_counter()


_READY_TIMEOUT_S = 120.0  # client processes waiting for each other at the start


def _client_share(total: int, clients: int, k: int) -> int:
    """Client k's part of `total` split over `clients` as evenly as integers allow (sums to total)."""
    return total // clients + (1 if k < total % clients else 0)


def _client_process(args: argparse.Namespace, model: str, k: int, ready, queue) -> None:
    """Client process k of --num-clients: every K-th request, at 1/K of the rate (the sum of K
    independent Poisson processes is the Poisson process of the whole rate), and its share of
    --max-concurrency (the shares sum to it)."""
    try:
        work = _workload(args)
        clients = args.num_clients
        indices = list(range(k, args.num_prompts, clients))
        in_flight = _client_share(args.max_concurrency or args.num_prompts, clients, k)
        out = asyncio.run(
            _drive(
                args, model, work, indices, args.request_rate / clients, in_flight, args.seed + 1 + k, ready
            )
        )
        queue.put((k, indices, out, None))
    except BaseException as exc:  # reported by the parent, which must not wait forever
        queue.put((k, [], None, f"{type(exc).__name__}: {exc}"))


def _workload(args: argparse.Namespace) -> Workload:
    return make_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.token_id_max,
        args.seed,
        args.scale,
        args.prompt_id_offset,
        getattr(args, "vocab_size", None),
    )


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def served_model(args: argparse.Namespace) -> dict:
    """The `/v1/models` card of `--model` (default: the server's first model)."""
    async with httpx.AsyncClient(base_url=args.base_url, headers=_headers(args), timeout=60) as client:
        resp = await client.get("/v1/models")
    if resp.status_code == 401:
        raise UsageError(f"{args.base_url} wants an API key: pass --api-key KEY (or set $TILELLM_API_KEY)")
    resp.raise_for_status()
    cards = resp.json().get("data") or []
    if not cards:
        raise UsageError(f"{args.base_url}/v1/models lists no model")
    if args.model is None:
        return cards[0]
    card = next((c for c in cards if c.get("id") == args.model), None)
    if card is None:
        served = ", ".join(str(c.get("id")) for c in cards)
        raise UsageError(
            f"--model {args.model}: the server serves {served}; pass one of them or leave it out"
        )
    return card


def vocab_size_of(path: str | os.PathLike) -> int | None:
    """Token ids that both the model (config.json's vocab_size) and its tokenizer know; None when
    the directory has neither."""
    from pathlib import Path

    path = Path(path)
    sizes = []
    config = path / "config.json"
    try:
        if config.is_file():
            size = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
            if isinstance(size, int):
                sizes.append(size)
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            from transformers import AutoTokenizer

            sizes.append(len(AutoTokenizer.from_pretrained(str(path))))
    except (OSError, ValueError, AttributeError) as exc:  # unreadable: the ids stay as they are
        _note(f"cannot read the vocabulary in {path} ({type(exc).__name__}: {exc})")
    return min(sizes) if sizes else None


def _vocab_dir(args: argparse.Namespace, card: dict) -> str | None:
    """Where the served model's vocabulary can be read on this machine, if anywhere."""
    from tilellm.assets import DEFAULT_MODEL_NAME, default_model_path

    if args.tokenizer is not None:
        if not os.path.isdir(args.tokenizer):
            raise UsageError(f"--tokenizer {args.tokenizer}: no such directory")
        return args.tokenizer
    root = str(card.get("root") or card.get("id") or "")
    for candidate in (args.model, root):  # a path given here, or the server's on this machine
        if candidate and os.path.isdir(candidate):
            return candidate
    if DEFAULT_MODEL_NAME in (os.path.basename(os.path.normpath(root)), card.get("id")):
        return str(default_model_path())  # the embedded model, served from another machine
    return None


def fit_to_server(args: argparse.Namespace, card: dict) -> None:
    """Fit the workload to the served model `card`: set `args.vocab_size` (None: unknown) and
    shrink `args.scale` until drawn lengths fit its `max_model_len`; UsageError where a flag's
    value cannot fit."""
    vocab = card.get("vocab_size")
    if not isinstance(vocab, int):
        where = _vocab_dir(args, card)
        vocab = vocab_size_of(where) if where is not None else None
    args.vocab_size = vocab
    if args.token_id_max is None:
        args.token_id_max = E1_TOKEN_ID_MAX
        if vocab is not None and vocab <= E1_TOKEN_ID_MAX:
            _note(f"prompt token ids taken modulo the served model's vocabulary ({vocab} ids)")
    elif vocab is not None and args.token_id_max >= vocab:
        raise UsageError(
            f"--token-id-max {args.token_id_max}: the served model has {vocab} ids; use < {vocab}"
        )
    max_len = card.get("max_model_len")
    if not isinstance(max_len, int):
        return
    fixed = (args.input_len or 0) + (args.output_len or 0)
    drawn = (args.input_len is None) + (args.output_len is None)
    longest = fixed + drawn * max(2, round(1024 * args.scale))
    if longest <= max_len:
        return
    room = (max_len - fixed) // drawn if drawn else 0
    if room < 2:
        raise UsageError(
            f"requests of {longest} tokens do not fit the served model's max_model_len {max_len}: "
            "use a smaller --input-len / --output-len"
        )
    args.scale = room / 1024
    _note(
        f"the served model's max_model_len is {max_len}: lengths scaled down to fit "
        f"(--scale {args.scale:.4g}, up to {room} tokens each)"
    )


def _note(text: str) -> None:
    print(f"tilellm bench serve: {text}", file=sys.stderr)


async def _model_name(args: argparse.Namespace) -> str:
    if args.model is not None:
        return args.model
    async with httpx.AsyncClient(base_url=args.base_url, headers=_headers(args), timeout=60) as client:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    """One client process: every request from this event loop."""
    model = await _model_name(args)
    in_flight = args.max_concurrency or args.num_prompts
    results, start, end = await _drive(
        args,
        model,
        _workload(args),
        list(range(args.num_prompts)),
        args.request_rate,
        in_flight,
        args.seed + 1,
    )
    return summarize(results, end - start, model, args)


def run_benchmark_processes(args: argparse.Namespace) -> dict:
    """`--num-clients K` > 1: K client processes, so that parsing the streamed chunks (one Python
    event loop handles ~10-20k server-sent events/s) does not bound what is measured. Each sends
    every K-th request; the duration runs from the first send of any to the last completion."""
    import multiprocessing as mp
    import queue as queue_mod

    model = asyncio.run(_model_name(args))
    ctx = mp.get_context("spawn")
    ready, queue = ctx.Barrier(args.num_clients), ctx.Queue()
    procs = [
        ctx.Process(target=_client_process, args=(args, model, k, ready, queue), daemon=True)
        for k in range(args.num_clients)
    ]
    for p in procs:
        p.start()
    results: list[RequestResult | None] = [None] * args.num_prompts
    starts, ends, errors = [], [], []
    pending = set(range(args.num_clients))
    while pending:
        try:
            k, indices, out, err = queue.get(timeout=1.0)
        except queue_mod.Empty:
            # A client that died without reporting (killed, out of memory) must not hang this loop.
            dead = [k for k in pending if not procs[k].is_alive() and queue.empty()]
            for k in dead:
                pending.discard(k)
                errors.append(f"client {k}: exited with status {procs[k].exitcode} without a result")
            if dead:
                ready.abort()  # the others stop waiting for it at the start
            continue
        pending.discard(k)
        if err is not None:
            errors.append(f"client {k}: {err}")
            continue
        for i, r in zip(indices, out[0]):
            results[i] = r
        starts.append(out[1])
        ends.append(out[2])
    for p in procs:
        p.join(10)
    if errors:
        raise RuntimeError("; ".join(errors))
    return summarize([r for r in results if r is not None], max(ends) - min(starts), model, args)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, model: str, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = 1000.0
    series = {
        "ttft_ms": [r.ttft * ms for r in ok],
        "tpot_ms": [r.tpot * ms for r in ok if r.tpot is not None],
        "itl_ms": [x * ms for r in ok for x in r.itl],
        "e2e_ms": [r.e2e * ms for r in ok],
    }
    summary = {
        "model": model,
        "base_url": args.base_url,
        "num_prompts": len(results),
        "scale": getattr(args, "scale", 1.0),
        "prompt_id_offset": getattr(args, "prompt_id_offset", 0),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "num_clients": getattr(args, "num_clients", 1),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    for name, values in series.items():
        summary[f"mean_{name}"] = statistics.fmean(values) if values else float("nan")
        for q in (50, 90, 99):
            summary[f"p{q}_{name}"] = _pct(values, q)
    errors = sorted({r.error for r in results if not r.ok})
    summary["errors"] = errors[:10]
    return summary


def format_table(s: dict) -> str:
    rows = [
        ("Successful requests", f"{s['completed']}"),
        ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", f"{s['total_input_tokens']}"),
        ("Total output tokens", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for name, title in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E latency"),
    ):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append(
                (
                    f"{stat.capitalize() if stat == 'mean' else stat.upper()} {title} (ms)",
                    f"{s[f'{stat}_{name}']:.2f}",
                )
            )
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{'=' * 20} tilellm bench serve {'=' * 20}"]
    lines += [f"{k:<{width}}{v:>12}" for k, v in rows]
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UsageError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        raise UsageError("--request-rate must be > 0 (inf for all at once)")
    if args.num_clients < 1:
        raise UsageError("--num-clients must be >= 1")
    if not args.scale > 0:
        raise UsageError(f"--scale must be > 0, got {args.scale:g}")
    try:
        card = asyncio.run(served_model(args))
        args.model = card["id"]
        fit_to_server(args, card)
        if args.num_prompts is None:
            args.num_prompts = max(1, round(256 * args.scale))
        args.num_clients = min(args.num_clients, args.num_prompts, args.max_concurrency or args.num_prompts)
        if args.num_clients > 1:
            summary = run_benchmark_processes(args)
        else:
            summary = asyncio.run(run_benchmark(args))
    except httpx.HTTPError as exc:
        print(f"tilellm bench serve: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    print(format_table(summary))
    if args.json:
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in summary.items()}
        with open(args.json, "w") as f:
            json.dump(clean, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


__all__ = [
    "add_arguments",
    "fit_to_server",
    "main",
    "make_workload",
    "RequestResult",
    "served_model",
    "summarize",
    "vocab_size_of",
]
