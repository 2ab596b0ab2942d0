"""The block manager under speculative decoding: allocation for drafts, rollback (`trim`), commits.

A model of the scheduler and the engine drives a `BlockManager` through random operations, as
`Scheduler.schedule` and `LLMEngine._postprocess_verified` use it: admission with prefix-cache
hits and chunked prefill, decodes, verification steps of a d-token draft (1 + d slots, the draft
not in `token_ids`, a + 1 tokens emitted for a accepted drafts, `num_computed_tokens` set back,
`trim`, `commit`), preemption (the latest admitted), aborts and finishes. The model also keeps
what the K/V cache holds: every computed slot records the token whose K/V it received, rejected
drafts included, so that what is registered in the prefix cache can be checked against both the
accepted tokens and the cache content.
"""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tilellm.cache.block_manager import SHARED_ROOT, BlockManager, chain_hash, request_root
from tilellm.engine.request import Request, Sequence, SequenceStatus
from tilellm.engine.sampling_params import SamplingParams

MAX_LEN = 20  # max_model_len: a sequence ends ("length") when it holds this many tokens
VOCAB = 5  # few token ids: prompts, outputs and drafts collide, prefixes are shared
PREFIXES = [
    [1, 2, 3, 4, 1, 2, 3, 4, 0, 0, 1, 2],
    [1, 2, 3, 4, 0, 1, 1, 0, 2, 2, 3, 3],
    [4, 3, 2, 1, 0, 4, 3, 2, 1, 0, 4, 3],
]
_ids = itertools.count()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tokens_of(data: bytes) -> list[int]:
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]


