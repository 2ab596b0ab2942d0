"""What the inspector shows, as plain data: the batch, its tile schedule and its page map.

An `Inspection` is built either from a batch the user describes (`describe_batch`, the
`(q_len, kv_len)` pairs of vLLM's kernel tests) or from the engine's last step
(`inspect_engine`). The renderers (`render_text`, `render_html`) only read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from tilellm.inspect.tiles import TileSchedule, mla_schedule, paged_schedule, prefill_schedule


@dataclass(frozen=True)
class RequestView:
    """One request of the step. Its new tokens are the last `q_len` of its `seq_len` positions."""

    index: int
    request_id: str
    q_len: int  # new tokens (queries) this step
    seq_len: int  # KV length after the step: context + q_len
    num_cached_tokens: int  # tokens of the context served by the prefix cache (engine steps)
    block_table: tuple[int, ...]  # logical block -> physical block

    @property
    def context_len(self) -> int:
        return self.seq_len - self.q_len

    @property
    def kind(self) -> str:
        if self.context_len == 0:
            return "prefill"
        if self.q_len == 1:
            return "decode"
        return "extend"  # new tokens after a context: cached prefix, chunked prefill or verification


@dataclass(frozen=True)
class BlockView:
    """One physical KV block of the pool."""

    block: int
    ref_count: int  # requests whose block tables hold it
    cached: bool  # full block with a prefix-cache hash (reusable by a later request)

    @property
    def state(self) -> str:
        if self.ref_count > 1:
            return "shared"
        if self.ref_count == 1:
            return "used"
        return "cached" if self.cached else "free"


@dataclass(frozen=True)
class PoolView:
    num_blocks: int
    block_size: int
    blocks: tuple[BlockView, ...]

    def count(self, state: str) -> int:
        return sum(1 for b in self.blocks if b.state == state)


@dataclass(frozen=True)
class Inspection:
    title: str
    source: str  # "described" | "engine"
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    requests: tuple[RequestView, ...]
    schedule: TileSchedule
    pool: PoolView
    notes: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.q_len for r in self.requests)

    @property
    def schedule_head(self) -> str:
        """What one program's `head` indexes: a query head (prefill, and hopper.py's chunks) or a
        KV head (paged.py, whose tiles pack a group's query heads)."""
        kernel = self.schedule.kernel
        return "query head" if kernel.startswith("prefill_attention") or "hopper.py" in kernel else "KV head"

    def tile_counts(self, request: int | None = None, head: int | None = None) -> dict[str, int]:
        progs = [
            p
            for p in self.schedule.programs
            if (request is None or p.request == request) and (head is None or p.head == head)
        ]
        return {
            "full": sum(p.full for p in progs),
            "diagonal": sum(p.diagonal for p in progs),
            "skipped": sum(p.skipped for p in progs),
        }


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_batch(spec: str) -> list[tuple[int, int]]:
    """`"1:1328,5:18,129:463"` -> [(1, 1328), (5, 18), (129, 463)]: (q_len, kv_len) per request.

    A bare number `n` means a prefill of n tokens (`n:n`).
    """
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?::(\d+))?", item)
        if m is None:
            raise ValueError(f"bad batch entry {item!r}: expected q_len:kv_len, e.g. 5:18")
        q_len = int(m.group(1))
        kv_len = int(m.group(2)) if m.group(2) is not None else q_len
        if q_len < 1 or kv_len < q_len:
            raise ValueError(f"bad batch entry {item!r}: need 1 <= q_len <= kv_len")
        pairs.append((q_len, kv_len))
    if not pairs:
        raise ValueError("empty batch: give at least one q_len:kv_len pair")
    return pairs


