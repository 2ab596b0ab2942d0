"""Property tests of scheduler + block manager + step metadata, through an engine with a fake model.

Random arrivals, prompt lengths with shared prefixes, output lengths, aborts, pool sizes, block
sizes and budgets: every request must finish (with exactly the reference tokens) or be aborted,
the pool must be whole again at the end, and at every step the reference counts must match the
block tables and no block in use may sit in a free list.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.engine.fakes import FakeEngine, reference_tokens
from tilellm.attention import BatchKind
from tilellm.engine.request import SequenceStatus
from tilellm.engine.sampling_params import SamplingParams


def check_pool(engine: FakeEngine) -> None:
    bm = engine.block_manager
    refs = collections.Counter()
    for seq in engine.scheduler.running:
        if seq.status is SequenceStatus.RUNNING:
            refs.update(seq.block_table)
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
            assert (bm.block_tables[seq.row, : len(seq.block_table)] == seq.block_table).all()
    for seq in engine.scheduler.waiting:
        assert not seq.block_table and seq.row == -1
    for b in range(bm.num_blocks):
        assert bm.ref_counts[b] == refs[b] >= 0, f"block {b}: ref {bm.ref_counts[b]} vs holders {refs[b]}"
    free_uncached, evictable = set(bm.free_uncached), set(bm.evictable)
    assert len(free_uncached) == len(bm.free_uncached) and not free_uncached & evictable
    for b in free_uncached | evictable:
        assert bm.ref_counts[b] == 0, f"block {b} is free but referenced"
    assert len(free_uncached) + len(evictable) + len(refs) == bm.num_blocks
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h
    for b in evictable:
        assert bm.block_hash[b] is not None
    assert len(engine.scheduler.running) <= engine.config.max_num_seqs


prompt_st = st.tuples(
    st.sampled_from([0, 1, 2]),  # which shared prefix
    st.integers(0, 40),  # shared prefix length
    st.lists(st.integers(0, 996), min_size=0, max_size=30),  # own tokens
)
request_st = st.tuples(
    prompt_st,
    st.integers(1, 20),  # max_tokens
    st.integers(0, 12),  # arrival step
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step
    st.integers(1, 3),  # n
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=1, max_size=14),
    block_size=st.sampled_from([1, 2, 4, 16]),
    extra_blocks=st.integers(0, 24),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_engine_random_workloads(
    requests, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, async_scheduling
):
    max_model_len = 64
    num_blocks = -(-max_model_len // block_size) + extra_blocks
    engine = FakeEngine(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 997, 40).tolist() for _ in range(3)]
    pending = []
    for i, ((which, plen, own), max_tokens, arrive, abort_at, n) in enumerate(requests):
        prompt = (prefixes[which][:plen] + own)[: max_model_len - 1] or [7]
        pending.append(
            (arrive, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, n=n), abort_at)
        )
    finished, aborted, expected = {}, set(), {}
    step = 0
    while step < 2000:
        for arrive, rid, prompt, params, _ in pending:
            if arrive == step:
                engine.add_request(rid, prompt, params)
                room = max_model_len - len(prompt)
                expected[rid] = reference_tokens(prompt, min(params.max_tokens, room))
        for _, rid, _, _, abort_at in pending:
            if abort_at == step and rid in engine.requests:
                assert engine.abort_request(rid)
                aborted.add(rid)
        if step > max(r[0] for r in pending) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check_pool(engine)
        if engine.last_step is not None:  # one-token entries lead each step (the decode kernel's
            q = engine.last_step.query_lens  # part), longest context first
            ones = [n == 1 for n in q]
            assert ones == sorted(ones, reverse=True), q
            decode_lens = engine.last_step.seq_lens[: sum(ones)]
            assert list(decode_lens) == sorted(decode_lens, reverse=True), decode_lens
        step += 1
    assert not engine.has_unfinished_requests(), "engine did not drain"
    for _, rid, _, params, _ in pending:
        assert (rid in finished) != (rid in aborted), rid
        if rid in finished:
            for comp in finished[rid].outputs:
                assert comp.token_ids == expected[rid], (rid, comp.index)
                assert comp.finish_reason == "length"
            assert len(finished[rid].outputs) == params.n
    bm = engine.block_manager
    stats = engine.get_stats()
    event(f"preempted={stats.num_preemptions > 0}")
    event(f"prefix hits={stats.prefix_cache_hits > 0}")
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert sorted(bm._free_rows) == list(range(max_num_seqs))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_happens_and_recomputes(async_scheduling):
    """A pool for two sequences at a time and eight requests: preemption must kick in."""
    engine = FakeEngine(
        block_size=4,
        num_kv_blocks=16,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=32,
        async_scheduling=async_scheduling,
    )
    prompts = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(8)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        check_pool(engine)
    assert engine.get_stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"].outputs[0].token_ids == reference_tokens(p, 20)


def test_chunked_prefill_and_mixed_batches():
    engine = FakeEngine(
        block_size=4, num_kv_blocks=64, max_num_batched_tokens=7, max_num_seqs=4, max_model_len=64
    )
    prompts = [list(range(1, 30)), [5, 6], list(range(40, 51))]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
            assert engine.last_step is not None and sum(engine.last_step.query_lens) <= 7
    assert {BatchKind.MIXED, BatchKind.PREFILL} <= set(engine.runner.kinds)
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"].outputs[0].token_ids == reference_tokens(p, 6)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_hits_counted(prefix_caching):
    engine = FakeEngine(
        block_size=4, num_kv_blocks=64, max_model_len=64, enable_prefix_caching=prefix_caching
    )
    shared = list(range(100, 120))
    engine.add_request("a", shared + [1], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", shared + [2, 3], SamplingParams(temperature=0, max_tokens=2))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    stats = engine.get_stats()
    if prefix_caching:
        assert out.num_cached_tokens == 20 and stats.prefix_cache_hits == 20
        assert stats.prefix_cache_queries == 21 + 22
    else:
        assert out.num_cached_tokens == 0 and stats.prefix_cache_hits == 0
    assert out.outputs[0].token_ids == reference_tokens(shared + [2, 3], 2)


def test_async_outputs_lag_one_step_and_abort_in_flight():
    engine = FakeEngine(block_size=4, num_kv_blocks=32, max_model_len=64, async_scheduling=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    engine.add_request("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=5))
    assert engine.step() == []  # step 1 launched, nothing read back yet
    outs = engine.step()  # step 2 launched, step 1 read
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert engine.abort_request("b")  # b has a token in flight: dropped, blocks freed now
    seen = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id] = o
    assert set(seen) == {"a"} and seen["a"].outputs[0].token_ids == reference_tokens([1, 2, 3], 5)
    assert all(t >= 0 for t in seen["a"].outputs[0].token_ids)
    engine.step()  # the speculative step of the finished request is read back and dropped
    assert engine.block_manager.num_free_blocks == 32


def test_requests_of_one_step_share_a_prefix():
    """Blocks are registered when scheduled: a later admission of the same step already hits them."""
    engine = FakeEngine(block_size=4, num_kv_blocks=64, max_model_len=64)
    shared = list(range(200, 220))
    for i in range(3):
        engine.add_request(f"s{i}", shared + [i], SamplingParams(temperature=0, max_tokens=3))
    outs = {}
    engine.step()
    step = engine.last_step
    # (s1 and s2 compute one token each: the scheduler lists them before s0's whole prompt)
    assert dict(zip(step.request_ids, step.num_cached_tokens)) == {"s0": 0, "s1": 20, "s2": 20}
    assert step.request_ids == ["s1", "s2", "s0"] and step.query_lens == [1, 1, 21]
    assert engine.last_step.kind == "mixed"
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    for i in range(3):
        assert outs[f"s{i}"].outputs[0].token_ids == reference_tokens(shared + [i], 3)
