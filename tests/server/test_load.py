"""Many concurrent streams batch together and each gets exactly what it would get alone (greedy)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai

from tests.server.conftest import API_KEY, MODEL_NAME

NUM_REQUESTS = 64
MAX_TOKENS = 12


def _prompts(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    vocab = len(tokenizer) - 3  # no special tokens
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 60))] for _ in range(NUM_REQUESTS)]


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"tilellm:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def test_64_concurrent_streams_match_solo_runs(server, client, tokenizer):
    prompts = _prompts(tokenizer)
    kw = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    solo = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def stream_one(aclient, prompt) -> tuple[str, int, int]:
        chunks = 0
        parts = []
        usage = None
        stream = await aclient.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        )
        async for c in stream:
            chunks += 1
            parts.extend(ch.text for ch in c.choices)
            usage = c.usage or usage
        return "".join(parts), chunks, usage.completion_tokens

    async def run() -> tuple[list, int]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        http_client = httpx.AsyncClient(limits=limits, timeout=120)
        aclient = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, http_client=http_client
        )
        peak = 0

        async def watch() -> None:
            nonlocal peak
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as h:
                while True:
                    peak = max(peak, _metric((await h.get("/metrics")).text, "num_requests_running"))
                    await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(stream_one(aclient, p) for p in prompts)), timeout=180
            )
        finally:
            watcher.cancel()
            await aclient.close()
        return results, peak

    start = time.monotonic()
    results, peak = asyncio.run(run())
    assert time.monotonic() - start < 180
    for i, (text, _, completion_tokens) in enumerate(results):
        assert text == solo[i], f"request {i}: batched output differs from the solo run"
        assert completion_tokens == MAX_TOKENS
    assert peak > 1, "requests never ran together"
