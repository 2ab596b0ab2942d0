"""Benchmark DeepSeek-V3.2's lightning indexer selection (`tilellm.kernels.indexer`), GPU only.

One indexer layer of DeepSeek-V3.2: bf16 queries of Hi = 64 heads x D = 128 and keys of 128
values in pages of 64 (`--block-size`), fp32 weights, topk = 2048. Workloads:

    I8K  I32K  I64K  I128K     decode: 64 requests, one new token each, at 8k / 32k / 64k / 128k keys
    P8K  P32K  P64K  P128K     a prefill chunk: one request, its last 2048 tokens over 8k ... 128k keys

The cache is random normal data read through a permuted block table. Each workload is first
checked against the PyTorch twin (`tilellm.kernels.reference.indexer`) on a few tokens (decode:
the first requests; prefill: the chunk's first tokens, as a request of its own): the sorted
scores of the kernel's picks must equal the twin's (the sets may differ only among tied keys).
Then `triton.testing.do_bench` (median) times `index_topk` (scores + select, one call per
decode step or chunk). Reported: ms; TFLOP/s of the scores (2 x Hi x D per causal query-key
pair); GB/s of the index keys read from memory (each request's keys once: B x keys x D x 2
bytes); the floor from the copy and matmul ceilings measured in the same run
(`tilellm.bench.kernels.measure_ceilings`). In `extra`: the key bytes the score tiles fetch
(from L2 mostly: once per query tile of a prefill chunk), the scratch bytes (4 per score, written
once, read by the select's five passes) and the tile config. The peer is PyTorch on the same
cache: gather the keys, einsum / relu / weighted sum in fp32, masked `torch.topk` (batched; a
prefill chunk in slices of query tokens). `--graph` also times the decode workloads replayed from
a CUDA graph, `--sweep` other tile configs (the table in `tilellm.kernels.indexer` is untimed),
`--fp8-keys` also times each workload over the same keys in e4m3 with a scale per key (an FP8 KV
cache's index keys, `store_index_keys`; GB/s then count D + 4 bytes a key), `--json FILE` writes
every row.

Run: `python -m tilellm.bench.indexer [--workloads I128K,P32K] [--graph] [--sweep] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from tilellm.bench.kernels import Row, _bench, _bench_graph, _guard, measure_ceilings
from tilellm.commands.common import UsageError

HEADS, DIM, TOPK = 64, 128, 2048  # DeepSeek-V3.2: index_n_heads, index_head_dim, index_topk
SCALE = DIM**-0.5
CHECK_TOKENS = 4  # tokens checked against the twin before timing
PEER_ELEMENTS = 1 << 28  # fp32 head scores the peer holds at once (1 GiB)
DEVICE = "cuda"
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    context: int  # keys of each request after the step (its new tokens included)
    q_len: int = 1

    @property
    def decode(self) -> bool:
        return self.q_len == 1


WORKLOADS = {
    w.name: w
    for w in [
        *(Workload(f"I{k}K", 64, k * 1024) for k in (8, 32, 64, 128)),
        *(Workload(f"P{k}K", 1, k * 1024, q_len=2048) for k in (8, 32, 64, 128)),
    ]
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write results to this file")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}"
    )
    p.add_argument("--block-size", type=int, default=64, help="keys per page (DeepSeek uses 64)")
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch peer")
    p.add_argument(
        "--graph", action="store_true", help="also time the decode workloads replayed from a CUDA graph"
    )
    p.add_argument("--sweep", action="store_true", help="also time the tile configs of SWEEP")
    p.add_argument(
        "--fp8-keys", action="store_true", help="also time e4m3 keys with a scale per key (an FP8 KV cache)"
    )


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hi, D]
    weights: torch.Tensor  # [T, Hi] fp32
    index_cache: torch.Tensor  # [num_blocks, page, 1, D]
    block_table: torch.Tensor  # [B, blocks per request] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    index_scales: torch.Tensor | None = None  # [num_blocks, page] fp32: e4m3 keys (`as_fp8_keys`)


def as_fp8_keys(b: Batch) -> Batch:
    """The same batch with its keys in e4m3, a scale per key (as an FP8 KV cache stores them)."""
    from tilellm.kernels import indexer

    nb, page, _, d = b.index_cache.shape
    cache = torch.empty(nb, page, 1, d, device=DEVICE, dtype=torch.float8_e4m3fn)
    scales = torch.empty(nb, page, device=DEVICE)
    slots = torch.arange(nb * page, device=DEVICE, dtype=torch.int32)
    indexer.store_index_keys(b.index_cache.view(nb * page, d), cache, slots, index_scales=scales)
    return dataclasses.replace(b, index_cache=cache, index_scales=scales)


def make_batch(w: Workload, page: int, seed: int = 0) -> Batch:
    """Random queries, weights (the model's scale: Hi ** -0.5) and keys, each request's pages a
    random permutation of the pool."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    per_request = math.ceil(w.context / page)
    num_blocks = w.batch * per_request + 8
    cache = torch.randn(num_blocks, page, 1, DIM, device=DEVICE, dtype=DTYPE, generator=g)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g)[: w.batch * per_request]
    block_table = perm.view(w.batch, per_request).to(torch.int32).contiguous()
    T = w.batch * w.q_len
    q = torch.randn(T, HEADS, DIM, device=DEVICE, dtype=DTYPE, generator=g)
    weights = torch.randn(T, HEADS, device=DEVICE, generator=g) * HEADS**-0.5
    cu = torch.arange(0, (w.batch + 1) * w.q_len, w.q_len, device=DEVICE, dtype=torch.int32)
    seq_lens = torch.full((w.batch,), w.context, device=DEVICE, dtype=torch.int32)
    return Batch(q, weights, cache, block_table, cu, seq_lens)


