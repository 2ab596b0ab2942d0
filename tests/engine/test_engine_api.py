"""LLMEngine / LLM behaviour: validation, aborts, stop conditions, streaming text, n > 1, logprobs."""

from __future__ import annotations

import pytest

from tests.engine.fakes import FakeEngine, reference_tokens
from tilellm import LLM, SamplingParams
from tilellm.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_qwen3) -> LLMEngine:
    return LLMEngine(tiny_qwen3, num_kv_blocks=64, max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def llm(tiny_qwen3) -> LLM:
    return LLM(tiny_qwen3, num_kv_blocks=64, max_num_seqs=8)


def drain(engine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_invalid_requests_are_rejected_and_others_served(engine):
    engine.add_request("ok", "The quick brown fox", GREEDY)
    used = engine.get_stats().num_kv_blocks_used
    with pytest.raises(ValueError, match="longer than max_model_len"):
        engine.add_request("long", [1] * 129, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty2", "", GREEDY)
    with pytest.raises(ValueError, match="token id 1000000 is outside the vocabulary"):
        engine.add_request("oov", [1, 2, 10**6], GREEDY)
    with pytest.raises(ValueError, match="token id -3 is outside the vocabulary"):
        engine.add_request("negative", [1, -3, 2], GREEDY)
    with pytest.raises(ValueError, match="must be integers"):
        engine.add_request("bool", [1, True, 2], GREEDY)
    with pytest.raises(ValueError, match="must be integers"):
        engine.add_request("float", [1, 2.5], GREEDY)
    with pytest.raises(ValueError, match="must be integers, got 'x'"):
        engine.add_request("junk", [1, "x"], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "again", GREEDY)
    assert engine.get_stats().num_kv_blocks_used == used and engine.get_stats().num_waiting == 1
    outs = drain(engine)
    assert list(outs) == ["ok"] and outs["ok"][-1].finished
    assert len(outs["ok"][-1].outputs[0].token_ids) == 12


def test_streamed_text_grows_to_the_final_decode(engine):
    engine.add_request("s", "Once upon a time", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    outs = drain(engine)["s"]
    texts = [o.outputs[0].text for o in outs]
    assert len(texts) == 16 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == engine.tokenizer.decode(outs[-1].outputs[0].token_ids, skip_special_tokens=True)


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("a1", "Hello, world! " * 3, GREEDY)
    engine.add_request("a2", "Hello there", GREEDY)
    engine.step()
    assert engine.get_stats().num_kv_blocks_used > 0
    assert engine.abort_request("a1") and engine.abort_request("a2")
    assert not engine.abort_request("a1") and not engine.abort_request("nope")
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_kv_blocks_used == 0
    assert not engine.has_unfinished_requests()
    engine.add_request("w", "waiting one", GREEDY)  # abort while waiting
    assert engine.abort_request("w") and not engine.has_unfinished_requests()
    assert engine.step() == []


def test_prompt_too_long_in_generate(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1, 2], [3] * 600], GREEDY, use_tqdm=False)
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_strings_and_stop_tokens(llm):
    prompt = "The robot wrote every number"
    base = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length" and text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[: text.index(stop)]
    t = ids[5]
    k = ids.index(t)
    tok = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[t]), use_tqdm=False
    )[0]
    o = tok.outputs[0]
    assert o.token_ids == ids[: k + 1] and o.finish_reason == "stop" and o.stop_reason == t
    # min_tokens suppresses the stop token until then.
    p = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[t], min_tokens=k + 2)
    late = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= k + 2 and t not in late.token_ids[: k + 1]


