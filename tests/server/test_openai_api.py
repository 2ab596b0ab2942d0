"""The official `openai` client (sync and async) against the real engine on a tiny model."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME

CHAT = [{"role": "system", "content": "You count."}, {"role": "user", "content": "One, two, three,"}]


def _chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_list(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert models.data[0].vocab_size == server.engine.vocab_size  # bench serve draws prompt ids below it
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_completion_usage_is_exact(client, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_usage_is_exact(client, tokenizer):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens == _chat_prompt_len(tokenizer, CHAT)
    assert r.usage.completion_tokens == 5


def test_max_completion_tokens(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_streamed_completion_equals_unstreamed(client, tokenizer):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=20, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_equals_unstreamed(client):
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_token_id_prompts_and_prompt_lists(client, tokenizer):
    ids = tokenizer.encode("Hello, world!")
    one = client.completions.create(model=MODEL_NAME, prompt="Hello, world!", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == one.choices[0].text
    prompts = ["Hello, world!", "The weather is", "One, two"]
    many = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in many.choices] == list(range(6))
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text  # greedy: n copies
    assert many.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    batch_ids = client.completions.create(
        model=MODEL_NAME, prompt=[ids, ids[:3]], max_tokens=6, temperature=0
    )
    assert batch_ids.choices[0].text == one.choices[0].text


def test_n_samples(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    again = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="Hi", n=2, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    finished = sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason)
    assert finished == [0, 1]


def test_stop_string(client):
    kw = dict(
        model=MODEL_NAME,
        prompt="The quick brown fox",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**kw).choices[0].text
    assert len(text) >= 8, text
    stop = text[4:6]
    cut = text[: text.find(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == cut


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert sampled <= 0 and 1 <= len(top) <= 3
        assert sampled == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.logprob == pytest.approx(
            tok.top_logprobs[0].logprob, abs=1e-5
        )
        assert bytes(tok.bytes).decode("utf-8", errors="replace") == tok.token
    no_top = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0, logprobs=True
    )
    assert all(t.top_logprobs == [] for t in no_top.choices[0].logprobs.content)
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == [t.token for t in content]


def test_echo(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=3, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith("Hello there")


def test_async_client(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        try:
            models = await aclient.models.list()
            assert models.data[0].id == MODEL_NAME
            kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0)
            full, stream = await asyncio.gather(
                aclient.chat.completions.create(**kw), aclient.chat.completions.create(stream=True, **kw)
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            assert text == full.choices[0].message.content
            comp = await aclient.completions.create(
                model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0
            )
            assert comp.usage.completion_tokens >= 1
        finally:
            await aclient.close()

    asyncio.run(run())
