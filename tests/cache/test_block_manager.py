"""Block manager: allocation, reference counts, prefix caching (hash chain + confirmation), LRU eviction."""

from __future__ import annotations

import pytest

from tilellm.cache import block_manager as bm_mod
from tilellm.cache.block_manager import SHARED_ROOT, BlockManager, request_root
from tilellm.engine.request import Request
from tilellm.engine.sampling_params import SamplingParams


def make_seq(tokens, root=SHARED_ROOT, rid="r", n=1):
    req = Request(rid, None, list(tokens), SamplingParams(n=n), [0] * n, root, 0.0)
    return req.seqs[0] if n == 1 else req.seqs


def compute(bm: BlockManager, seq, n: int | None = None, cached=()):
    """Admit/extend `seq` by n tokens (all remaining by default), as if the step ran, and commit."""
    start = len(cached) * bm.block_size if cached else seq.num_computed_tokens
    n = seq.num_tokens - start if n is None else n
    assert bm.allocate(seq, n, list(cached))
    seq.num_computed_tokens = start + n
    bm.commit(seq)


def test_allocate_free_roundtrip():
    bm = BlockManager(8, 4, max_num_seqs=4, max_blocks_per_seq=8)
    s = make_seq(range(10))
    compute(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in s.block_table)
    assert list(bm.block_tables[s.row, :3]) == s.block_table
    bm.free(s)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts) and s.row == -1


def test_allocate_fails_without_side_effects():
    bm = BlockManager(2, 4, max_num_seqs=4, max_blocks_per_seq=8)
    s = make_seq(range(12))
    assert not bm.allocate(s, 12)
    assert bm.num_free_blocks == 2 and s.block_table == [] and s.row == -1


def test_prefix_hit_shares_full_blocks_and_never_the_last_token():
    bm = BlockManager(16, 4, max_num_seqs=4, max_blocks_per_seq=8)
    a = make_seq(range(10))  # blocks [0-3] [4-7] [8-9 partial]
    compute(bm, a)
    assert sum(h is not None for h in bm.block_hash) == 2  # the partial block is not registered
    b = make_seq([*range(8), 50, 51])
    hits = bm.lookup_prefix(b)
    assert hits == a.block_table[:2]
    compute(bm, b, 2, cached=hits)
    assert bm.ref_counts[hits[0]] == 2 and b.block_table[:2] == hits and b.block_table[2] != a.block_table[2]
    # A prompt that is exactly the cached blocks: its last block is recomputed (logits needed).
    c = make_seq(range(8))
    assert bm.lookup_prefix(c) == a.block_table[:1]
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 10 + 10


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(16, 4, max_num_seqs=4, max_blocks_per_seq=8)
    compute(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit at all.
    assert bm.lookup_prefix(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_hash_collisions_are_confirmed_against_tokens(monkeypatch):
    monkeypatch.setattr(bm_mod, "chain_hash", lambda parent, data: b"same-hash-always")
    bm = BlockManager(16, 4, max_num_seqs=4, max_blocks_per_seq=8)
    a = make_seq([1, 2, 3, 4, 9])
    compute(bm, a)
    assert bm.lookup_prefix(make_seq([5, 6, 7, 8, 9])) == []  # same hash, other tokens
    assert bm.lookup_prefix(make_seq([1, 2, 3, 4, 0])) == a.block_table[:1]


def test_unreferenced_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 2, max_num_seqs=4, max_blocks_per_seq=4)
    a = make_seq([1, 2, 3, 4, 5])  # 2 full blocks + 1 partial
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and set(bm.evictable) == set(a_blocks[:2])
    # Still a hit while nobody needed the blocks.
    b = make_seq([1, 2, 3, 4, 6])
    hits = bm.lookup_prefix(b)
    assert hits == a_blocks[:2]
    compute(bm, b, 1, cached=hits)
    assert not bm.evictable
    bm.free(b)
    # Free blocks without a hash go first; then cached blocks, least recently freed first.
    c = make_seq(range(20, 27))
    assert bm.allocate(c, 7)
    assert bm.num_free_blocks == 0 and not bm.hash_to_block
    # b freed its tail block first, so it is evicted first.
    assert c.block_table[2:] == [a_blocks[1], a_blocks[0]]


def test_a_referenced_block_is_never_handed_out():
    bm = BlockManager(3, 2, max_num_seqs=4, max_blocks_per_seq=4)
    a = make_seq([1, 2, 3])
    compute(bm, a)
    b = make_seq([7, 8, 9, 10, 11])
    assert not bm.allocate(b, 5)  # only one block left
    assert bm.allocate(b, 2)
    assert not set(a.block_table) & set(b.block_table)


def test_prefix_caching_off_shares_only_within_a_request():
    bm = BlockManager(16, 2, enable_prefix_caching=False, max_num_seqs=4, max_blocks_per_seq=8)
    s0, s1 = make_seq([1, 2, 3, 4, 5], root=request_root("x"), rid="x", n=2)
    compute(bm, s0)
    hits = bm.lookup_prefix(s1)
    assert hits == s0.block_table[:2]
    other = make_seq([1, 2, 3, 4, 5], root=None, rid="y")
    assert bm.lookup_prefix(other) == []
    compute(bm, s1, 1, cached=hits)
    bm.free(s0)
    bm.free(s1)
    assert not bm.hash_to_block and not bm.evictable and bm.prefix_cache_queries == 0


def test_snapshot():
    bm = BlockManager(6, 2, max_num_seqs=2, max_blocks_per_seq=4)
    a = make_seq([1, 2, 3])
    compute(bm, a)
    snap = bm.snapshot()
    assert snap.num_blocks == 6 and snap.block_size == 2
    assert [snap.ref_counts[b] for b in a.block_table] == [1, 1]
    assert snap.block_hash_set[a.block_table[0]] and not snap.block_hash_set[a.block_table[1]]
    assert snap.free.count(True) == 4
    first = a.block_table[0]
    bm.free(a)
    snap = bm.snapshot()
    assert all(snap.free) and snap.block_hash_set[first]  # cached, unreferenced, reusable


def test_invalid_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
