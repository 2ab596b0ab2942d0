"""The KV block pool: fixed-size blocks, reference counts, and prefix caching.

Every sequence owns a list of physical block ids (its block table); logical block `j` holds its
tokens `[j * block_size, (j + 1) * block_size)`. Blocks are handed out from a preallocated pool
on demand and come back when a sequence finishes, is aborted or is preempted.

Prefix caching: once a block is full and its K/V computed, it is registered under a hash chained
from its parent block's hash and its own token ids (blake2b: stable across processes). A new
sequence looks its full prompt blocks up in that table; a hit is confirmed against the stored
(parent hash, token ids) before it is shared, and shared blocks are reference counted. A block
nobody references keeps its hash and stays reusable until the pool needs it: such blocks are
evicted in least-recently-freed order, after the blocks that hold nothing cached. The last,
partial block of a sequence is never registered, so it is never shared.

With prefix caching off, only the `n` samples of one request share blocks (their hash chains
start from a per-request root), and a block forgets its hash as soon as nobody references it.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from tilellm.engine.request import Sequence

_HASH_BYTES = 16
SHARED_ROOT = hashlib.blake2b(b"tilellm-prefix-cache-root", digest_size=_HASH_BYTES).digest()


def request_root(request_id: str) -> bytes:
    """Hash-chain root that only the samples of one request share (prefix caching off)."""
    return hashlib.blake2b(b"tilellm-request:" + request_id.encode(), digest_size=_HASH_BYTES).digest()


def chain_hash(parent: bytes, token_bytes: bytes) -> bytes:
    """Hash of a full block: its parent's hash followed by its token ids (int64 bytes)."""
    return hashlib.blake2b(parent + token_bytes, digest_size=_HASH_BYTES).digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PoolSnapshot:
    """State of every physical block at one moment (for the inspector and tests)."""

    num_blocks: int
    block_size: int
    ref_counts: list[int]
    block_hash_set: list[bool]  # registered in the prefix cache (full, computed)
    free: list[bool]  # referenced by no sequence (cached ones stay reusable until evicted)