class SpecDecodeModel:
    """The scheduler's and the engine's use of one BlockManager, one operation at a time."""

    def __init__(self, block_size: int, num_blocks: int, prefix_caching: bool, max_num_seqs: int):
        self.bs = block_size
        self.caching = prefix_caching
        self.max_num_seqs = max_num_seqs
        self.bm = BlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=prefix_caching,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=cdiv(MAX_LEN, block_size),
        )
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.requests: list[Request] = []
        self.accepted: dict[int, list[int]] = {}  # seq_id -> its tokens, as the model emitted them
        self.kv = [[None] * block_size for _ in range(num_blocks)]  # token whose K/V a slot holds
        self.chains: dict[int, list[bytes]] = {}  # seq_id -> hashes of its accepted full blocks
        self.stats = collections.Counter()

    # -- the scheduler's side ---------------------------------------------------------------

    def add(self, prompt: list[int], n: int) -> Request:
        rid = f"r{next(_ids)}"
        root = SHARED_ROOT if self.caching else (request_root(rid) if n > 1 else None)
        req = Request(rid, None, list(prompt), SamplingParams(n=n), [0] * n, root, 0.0)
        self.requests.append(req)
        for s in req.seqs:
            self.accepted[s.seq_id] = list(prompt)
        self.waiting.append(req.seqs[0])  # samples 1.. are queued after sample 0's first token
        return req

    def admit(self, budget: int, token: int) -> bool:
        """The scheduler's admission of `waiting[0]` (cached prefix, then a prompt chunk)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        bm, seq = self.bm, self.waiting[0]
        hits = bm.lookup_prefix(seq)
        num_cached = len(hits) * self.bs
        total = len(seq.token_ids)
        n = min(total - num_cached, budget)
        if not bm.allocate(seq, n, hits):
            self.stats["admission refused"] += 1
            return False
        self.stats["prefix hit"] += bool(hits)
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._compute(seq, num_cached, n, [])
        seq.num_computed_tokens = num_cached + n
        bm.commit(seq)
        if num_cached + n == total:
            self._emit_plain(seq, token)
        return True

    def step(self, seq: Sequence, budget: int, draft: list[int], accept: int, tokens: list[int], stop_at):
        """One step of a running sequence: a prompt chunk, a decode, or a draft's verification."""
        bm, bs = self.bm, self.bs
        start, total = seq.num_computed_tokens, len(seq.token_ids)
        num_drafts = 0
        if start == total - 1:  # decoding: the engine proposes at most the room left
            num_drafts = max(0, min(len(draft), MAX_LEN - total - 1, budget - 1))
        draft = draft[:num_drafts]
        n = min(total - start, budget) + num_drafts
        if start + n > len(seq.block_table) * bs:
            if num_drafts and not bm.allocate(seq, n):  # a draft never costs a preemption
                self.stats["draft dropped"] += 1
                n -= num_drafts
                num_drafts = 0
                draft = []
            while start + n > len(seq.block_table) * bs and not bm.allocate(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return
        self._compute(seq, start, n, draft)
        seq.num_computed_tokens = start + n
        bm.commit(seq)  # at scheduling: the draft is not in token_ids, so never committed
        if start + n < total:
            return  # a prompt chunk that does not reach the end samples nothing
        if not num_drafts:
            self._emit_plain(seq, tokens[0])
            return
        self._verify(seq, draft, min(accept, num_drafts), tokens, stop_at)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats["preempted"] += 1

    def finish(self, seq: Sequence) -> None:
        """`Scheduler.finish`: a stop, the length limit, or an abort."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, req: Request) -> None:
        for s in req.seqs:
            if s.status is not SequenceStatus.FINISHED:
                self.finish(s)

    # -- the engine's side -------------------------------------------------------------------

    def _compute(self, seq: Sequence, start: int, n: int, draft: list[int]) -> None:
        """The step's K/V writes: tokens [start, start + n), the draft after the known tokens."""
        bm, bs = self.bm, self.bs
        known = seq.token_ids
        for p in range(start, start + n):
            b = seq.block_table[p // bs]
            assert bm.ref_counts[b] == 1, f"a step writes into block {b}, shared by {bm.ref_counts[b]}"
            assert bm.block_hash[b] is None, f"a step writes into block {b}, registered in the cache"
            self.kv[b][p % bs] = known[p] if p < len(known) else draft[p - len(known)]

    def _append(self, seq: Sequence, token: int, placeholder: bool) -> None:
        if placeholder:  # the step's first token replaces its placeholder
            assert seq.token_ids[-1] == -1 and seq.num_pending == 1
            seq.token_ids[-1] = token
            seq.num_pending = 0
        else:
            seq.token_ids.append(token)
        self.accepted[seq.seq_id].append(token)
        req = seq.request
        if not req.siblings_queued and seq.index == 0:  # `_check_stop` of the first token
            req.siblings_queued = True
            self.waiting.extendleft(reversed(req.seqs[1:]))

    def _emit_plain(self, seq: Sequence, token: int) -> None:
        """`_postprocess`: the sampled token, then commit; a sequence at max length ends."""
        seq.token_ids.append(-1)  # the launch's placeholder
        seq.num_pending = 1
        self._append(seq, token, placeholder=True)
        self.bm.commit(seq)
        if len(seq.token_ids) >= MAX_LEN:
            self.finish(seq)

    def _verify(self, seq: Sequence, draft: list[int], a: int, tokens: list[int], stop_at) -> None:
        """`_postprocess_verified` of a sequence whose d drafts were checked, a of them accepted."""
        bm, bs = self.bm, self.bs
        d = len(draft)
        seq.token_ids.append(-1)
        seq.num_pending = 1
        old_len = len(seq.token_ids) - 1
        bonus = tokens[0] if a == d else (draft[a] + 1 + tokens[0] % (VOCAB - 1)) % VOCAB
        emitted = draft[:a] + [bonus]  # the token at a rejected position differs from the draft
        self.stats[
            "drafts all rejected" if a == 0 else "drafts all accepted" if a == d else "drafts partly accepted"
        ] += 1
        for j, token in enumerate(emitted):
            self._append(seq, token, placeholder=j == 0)
            if stop_at == j or len(seq.token_ids) >= MAX_LEN:  # a stop inside the accepted run
                self.finish(seq)
                self.stats["stopped in a verification"] += 1
                return
        table_before = len(seq.block_table)
        seq.num_computed_tokens = old_len + a
        bm.trim(seq, len(seq.token_ids))
        bm.commit(seq)
        self.stats["trimmed"] += len(seq.block_table) < table_before
        # The blocks of the sequence now: those of its tokens, but none of a rejected draft.
        need = cdiv(len(seq.token_ids), bs)
        assert len(seq.block_table) == min(table_before, need)
        if len(seq.block_table) < need:  # every draft accepted, the bonus token opens a block:
            assert a == d and len(seq.token_ids) - 1 == len(seq.block_table) * bs  # next step's
        assert len(seq.block_table) * bs >= seq.num_computed_tokens

    # -- invariants ----------------------------------------------------------------------------

    def _chain(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks of the sequence's accepted tokens (computed by the test)."""
        chain = self.chains.setdefault(seq.seq_id, [])
        toks = self.accepted[seq.seq_id]
        bs = self.bs
        while len(chain) < len(toks) // bs:
            j = len(chain)
            data = b"".join(t.to_bytes(8, "little", signed=True) for t in toks[j * bs : (j + 1) * bs])
            chain.append(chain_hash(chain[-1] if chain else seq.cache_root, data))
        return chain

    def check(self) -> None:
        bm, bs = self.bm, self.bs
        seqs = [s for r in self.requests for s in r.seqs]
        # Tokens: what the model emitted, no placeholder left between operations.
        for s in seqs:
            assert s.num_pending == 0 and s.token_ids == self.accepted[s.seq_id]
        # Reference counts: exactly the live sequences' block tables.
        refs = collections.Counter()
        rows = set()
        for s in self.running:
            assert s.status is SequenceStatus.RUNNING
            refs.update(s.block_table)
            assert len(set(s.block_table)) == len(s.block_table)
            assert 0 <= s.row < self.max_num_seqs and s.row not in rows
            rows.add(s.row)
            width = len(s.block_table)
            assert bm.block_tables[s.row, :width].tolist() == s.block_table
            assert (bm.block_tables[s.row, width:] == -1).all()
            # Enough blocks for the computed tokens; none past the known tokens.
            assert width * bs >= s.num_computed_tokens
            assert width <= cdiv(len(s.token_ids), bs), "a block beyond the tokens (a rejected draft's)"
            assert s.num_hashed_blocks <= width
            # Computed K/V is that of the accepted tokens.
            for p in range(s.num_computed_tokens):
                assert self.kv[s.block_table[p // bs]][p % bs] == s.token_ids[p], f"K/V of {s!r} at {p}"
        for s in seqs:
            if s.status is not SequenceStatus.RUNNING:
                assert s.block_table == [] and s.row == -1
        for r in range(self.max_num_seqs):
            if r not in rows:
                assert (bm.block_tables[r] == -1).all()
        for b in range(bm.num_blocks):
            assert bm.ref_counts[b] == refs[b], f"block {b}: ref {bm.ref_counts[b]}, held by {refs[b]}"
        free_uncached, evictable = set(bm.free_uncached), set(bm.evictable)
        assert len(free_uncached) == len(bm.free_uncached) and not free_uncached & evictable
        assert all(bm.ref_counts[b] == 0 for b in free_uncached | evictable)
        assert len(free_uncached) + len(evictable) + len(refs) == bm.num_blocks
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert bm.num_used_blocks == len(refs)
        if not self.caching:
            assert not evictable
        # The prefix cache: every registered block holds accepted tokens, whose K/V it stores.
        truth: dict[bytes, tuple[bytes, bytes]] = {}
        for s in seqs:
            if s.cache_root is None:
                continue
            chain = self._chain(s)
            toks = self.accepted[s.seq_id]
            for j, h in enumerate(chain):
                data = b"".join(t.to_bytes(8, "little", signed=True) for t in toks[j * bs : (j + 1) * bs])
                truth[h] = (chain[j - 1] if j else s.cache_root, data)
        for h, b in bm.hash_to_block.items():
            assert bm.block_hash[b] == h
            assert h in truth, f"block {b} is registered for tokens no sequence has accepted"
            assert bm.block_key[b] == truth[h]
            assert self.kv[b] == tokens_of(bm.block_key[b][1]), f"block {b}: cached K/V is not its key's"
        for b in range(bm.num_blocks):
            if bm.block_hash[b] is not None:
                assert bm.hash_to_block.get(bm.block_hash[b]) == b
            else:
                assert bm.block_key[b] is None
        for b in evictable:
            assert bm.block_hash[b] is not None
        # A live sequence's registered blocks hold its own tokens at their positions.
        for s in self.running:
            if s.cache_root is None:
                assert not any(bm.block_hash[b] is not None for b in s.block_table)
                continue
            chain = self._chain(s)
            for j, b in enumerate(s.block_table):
                if bm.block_hash[b] is not None:
                    assert j < len(chain) and bm.block_hash[b] == chain[j], f"block {j} of {s!r}"
                    assert (j + 1) * bs <= s.num_computed_tokens


# -- random operations ------------------------------------------------------------------------


class BlockManagerSpecMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(1, 4),
        extra_blocks=st.integers(0, 6),
        prefix_caching=st.booleans(),
        max_num_seqs=st.integers(1, 4),
        prompts=st.lists(st.tuples(st.integers(0, len(PREFIXES) - 1), st.integers(1, 12)), max_size=3),
    )
    def setup(self, block_size, extra_blocks, prefix_caching, max_num_seqs, prompts):
        # The engine caps max_model_len at the pool: a sequence alone always fits.
        num_blocks = cdiv(MAX_LEN, block_size) + extra_blocks
        self.m = SpecDecodeModel(block_size, num_blocks, prefix_caching, max_num_seqs)
        for prefix, length in prompts:  # requests sharing prefixes, admitted at once
            self.m.add(PREFIXES[prefix][:length], 1)
        while self.m.admit(64, 0):
            pass

    # Rules do nothing where they do not apply (no precondition: every rule is always drawable).

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, len(PREFIXES[0])),
        own=st.lists(st.integers(0, VOCAB - 1), max_size=5),
        n=st.integers(1, 2),
    )
    def add_request(self, prefix, prefix_len, own, n):
        if len(self.m.requests) < 10:
            self.m.add((PREFIXES[prefix][:prefix_len] + own)[: MAX_LEN - 2] or [0], n)

    @rule(budget=st.integers(1, 24), token=st.integers(0, VOCAB - 1))
    def admit(self, budget, token):
        self.m.admit(budget, token)

    def _pick(self, i: int, decoding: bool) -> Sequence | None:
        seqs = [s for s in self.m.running if (s.num_computed_tokens == len(s.token_ids) - 1) == decoding]
        return seqs[i % len(seqs)] if seqs else None

    @rule(i=st.integers(0, 7), budget=st.integers(1, 12), token=st.integers(0, VOCAB - 1))
    def prefill_chunk(self, i, budget, token):
        seq = self._pick(i, decoding=False)
        if seq is not None:
            self.m.step(seq, budget, [], 0, [token], None)

    @rule(i=st.integers(0, 7), token=st.integers(0, VOCAB - 1))
    def decode(self, i, token):
        seq = self._pick(i, decoding=True)
        if seq is not None:
            self.m.step(seq, 1, [], 0, [token], None)

    @rule(
        i=st.integers(0, 7),
        budget=st.integers(1, 12),
        draft=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
        accept=st.integers(0, 6),
        token=st.integers(0, VOCAB - 1),
        stop_at=st.one_of(st.none(), st.integers(0, 6)),
    )
    def verify(self, i, budget, draft, accept, token, stop_at):
        seq = self._pick(i, decoding=True)
        if seq is not None:
            self.m.step(seq, budget, draft, accept, [token], stop_at)

    @rule(
        i=st.integers(0, 7),
        draft=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
        token=st.integers(0, VOCAB - 1),
    )
    def verify_all_rejected(self, i, draft, token):
        seq = self._pick(i, decoding=True)
        if seq is not None:
            self.m.step(seq, 16, draft, 0, [token], None)

    @rule(
        budget=st.integers(1, 32),
        plan=st.lists(
            st.tuples(
                st.lists(st.integers(0, VOCAB - 1), max_size=5),  # draft
                st.integers(0, 5),  # accepted
                st.integers(0, VOCAB - 1),  # next token
            ),
            min_size=4,
            max_size=4,
        ),
    )
    def schedule_all(self, budget, plan):
        """A whole step: every running sequence, oldest first, while the token budget lasts."""
        m = self.m
        for k, seq in enumerate(list(m.running)):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier one
                continue
            draft, accept, token = plan[k % len(plan)]
            before = seq.num_computed_tokens
            m.step(seq, budget, draft, accept, [token], None)
            if seq.status is SequenceStatus.RUNNING:
                budget -= max(seq.num_computed_tokens - before, 1)
        while m.admit(max(budget, 1), 0):
            pass

    @rule(kind=st.sampled_from(["preempt", "finish", "abort"]), i=st.integers(0, 9))
    def disrupt(self, kind, i):
        m = self.m
        if kind == "abort":
            live = [r for r in m.requests if not r.is_finished]
            if live:
                m.abort(live[i % len(live)])
        elif m.running:
            if kind == "preempt":  # the scheduler's victim: the latest admitted
                m.preempt(m.running[-1])
            else:
                m.finish(m.running[i % len(m.running)])

    @invariant()
    def pool_is_consistent(self):
        self.m.check()

    def teardown(self):
        m = getattr(self, "m", None)
        if m is None:
            return
        for key, count in m.stats.items():
            if count:
                event(key)
        for r in list(m.requests):  # everything back: the pool whole again
            m.abort(r)
        m.check()
        assert m.bm.num_free_blocks == m.bm.num_blocks and not any(m.bm.ref_counts)


BlockManagerSpecMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerSpec = BlockManagerSpecMachine.TestCase


# -- hand-written scenarios -------------------------------------------------------------------


def _decoding(model: SpecDecodeModel, prompt: list[int]) -> Sequence:
    req = model.add(prompt, 1)
    assert model.admit(budget=64, token=0)
    seq = req.seqs[0]
    assert seq.num_computed_tokens == len(seq.token_ids) - 1
    return seq


@pytest.mark.parametrize("caching", [True, False])
def test_rejected_drafts_release_their_blocks(caching):
    m = SpecDecodeModel(block_size=2, num_blocks=12, prefix_caching=caching, max_num_seqs=2)
    seq = _decoding(m, [1, 2, 3])  # 3 prompt tokens + 1 sampled: computed 3, 2 blocks
    assert len(seq.block_table) == 2
    m.step(seq, budget=16, draft=[4, 4, 4, 4, 4], accept=0, tokens=[0], stop_at=None)
    # 1 + 5 slots were allocated (positions 3..8: blocks up to 5); 0 accepted -> 5 tokens, 3 blocks.
    assert len(seq.token_ids) == 5 and seq.num_computed_tokens == 4
    assert len(seq.block_table) == 3 and m.bm.num_free_blocks == 12 - 3
    m.check()


def test_all_drafts_accepted_keep_the_bonus_block_for_the_next_step():
    m = SpecDecodeModel(block_size=2, num_blocks=12, prefix_caching=True, max_num_seqs=2)
    seq = _decoding(m, [1, 2, 3])  # tokens 1 2 3 t, computed 3
    m.step(seq, budget=16, draft=[4, 0], accept=2, tokens=[3], stop_at=None)
    # Positions 3, 4, 5 computed (t, 4, 0): 3 blocks; emitted 4 0 + bonus -> 7 tokens, 6 computed.
    assert seq.token_ids[4:] == [4, 0, 3] and seq.num_computed_tokens == 6
    assert len(seq.block_table) == 3  # the bonus token's block comes with the next step
    m.check()
    m.step(seq, budget=16, draft=[], accept=0, tokens=[1], stop_at=None)
    assert len(seq.block_table) == 4 and seq.num_computed_tokens == 7
    m.check()


def test_accepted_drafts_become_prefix_cache_hits_and_rejected_ones_never_do():
    m = SpecDecodeModel(block_size=2, num_blocks=16, prefix_caching=True, max_num_seqs=4)
    seq = _decoding(m, [1, 2, 3])  # 1 2 3 t
    t = seq.token_ids[3]
    m.step(seq, budget=16, draft=[2, 2, 2], accept=1, tokens=[0], stop_at=None)
    bonus = seq.token_ids[-1]
    assert seq.token_ids == [1, 2, 3, t, 2, bonus] and bonus != 2
    m.check()
    # [1 2] [3 t] are computed and registered; [2 bonus] is not computed yet (position 5).
    assert len(m.bm.hash_to_block) == 2
    other = m.add([1, 2, 3, t, 2, bonus, 0], 1).seqs[0]
    assert m.bm.lookup_prefix(other) == seq.block_table[:2]
    # The rejected draft token (2 at position 5) is not what a hit can return.
    rejected = m.add([1, 2, 3, t, 2, 2, 0], 1).seqs[0]
    assert m.bm.lookup_prefix(rejected) == seq.block_table[:2]
    m.step(seq, budget=16, draft=[], accept=0, tokens=[4], stop_at=None)  # computes position 5
    assert len(m.bm.hash_to_block) == 3
    assert m.bm.lookup_prefix(other) == seq.block_table[:3]
    assert m.bm.lookup_prefix(rejected) == seq.block_table[:2]
    m.check()


def test_a_draft_that_does_not_fit_is_dropped_without_preempting():
    m = SpecDecodeModel(block_size=2, num_blocks=cdiv(MAX_LEN, 2), prefix_caching=False, max_num_seqs=2)
    a = _decoding(m, [1, 2, 3, 4, 0, 1, 2, 3, 4])  # 10 tokens, computed 9: 5 blocks
    b = _decoding(m, [1, 2, 3, 4, 0])  # 6 tokens, computed 5: 3 blocks; 2 left in the pool
    assert m.bm.num_free_blocks == 2
    m.step(b, budget=16, draft=[1] * 8, accept=8, tokens=[0], stop_at=None)
    # 1 + 8 slots would need 7 blocks: the draft is dropped, b decodes one token, a keeps running.
    assert m.stats["draft dropped"] == 1 and not m.stats["preempted"]
    assert a in m.running and len(b.token_ids) == 7 and b.num_computed_tokens == 6
    m.check()


def test_siblings_share_only_their_request_blocks_without_prefix_caching():
    m = SpecDecodeModel(block_size=2, num_blocks=20, prefix_caching=False, max_num_seqs=4)
    req = m.add([1, 2, 3, 4, 0], 2)
    assert m.admit(budget=64, token=3)
    s0, s1 = req.seqs
    assert m.waiting[0] is s1  # queued after sample 0's first token
    assert m.admit(budget=64, token=1)
    assert s1.block_table[:2] == s0.block_table[:2]
    m.step(s0, budget=16, draft=[2, 2, 2], accept=3, tokens=[4], stop_at=None)
    m.step(s1, budget=16, draft=[2, 2, 2], accept=0, tokens=[4], stop_at=None)
    m.check()
    m.abort(req)
    m.check()
    assert not m.bm.hash_to_block and m.bm.num_free_blocks == 20