def _call(w: Workload, b: Batch, out=None):
    from tilellm.kernels import indexer

    return indexer.index_topk(
        b.q, b.weights, b.index_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, w.q_len,
        topk=TOPK, scale=SCALE, max_seqlen_k=w.context, out=out, index_scales=b.index_scales,
    )  # fmt: skip


def _check_twin(w: Workload, b: Batch, got: torch.Tensor) -> float:
    """The first CHECK_TOKENS tokens (decode: of as many requests; prefill: of the chunk, run as
    a request of their own at the same positions) against the twin: the sorted scores of the
    picks must agree. Returns the largest difference relative to the largest score."""
    from tilellm.kernels.reference import indexer as ref

    n = CHECK_TOKENS
    if w.decode:
        cu = torch.arange(n + 1, device=DEVICE, dtype=torch.int32)
        seq_lens, table, rows = b.seq_lens[:n], b.block_table[:n], list(range(n))
    else:  # tokens 0..n-1 of the chunk sit at context - q_len + j whatever the chunk's length
        cu = torch.tensor([0, n], device=DEVICE, dtype=torch.int32)
        seq_lens = b.seq_lens[:1] - (w.q_len - n)
        table, rows = b.block_table[:1], [0] * n
    expected = ref.index_topk(
        b.q[:n], b.weights[:n], b.index_cache, table, cu, seq_lens, 1 if w.decode else n,
        topk=TOPK, scale=SCALE, index_scales=b.index_scales,
    )  # fmt: skip
    page = b.index_cache.shape[1]
    q = b.q if b.index_scales is None else ref.fp8_index_queries(b.q)  # as the FP8 scores see it
    worst = 0.0
    for t in range(n):
        n_keys = int(seq_lens[rows[t]]) - (1 if w.decode else n - t)  # the token's position
        pos = torch.arange(n_keys + 1, device=DEVICE)
        blocks = table[rows[t]].long()[pos // page]
        keys = b.index_cache[blocks, pos % page, 0].float()
        if b.index_scales is not None:
            keys = keys * b.index_scales[blocks, pos % page, None]
        scores = ref.index_scores(q[t : t + 1], b.weights[t : t + 1], keys, SCALE)[0]
        picks = [got[t], expected[t]]
        if any(int((p >= 0).sum()) != min(TOPK, n_keys + 1) for p in picks):
            raise AssertionError(
                f"{w.name}: token {t}: {[int((p >= 0).sum()) for p in picks]} picks of {TOPK}"
            )
        mine, theirs = (scores[p[p >= 0].long()].sort().values for p in picks)
        err = float((mine - theirs).abs().max() / scores.abs().max().clamp_min(1e-6))
        if not err < 1e-4:
            raise AssertionError(f"{w.name}: token {t}: picks' scores differ from the twin's by {err:.3e}")
        worst = max(worst, err)
    return worst


def _counts(w: Workload, block_q: int, fp8: bool = False) -> dict:
    """Per call: causal query-key pairs, score FLOPs, key bytes (once per request, and as the
    score tiles fetch them; e4m3 keys: D bytes and a 4-byte scale each), scratch bytes."""
    pairs = w.batch * sum(w.context - w.q_len + j + 1 for j in range(w.q_len))
    per_key = DIM + 4 if fp8 else DIM * 2
    key_bytes = w.batch * w.context * per_key
    tiles = math.ceil(w.q_len / block_q)
    fetched = (
        w.batch * sum(w.context - w.q_len + min(w.q_len, (i + 1) * block_q) for i in range(tiles)) * per_key
    )
    return {
        "pairs": pairs,
        "flops": 2.0 * HEADS * DIM * pairs,
        "key_bytes": key_bytes,
        "tile_key_bytes": fetched,
        "scratch_bytes": 4 * pairs * (1 + 5),  # at most: a row of <= topk keys is read once
    }


def _row(
    w: Workload, variant: str, ms: float, ceilings: dict, counts: dict, note: str = "", extra=None
) -> Row:
    t_mem = counts["key_bytes"] / (ceilings["copy_gbps"] * 1e9)
    t_mma = counts["flops"] / (ceilings["matmul_tflops"] * 1e12)
    floor = max(t_mem, t_mma) * 1e3
    if math.isfinite(ms):
        note = "; ".join(x for x in (note, f"{floor / ms:.0%} of floor") if x)
    extra = {**counts, **(extra or {})}
    return Row(
        w.name, variant, ms, counts["flops"] / ms / 1e9, counts["key_bytes"] / ms / 1e6, floor, note, extra
    )


def _torch_peer(w: Workload, b: Batch, page: int):
    """PyTorch on the same cache: gather each request's keys, fp32 einsum / relu / weighted sum
    over the heads, causal mask, topk (a chunk's tokens in slices of PEER_ELEMENTS head scores)."""
    B, N, Q = w.batch, w.context, w.q_len
    pos = torch.arange(N, device=DEVICE)
    slots = b.block_table[:, pos // page].long() * page + (pos % page)  # [B, N]
    flat = b.index_cache.view(-1, DIM)
    q = b.q.view(B, Q, HEADS, DIM)
    weights = b.weights.view(B, Q, HEADS)
    step = max(1, PEER_ELEMENTS // (B * HEADS * N))

    def run() -> torch.Tensor:
        keys = flat[slots].float()  # [B, N, D]
        out = []
        for lo in range(0, Q, step):
            hi = min(Q, lo + step)
            dots = torch.einsum("bqhd,bnd->bqhn", q[:, lo:hi].float(), keys) * SCALE
            scores = torch.einsum("bqh,bqhn->bqn", weights[:, lo:hi], torch.relu(dots))
            q_pos = N - Q + torch.arange(lo, hi, device=DEVICE)
            scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out.append(scores.topk(min(TOPK, N), dim=-1).indices.to(torch.int32))
        return torch.cat(out, 1).view(B * Q, -1)

    return run


SWEEP = [  # (rows, block_n, num_warps, num_stages, block_s, select_warps)
    (64, 64, 4, 3, 1024, 4),
    (64, 128, 4, 3, 1024, 4),
    (64, 64, 4, 2, 2048, 8),
    (128, 64, 8, 3, 1024, 4),
    (128, 32, 4, 3, 1024, 4),
    (128, 128, 8, 2, 1024, 4),
    (256, 64, 8, 2, 1024, 4),
]


@contextlib.contextmanager
def _forced_config(cfg) -> Iterator[None]:
    """index_topk with another tile config (the module's `indexer_config`, read at every call)."""
    from tilellm.kernels import indexer

    saved = indexer.indexer_config
    indexer.indexer_config = lambda dtype, max_seqlen_q, key_fp8=False: cfg
    try:
        yield
    finally:
        indexer.indexer_config = saved


def bench_workload(
    w: Workload, page: int, rows: list[Row], ceilings: dict, *, peers, graph, sweep, fp8_keys=False
) -> None:
    from tilellm.kernels import indexer

    b = make_batch(w, page)
    cfg = indexer.indexer_config(DTYPE, w.q_len)
    block_q, _ = indexer.tile_shape(cfg, HEADS, w.q_len)
    counts = _counts(w, block_q)
    got = _call(w, b)
    err = _check_twin(w, b, got)
    label = f"tilellm rows{cfg.rows} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} bs{cfg.block_s}"
    extra = {"max_rel_score_err": err, "config": asdict(cfg)}
    rows.append(_row(w, label, _bench(lambda: _call(w, b)), ceilings, counts, extra=extra))
    if graph and w.decode:
        out = torch.empty_like(got)
        rows.append(_row(w, "tilellm CUDA graph", _bench_graph(lambda: _call(w, b, out)), ceilings, counts))
    if fp8_keys:
        b8 = as_fp8_keys(b)
        block_q8, _ = indexer.tile_shape(indexer.indexer_config(DTYPE, w.q_len, key_fp8=True), HEADS, w.q_len)
        c8 = _counts(w, block_q8, fp8=True)
        got8 = _call(w, b8)
        extra8 = {"max_rel_score_err": _check_twin(w, b8, got8)}
        rows.append(_row(w, "tilellm fp8 keys", _bench(lambda: _call(w, b8)), ceilings, c8, extra=extra8))
        if graph and w.decode:
            out8 = torch.empty_like(got8)
            ms = _bench_graph(lambda: _call(w, b8, out8))
            rows.append(_row(w, "tilellm fp8 keys CUDA graph", ms, ceilings, c8))
    swept = [(b, "", False)] + ([(b8, "fp8 keys ", True)] if fp8_keys else []) if sweep else []
    for batch, what, fp8 in swept:  # (with --fp8-keys the FP8 keys' tiles too)
        for values in SWEEP:
            c = indexer.IndexerConfig(*values)
            label = (
                f"sweep {what}rows{c.rows} bn{c.block_n} w{c.num_warps} s{c.num_stages} "
                f"bs{c.block_s} sw{c.select_warps}"
            )
            try:
                with _forced_config(c):
                    _check_twin(w, batch, _call(w, batch))
                    ms = _bench(lambda batch=batch: _call(w, batch))
                block_q = indexer.tile_shape(c, HEADS, w.q_len)[0]
                rows.append(_row(w, label, ms, ceilings, _counts(w, block_q, fp8=fp8)))
            except Exception as e:  # a config that does not fit shared memory or registers, or a wrong answer
                rows.append(Row(w.name, label, float("nan"), note=f"{type(e).__name__}: {e}"[:120]))
    if peers:
        try:
            peer = _torch_peer(w, b, page)
            rows.append(
                _row(w, "torch gather + einsum/relu/sum + topk", _bench(peer), ceilings, counts, note="peer")
            )
            del peer
        except Exception as e:  # e.g. out of memory for the fp32 head scores
            rows.append(Row(w.name, "torch peer", float("nan"), note=f"{type(e).__name__}: {e}"[:120]))


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise UsageError(
            "this benchmark times the indexer kernels on a CUDA GPU and none is visible here "
            "(on the CPU the kernels' tests run them: pytest tests/kernels/test_indexer.py)"
        )
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise UsageError(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    t0 = time.time()
    ceilings = measure_ceilings()
    torch.cuda.empty_cache()
    print(
        f"# {torch.cuda.get_device_name()}  copy {ceilings['copy_gbps']:.0f} GB/s  "
        f"matmul {ceilings['matmul_tflops']:.0f} TFLOP/s  "
        f"Hi {HEADS}  D {DIM}  topk {TOPK}  page {args.block_size}"
    )
    rows: list[Row] = []
    for name in names:
        _guard(name, rows, bench_workload, WORKLOADS[name], args.block_size, rows, ceilings,
               peers=not args.no_peers, graph=args.graph, sweep=args.sweep,
               fp8_keys=args.fp8_keys)  # fmt: skip
    print(f"{'workload':8} {'variant':58} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'floor ms':>9}  note")
    for r in rows:
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else " " * 8
        gb = f"{r.gbps:7.0f}" if r.gbps is not None else " " * 7
        fl = f"{r.floor_ms:9.3f}" if r.floor_ms is not None else " " * 9
        print(f"{r.name:8} {r.variant:58} {r.ms:9.3f} {tf} {gb} {fl}  {r.note}")
    print(f"# {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "ceilings": ceilings,
                    "block_size": args.block_size,
                    "shape": {"heads": HEADS, "dim": DIM, "topk": TOPK, "dtype": str(DTYPE)},
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return 1 if any(r.variant == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        raise SystemExit(main(parser.parse_args()))
    except UsageError as exc:  # one line, as `tilellm bench` prints it
        raise SystemExit(f"{parser.prog}: error: {exc}") from None