class BlockManager:
    """Hands out KV blocks to sequences and shares cached prefix blocks between them.

    `block_tables[seq.row, :len(seq.block_table)]` mirrors each holding sequence's block table as
    an int32 array (-1 after its last block), so that a step's metadata is one gather instead of
    a loop over requests.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_blocks_per_seq: int = 4096,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_blocks_per_seq = max_blocks_per_seq
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # What a hit must match: (parent hash, token bytes) of the block registered under a hash.
        self.block_key: list[tuple[bytes, bytes] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free_uncached: collections.deque[int] = collections.deque(range(num_blocks))
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.block_tables = np.full((max_num_seqs, max_blocks_per_seq), -1, dtype=np.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found in the cache

    # -- pool state --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: never used or cached but unreferenced (evictable)."""
        return len(self.free_uncached) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            ref_counts=list(self.ref_counts),
            block_hash_set=[h is not None for h in self.block_hash],
            free=[rc == 0 for rc in self.ref_counts],
        )

    # -- prefix cache --------------------------------------------------------------------------

    def _token_bytes(self, seq: Sequence, first_block: int, end_block: int) -> bytes:
        bs = self.block_size
        return np.asarray(seq.token_ids[first_block * bs : end_block * bs], dtype=np.int64).tobytes()

    def _ensure_hashes(self, seq: Sequence, num_blocks: int, data: bytes | None = None) -> None:
        """Extend `seq.block_hashes` to its first `num_blocks` blocks (which must be full)."""
        first = len(seq.block_hashes)
        if first >= num_blocks:
            return
        assert seq.cache_root is not None
        width = self.block_size * 8
        chunk = self._token_bytes(seq, first, num_blocks) if data is None else data[first * width :]
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_root
        for k in range(num_blocks - first):
            parent = chain_hash(parent, chunk[k * width : (k + 1) * width])
            seq.block_hashes.append(parent)

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq` (not yet referenced by it).

        At most `(num_tokens - 1) // block_size` blocks: at least the last token is computed again,
        as its logits are needed to sample.
        """
        if seq.cache_root is None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return []
        data = self._token_bytes(seq, 0, max_blocks)
        self._ensure_hashes(seq, max_blocks, data)
        width = self.block_size * 8
        hits: list[int] = []
        parent = seq.cache_root
        for j in range(max_blocks):
            h = seq.block_hashes[j]
            b = self.hash_to_block.get(h)
            if b is None or self.block_key[b] != (parent, data[j * width : (j + 1) * width]):
                break
            hits.append(b)
            parent = h
        return hits

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full of known tokens and scheduled for computing.

        Called for every sequence a step schedules and again when its sampled tokens are read
        back (cheap when no block filled up). At scheduling, a sequence admitted later in the
        same step may then share them, which is safe because every attention layer stores the
        step's K/V before it reads the cache, and later steps run after this one on the device.
        Blocks holding a token still being sampled (a placeholder) are registered once it is known.
        """
        # The one guard of every caller: nothing to do unless hashing is on and a block filled up.
        if seq.cache_root is None or seq.num_computed_tokens // self.block_size <= seq.num_hashed_blocks:
            return
        known = min(seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending)
        num_full = min(known // self.block_size, len(seq.block_table))
        first = seq.num_hashed_blocks
        if num_full <= first:
            return
        data = self._token_bytes(seq, first, num_full)
        if len(seq.block_hashes) < num_full:
            self._ensure_hashes(seq, num_full)
        width = self.block_size * 8
        for j in range(first, num_full):
            b, h = seq.block_table[j], seq.block_hashes[j]
            if self.block_hash[b] is None and h not in self.hash_to_block:
                parent = seq.block_hashes[j - 1] if j else seq.cache_root
                self.block_hash[b] = h
                self.block_key[b] = (parent, data[(j - first) * width : (j - first + 1) * width])
                self.hash_to_block[h] = b
        seq.num_hashed_blocks = num_full

    def _forget(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self.block_hash[b] = None
            self.block_key[b] = None

    # -- allocation ----------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        """New blocks `seq` needs to hold `num_new_tokens` more tokens (after any cached blocks)."""
        num_tokens = seq.num_computed_tokens + num_cached_blocks * self.block_size + num_new_tokens
        return _cdiv(num_tokens, self.block_size) - len(seq.block_table) - num_cached_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | tuple = ()) -> bool:
        """Give `seq` the blocks for `num_new_tokens` more tokens, first taking `cached_blocks`.

        `cached_blocks` (from `lookup_prefix`) only when `seq` holds no blocks yet. Returns False,
        changing nothing, when the pool cannot supply them.
        """
        bs = self.block_size
        num_new_blocks = self.blocks_needed(seq, num_new_tokens, len(cached_blocks))
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if max(num_new_blocks, 0) + revived > self.num_free_blocks:
            return False
        first_alloc = seq.row < 0
        if first_alloc:
            assert not seq.block_table, "cached blocks only for a sequence without blocks"
            seq.row = self._free_rows.pop()
            if self.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += len(cached_blocks) * bs
        start = len(seq.block_table)
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
            seq.block_table.append(b)
        if cached_blocks:
            seq.num_hashed_blocks = len(cached_blocks)  # hits are registered already
        for _ in range(num_new_blocks):
            b = self._pop_free()
            self.ref_counts[b] = 1
            seq.block_table.append(b)
        if len(seq.block_table) > start:
            assert len(seq.block_table) <= self.max_blocks_per_seq, "sequence longer than max_model_len"
            self.block_tables[seq.row, start : len(seq.block_table)] = seq.block_table[start:]
        return True

    def _pop_free(self) -> int:
        if self.free_uncached:
            return self.free_uncached.popleft()
        b, _ = self.evictable.popitem(last=False)  # least recently freed cached block
        self._forget(b)
        return b

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s blocks past the first `ceil(num_tokens / block_size)` (speculative
        decoding: blocks that held only rejected draft tokens). Such blocks were allocated for
        this sequence alone and never registered (`commit` registers computed, known tokens
        only), so they go straight back to the pool."""
        keep = _cdiv(num_tokens, self.block_size)
        table = seq.block_table
        if len(table) <= keep:
            return
        for b in reversed(table[keep:]):
            rc = self.ref_counts[b] - 1
            assert rc == 0 and self.block_hash[b] is None, (
                f"block {b} of a rejected draft is shared or cached"
            )
            self.ref_counts[b] = 0
            self.free_uncached.append(b)
        self.block_tables[seq.row, keep : len(table)] = -1
        del table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; unreferenced cached blocks stay reusable until evicted."""
        # Tail blocks first: they are evicted first (they are the least likely to be shared).
        for b in reversed(seq.block_table):
            rc = self.ref_counts[b] - 1
            assert rc >= 0, f"block {b} freed more often than referenced"
            self.ref_counts[b] = rc
            if rc == 0:
                if self.enable_prefix_caching and self.block_hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self._forget(b)
                    self.free_uncached.append(b)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        if seq.row >= 0:
            self.block_tables[seq.row] = -1
            self._free_rows.append(seq.row)
            seq.row = -1