def parse_heads(spec: str) -> tuple[int, int]:
    """`"32/8"` -> (32, 8); `"16"` -> (16, 16)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:/\s*(\d+))?\s*", spec)
    if m is None:
        raise ValueError(f"bad --heads {spec!r}: expected Hq/Hkv, e.g. 32/8")
    hq = int(m.group(1))
    hkv = int(m.group(2)) if m.group(2) else hq
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"bad --heads {spec!r}: Hq must be a positive multiple of Hkv")
    return hq, hkv


def schedule_for(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    kernel: str = "auto",
    num_splits: int | None = None,
    kv_lora_rank: int = 0,
    prefill_head_dim: int | None = None,
    prefill_v_head_dim: int | None = None,
    kv_fp8: bool = False,
) -> TileSchedule:
    """The schedule of the attention kernel for this batch: `prefill_attention` when every request
    starts at position 0, else `paged_attention` (decode is its one-token case) over the whole
    batch. (The engine splits a mixed step in two launches: its leading one-token requests go
    through the decode form with their own split plan, the rest through paged attention; this
    shows the single paged launch that computes the same result.)

    MLA (`kv_lora_rank` > 0, `head_dim` = the latent row's width): prefill runs on the expanded
    heads (`prefill_head_dim` / `prefill_v_head_dim`: the qk and v head dims), everything else
    on `mla_schedule`'s latent kernel. `kv_fp8`: an FP8 cache (the paged kernel's FP8 tiles and
    split rule)."""
    if kernel == "auto":
        kernel = "prefill" if all(q == s for q, s in zip(q_lens, seq_lens)) else "paged"
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    if kernel == "prefill":
        if any(q != s for q, s in zip(q_lens, seq_lens)):
            raise ValueError("the prefill kernel needs q_len == kv_len for every request (no cached context)")
        return prefill_schedule(
            cu, max(q_lens), num_q_heads, prefill_head_dim or head_dim, dtype, v_head_dim=prefill_v_head_dim
        )
    if kernel == "paged" and kv_lora_rank:
        return mla_schedule(
            cu, seq_lens, num_q_heads, kv_lora_rank, head_dim - kv_lora_rank, block_size,
            num_splits=num_splits, dtype=dtype,
        )  # fmt: skip
    if kernel == "paged":
        return paged_schedule(
            cu, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, num_splits=num_splits, dtype=dtype,
            kv_fp8=kv_fp8,
        )  # fmt: skip
    raise ValueError(f"kernel must be 'auto', 'prefill' or 'paged', got {kernel!r}")


def describe_batch(
    batch: str | list[tuple[int, int]],
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    num_splits: int | None = None,
    dtype: str = "bfloat16",
    kernel: str = "auto",
    shared_prefix: int = 0,
    num_blocks: int | None = None,
) -> Inspection:
    """An inspection of a batch given as `(q_len, kv_len)` pairs (or their `"q:kv,..."` string).

    The page map is laid out as an allocator would: the first `shared_prefix // block_size`
    blocks of every request are one set of physical blocks shared through the prefix cache
    (reference count = requests), then each request's own blocks in order; the remaining
    `num_blocks` (default: a quarter more than needed) are free.
    """
    pairs = parse_batch(batch) if isinstance(batch, str) else [(int(q), int(k)) for q, k in batch]
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    q_lens = [q for q, _ in pairs]
    seq_lens = [k for _, k in pairs]
    if shared_prefix < 0 or shared_prefix > min(s - q for q, s in pairs):
        raise ValueError(
            f"shared_prefix {shared_prefix} must be within every request's cached context "
            f"(smallest context: {min(s - q for q, s in pairs)} tokens)"
        )
    torch_dtype = _DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    sched = schedule_for(
        q_lens,
        seq_lens,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype=torch_dtype,
        kernel=kernel,
        num_splits=num_splits,
    )

    num_shared = shared_prefix // block_size
    shared = list(range(num_shared))
    next_block = num_shared
    tables = []
    for s in seq_lens:
        own = -(-s // block_size) - num_shared
        tables.append(tuple(shared + list(range(next_block, next_block + own))))
        next_block += own
    used = next_block
    total = num_blocks if num_blocks is not None else used + max(4, used // 4)
    if total < used:
        raise ValueError(f"num_blocks {total} is smaller than the {used} blocks this batch needs")
    refs = [0] * total
    for t in tables:
        for b in t:
            refs[b] += 1
    # Full blocks of each request's context have a prefix-cache hash; the partial last block does not.
    hashed = set()
    for t, s in zip(tables, seq_lens):
        hashed.update(t[: s // block_size])
    pool = PoolView(total, block_size, tuple(BlockView(b, refs[b], b in hashed) for b in range(total)))
    requests = tuple(
        RequestView(i, f"req-{i}", q, s, num_shared * block_size if s > q else 0, tables[i])
        for i, (q, s) in enumerate(pairs)
    )
    desc = ",".join(f"{q}:{k}" for q, k in pairs)
    return Inspection(
        title=f"batch {desc}",
        source="described",
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        requests=requests,
        schedule=sched,
        pool=pool,
        notes=(_tile_note(),),
    )


def _tile_note() -> str:
    from tilellm.kernels.config import interpreting

    if interpreting():
        return "tile sizes of the Triton CPU interpreter (TRITON_INTERPRET=1)"
    return "tile sizes of the GPU kernels (tilellm.kernels.config)"


def inspect_step(
    *,
    request_ids: list[Any],
    query_lens: list[int],
    seq_lens: list[int],
    num_cached_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    pool_ref_counts: list[int],
    pool_cached: set[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    title: str,
    num_splits: int | None = None,
    kv_lora_rank: int = 0,
    prefill_head_dim: int | None = None,
    prefill_v_head_dim: int | None = None,
    kv_bytes_per_token: int = 0,
    kv_fp8: bool = False,
) -> Inspection:
    """An inspection of one engine step from its scheduler snapshot and the block pool.

    MLA models: `kv_lora_rank` > 0, one KV head of `head_dim` = the latent row's width."""
    torch_dtype = _DTYPES.get(dtype, torch.bfloat16)
    sched = schedule_for(
        list(query_lens),
        list(seq_lens),
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype=torch_dtype,
        num_splits=num_splits,
        kv_lora_rank=kv_lora_rank,
        prefill_head_dim=prefill_head_dim,
        prefill_v_head_dim=prefill_v_head_dim,
        kv_fp8=kv_fp8,
    )
    notes = [_tile_note()]
    if kv_lora_rank:
        notes.append(
            f"MLA: each token caches one row of {head_dim} values ({kv_lora_rank} latent + "
            f"{head_dim - kv_lora_rank} rotary key) shared by all {num_q_heads} query heads; decode, "
            "verification and cached prefixes attend over the rows with q_nope absorbed into the latent"
        )
    if kv_bytes_per_token:
        notes.append(f"KV cache: {kv_bytes_per_token:,} bytes per token over all layers")
    requests = tuple(
        RequestView(i, str(rid), int(q), int(s), int(c), tuple(int(b) for b in bt))
        for i, (rid, q, s, c, bt) in enumerate(
            zip(request_ids, query_lens, seq_lens, num_cached_tokens, block_tables)
        )
    )
    blocks = tuple(BlockView(b, int(r), b in pool_cached) for b, r in enumerate(pool_ref_counts))
    return Inspection(
        title=title,
        source="engine",
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        requests=requests,
        schedule=sched,
        pool=PoolView(len(blocks), block_size, blocks),
        notes=tuple(notes),
    )