def test_streaming_never_shows_a_stop_string(engine):
    engine.add_request("base", "Hello, world!", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text = drain(engine)["base"][-1].outputs[0].text
    stop = text[8:11]
    engine.add_request("st", "Hello, world!", SamplingParams(temperature=0, max_tokens=20, stop=stop))
    outs = drain(engine)["st"]
    for o in outs:
        assert stop not in o.outputs[0].text
    assert outs[-1].outputs[0].text == text[: text.index(stop)]


def test_eos_and_ignore_eos():
    prompt = [5, 6, 7, 8]
    ref = reference_tokens(prompt, 10)
    eng = FakeEngine(eos_token_id=ref[3], block_size=4, num_kv_blocks=32, max_model_len=64)
    eng.add_request("e", prompt, SamplingParams(temperature=0, max_tokens=10))
    eng.add_request("i", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    outs = {k: v[-1] for k, v in drain(eng).items()}
    e, i = outs["e"].outputs[0], outs["i"].outputs[0]
    assert e.token_ids == ref[: ref.index(ref[3]) + 1] and e.finish_reason == "stop" and e.stop_reason is None
    assert i.token_ids == ref and i.finish_reason == "length"


def test_max_model_len_ends_generation():
    eng = FakeEngine(block_size=4, num_kv_blocks=32, max_model_len=20)
    eng.add_request("m", list(range(1, 16)), SamplingParams(temperature=0, max_tokens=100))
    out = drain(eng)["m"][-1].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_seeded_sampling_is_independent_of_the_batch(llm):
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    mixed = llm.generate(["Hello", "Once upon a time", "The moon"], [others, p, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Once upon a time"] * 3, unseeded, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in a}) > 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_the_prompt_blocks(tiny_qwen3, prefix_caching):
    eng = LLMEngine(tiny_qwen3, num_kv_blocks=64, block_size=4, enable_prefix_caching=prefix_caching)
    prompt = list(range(10, 30))  # 5 full blocks
    eng.add_request("n", prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    shared_seen = False
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
        refs = eng.block_manager.snapshot().ref_counts
        shared_seen |= max(refs) >= 2
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    assert shared_seen
    assert eng.get_stats().num_kv_blocks_used == 0


def test_logprobs(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 5
    total = 0.0
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert tid in entry and entry[tid].rank == 1 and 3 <= len(entry) <= 4
        assert max(v.logprob for v in entry.values()) == entry[tid].logprob <= 0
        assert isinstance(entry[tid].decoded_token, str)
        total += entry[tid].logprob
    assert c.cumulative_logprob == pytest.approx(total)
    plain = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_chat_applies_the_template(llm):
    outs = llm.chat(
        [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]],
        SamplingParams(temperature=0, max_tokens=3),
        use_tqdm=False,
    )
    assert outs[0].prompt.startswith("<|im_start|>user\nHi") and outs[0].prompt.endswith("assistant\n")
    tok = llm.get_tokenizer()
    assert outs[1].prompt_token_ids == tok.encode(outs[1].prompt, add_special_tokens=False)
    one = llm.chat(
        [{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_stats_and_last_step(engine):
    before = engine.get_stats()
    engine.add_request("x", list(range(1, 40)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    snap = engine.last_step
    assert snap.request_ids == ["x"] and snap.query_lens == [39] and snap.seq_lens == [39]
    assert snap.block_size == 16 and len(snap.block_tables[0]) == 3 and snap.kind == "prefill"
    drain(engine)
    after = engine.get_stats()
    assert after.prompt_tokens_total - before.prompt_tokens_total == 39
    assert after.generation_tokens_total - before.generation_tokens_total == 3
    assert after.num_kv_blocks_total == 64 and after.num_kv_blocks_used == 0
    pool = engine.block_manager.snapshot()
    assert pool.num_blocks == 64 and len(pool.ref_counts) == len(pool.free) == len(pool.block_hash_set) == 64


def test_engine_kwargs_are_checked(tiny_qwen3):
    with pytest.raises(TypeError, match="bogus"):
        LLMEngine(tiny_qwen3, bogus=1)
    with pytest.raises(ValueError, match="block_size"):
        LLMEngine(tiny_qwen3, block_size=0)


def _start_unfrozen() -> None:
    """Give back what something outside tilellm froze before the test (on the H200 machine the
    test process already holds 375 frozen objects; tilellm freezes only in `frozen_heap` and in
    the server's engine process): these tests need a heap nobody froze."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_generate_runs_with_the_heap_frozen(llm, monkeypatch):
    """Each step of `LLM.generate` runs with the heap from before the call frozen (so a full
    collection does not scan the engine's start-up objects); after it everything is collectable
    again, also when a step raises. (Frozen objects that die leave the count: only "some" and
    "none" are compared.)"""
    import gc

    engine = llm.llm_engine
    seen = []
    step = engine.step

    def recording_step(**kwargs):
        seen.append(gc.get_freeze_count())
        return step(**kwargs)

    monkeypatch.setattr(engine, "step", recording_step)
    _start_unfrozen()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0

    def failing_step(**kwargs):
        raise RuntimeError("step failed")

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert gc.get_freeze_count() == 0


def test_frozen_heap_nests_and_keeps_a_freeze_it_did_not_make():
    import gc

    from tilellm.engine.llm import frozen_heap

    _start_unfrozen()
    with frozen_heap():
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the inner exit does not unfreeze
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the caller's own
    try:
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("setting", ["sync", "async", "deltas", "speculative"])
def test_output_kinds(tiny_qwen3, setting):
    """FINAL_ONLY: one output, finished, with every token, the text and the logprobs that the
    other kinds end with; DELTA: outputs that join into the same; CUMULATIVE: growing outputs.
    Under asynchronous scheduling, the server's delta engine and speculative decoding too."""
    from tilellm.engine.sampling_params import RequestOutputKind as Kind

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    eng = LLMEngine(
        tiny_qwen3, num_kv_blocks=64, max_model_len=128, max_num_seqs=8,
        speculative_config=spec if setting == "speculative" else None,
    )  # fmt: skip
    eng.async_scheduling = setting == "async"
    eng.output_deltas = setting == "deltas"
    prompt = "the cat sat on the mat, the cat sat on the"  # repeats: n-gram drafts are found
    for kind in Kind:
        params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2, output_kind=kind)
        eng.add_request(kind.name, prompt, params)
    outs = drain(eng)
    final = outs["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished
    last = final[0].outputs[0]
    assert len(last.token_ids) == 14 and len(last.logprobs) == 14
    assert last.text == eng.tokenizer.decode(last.token_ids, skip_special_tokens=True)
    delta = outs["DELTA"]
    assert len(delta) > 1
    assert [t for o in delta for t in o.outputs[0].token_ids] == last.token_ids
    assert "".join(o.outputs[0].text for o in delta) == last.text
    assert [lp for o in delta for lp in o.outputs[0].logprobs] == last.logprobs
    cumulative = outs["CUMULATIVE"]
    if setting == "deltas":  # the engine's own setting: delta outputs for CUMULATIVE requests
        assert [t for o in cumulative for t in o.outputs[0].token_ids] == last.token_ids
    else:
        assert len(cumulative) > 1 and cumulative[-1].outputs[0].token_ids == last.token_ids
        assert cumulative[-1].outputs[0].text == last.text
    assert final[0].metrics.first_token_time < final[0].metrics.finished_time
    if setting == "speculative":
        assert eng.spec_stats.num_drafts > 0, "no draft was verified: the verification path is untested"


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="SamplingParams.output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=2)


@pytest.mark.parametrize("setting", ["sync", "async", "speculative"])
def test_stream_interval(tiny_qwen3, setting):
    """stream_interval N: a streamed request's first token at once, then an output whenever N
    tokens are waiting, and the rest when it finishes; the tokens and text are those of N = 1."""
    from tilellm.engine.sampling_params import RequestOutputKind as Kind

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    runs = {}
    for interval in (1, 4):
        eng = LLMEngine(
            tiny_qwen3, num_kv_blocks=64, max_model_len=128, max_num_seqs=8, stream_interval=interval,
            speculative_config=spec if setting == "speculative" else None,
        )  # fmt: skip
        eng.async_scheduling = setting == "async"
        prompt = "the cat sat on the mat, the cat sat on the"
        for kind in (Kind.DELTA, Kind.CUMULATIVE):
            params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, output_kind=kind)
            eng.add_request(kind.name, prompt, params)
        runs[interval] = drain(eng)
    for kind in ("DELTA", "CUMULATIVE"):
        one, four = runs[1][kind], runs[4][kind]
        if kind == "DELTA":
            sizes = [len(o.outputs[0].token_ids) for o in four]
            tokens = [t for o in four for t in o.outputs[0].token_ids]
            text = "".join(o.outputs[0].text for o in four)
        else:
            counts = [len(o.outputs[0].token_ids) for o in four]
            sizes = [b - a for a, b in zip([0, *counts], counts)]
            tokens, text = four[-1].outputs[0].token_ids, four[-1].outputs[0].text
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 17, sizes
        if setting != "speculative":  # one token a step: exactly every 4th
            assert sizes == [1, 4, 4, 4, 4], sizes
        assert tokens == [t for o in runs[1]["DELTA"] for t in o.outputs[0].token_ids]
        assert text == "".join(o.outputs[0].text for o in runs[1]["DELTA"])
        assert len(four) < len(one)


def test_stream_interval_is_checked(tiny_qwen3):
    with pytest.raises(ValueError, match="stream_interval must be a positive integer"):
        LLMEngine(tiny_qwen3, stream_interval=0)
