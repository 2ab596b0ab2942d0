"""Benchmark sparse MLA (DeepSeek-V3.2's DSA attention, `tilellm.kernels.sparse_mla`), GPU only.

One attention layer of DeepSeek-V3.2 in the absorbed form: bf16 latent rows of 576 values (512
latent + 64 rope), values the first 512, pages of 64 rows (`--block-size`); each query token
attends to its own top-2048 positions. Workloads:

    S2     decode, 128 heads, 64 requests x 65536 context, top-2048
    S2-16  S2 at 16 heads (128 heads over 8 tensor-parallel ranks)
    S3     prefill, 128 heads, 8 requests x 8192 new tokens (context 8192 each, causal),
           top-2048: token j selects every key 0..j while j < 2048, else 2048 of them

Indices are random distinct causal positions in random order (the indexer's are in score
order), -1 past a short token's keys. The cache is random normal data (never zero), read
through a permuted block table; S2's 4.8 GB is far larger than L2, S3's 75 MB is larger too.
Each workload is first checked against the PyTorch twin (`tilellm.kernels.reference.sparse_mla`)
on a few tokens, then timed with `triton.testing.do_bench` (median). Reported: ms, TFLOP/s
(2 x H x (576 + 512) per valid selected entry), GB/s of the selected rows (576 x 2 bytes per
valid entry, plus q and out), the floor from the copy and matmul ceilings measured in the same
run (`tilellm.bench.kernels.measure_ceilings`), and the share of FlashMLA's published sparse
figures (H800: decode 410 TFLOP/s with an FP8 cache, prefill 640 TFLOP/s). Beside them, dense
MLA on the same cache and queries in the same run (`tilellm.kernels.mla`: decode for S2 with its
default plan, the absorbed paged kernel for S3) and the sparse kernel's speedup over it.
`--sweep` times `sparse_mla.SWEEP_CONFIGS` and forced split counts, `--graph` the kernel replayed
from a CUDA graph (L2 flushed before each call), `--json FILE` writes every row.

Run: `python -m tilellm.bench.sparse_mla [--workloads S2,S3] [--sweep] [--graph] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch

from tilellm.bench.kernels import Row, _bench, _bench_graph, _check, _guard, measure_ceilings
from tilellm.bench.mla import KV_LORA_RANK, ROPE_DIM, SCALE, WIDTH
from tilellm.commands.common import UsageError

# FlashMLA's published sparse kernels (README, H800 SXM5): decode with an FP8 latent cache and
# prefill, in TFLOP/s, for reference.
FLASHMLA_DECODE_TFLOPS = 410.0
FLASHMLA_PREFILL_TFLOPS = 640.0
TOPK = 2048
CHECK_POSITIONS = (0, 1, 2047, 2048, 4095)  # S3: positions of request 0 (and its last) checked
CHECK_DECODE = 4  # S2: requests checked against the twin
FORCED_SPLITS = [1, 2, 4, 8]
DEVICE = "cuda"
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Workload:
    name: str
    heads: int
    batch: int
    context: int  # keys of each request after the step (its new tokens included)
    q_len: int = 1  # new tokens of each request
    topk: int = TOPK

    @property
    def decode(self) -> bool:
        return self.q_len == 1


WORKLOADS = {
    w.name: w
    for w in [
        Workload("S2", 128, 64, 65536),
        Workload("S2-16", 16, 64, 65536),
        Workload("S3", 128, 8, 8192, q_len=8192),
    ]
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write results to this file")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of S2,S2-16,S3")
    p.add_argument("--block-size", type=int, default=64, help="rows per page (DeepSeek uses 64)")
    p.add_argument("--no-dense", action="store_true", help="skip dense MLA on the same batch")
    p.add_argument("--sweep", action="store_true", help="also time the config table and forced split counts")
    p.add_argument("--graph", action="store_true", help="also time the kernel replayed from a CUDA graph")


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, 576]
    kv_cache: torch.Tensor  # [num_blocks, page, 1, 576]
    block_table: torch.Tensor  # [B, blocks per request] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    topk: torch.Tensor  # [T, K] int32, -1 = empty
    valid: int  # entries of topk that are not -1


def make_batch(w: Workload, page: int, dtype: torch.dtype, seed: int = 0) -> Batch:
    """Random q and latent cache (normal data, a few spare pages), each request's pages a random
    slice of a permutation of the pool, and each token's top-k."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    per_request = math.ceil(w.context / page)
    num_blocks = w.batch * per_request + 8
    kv_cache = torch.randn(num_blocks, page, 1, WIDTH, device=DEVICE, dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g)[: w.batch * per_request]
    block_table = perm.view(w.batch, per_request).to(torch.int32).contiguous()
    q = torch.randn(w.batch * w.q_len, w.heads, WIDTH, device=DEVICE, dtype=dtype, generator=g)
    cu = torch.arange(0, (w.batch + 1) * w.q_len, w.q_len, device=DEVICE, dtype=torch.int32)
    seq_lens = torch.full((w.batch,), w.context, device=DEVICE, dtype=torch.int32)
    topk = make_topk(w, g)
    return Batch(q, kv_cache, block_table, cu, seq_lens, topk, int((topk >= 0).sum()))


def make_topk(w: Workload, g: torch.Generator) -> torch.Tensor:
    """[T, K] int32: a token at position p selects every key 0..p when p < K (then -1), else K
    random distinct keys <= p; in random order (the top-k of random scores)."""
    K = min(w.topk, w.context)
    keys = torch.arange(w.context, device=DEVICE)
    first = w.context - w.q_len  # position of each request's first new token
    chunk = max(1, (1 << 26) // w.context)  # tokens whose random scores are materialised at once
    out = torch.full((w.batch * w.q_len, w.topk), -1, dtype=torch.int32, device=DEVICE)
    for r in range(w.batch):
        for lo in range(0, w.q_len, chunk):
            hi = min(w.q_len, lo + chunk)
            pos = first + torch.arange(lo, hi, device=DEVICE)
            scores = torch.rand(hi - lo, w.context, device=DEVICE, generator=g)
            scores.masked_fill_(keys[None, :] > pos[:, None], -1.0)  # future keys rank below any causal
            vals, idx = scores.topk(K, dim=1)
            rows = slice(r * w.q_len + lo, r * w.q_len + hi)
            out[rows, :K] = torch.where(vals >= 0, idx, -1).to(torch.int32)
    return out


def _call(b: Batch, plan=None, out=None):
    from tilellm.kernels import sparse_mla

    return sparse_mla.sparse_mla_attention(
        b.q, b.kv_cache, b.block_table, b.cu_seqlens_q, b.topk, b.seq_lens,
        kv_lora_rank=KV_LORA_RANK, scale=SCALE, out=out, plan=plan,
    )  # fmt: skip


def _check_tokens(w: Workload) -> list[tuple[int, int]]:
    """(token, request) pairs checked against the twin: the first requests' tokens in decode;
    in prefill, tokens at CHECK_POSITIONS of request 0 and the last token of the last request."""
    if w.decode:
        return [(i, i) for i in range(min(CHECK_DECODE, w.batch))]
    first = w.context - w.q_len
    picks = [(p - first, 0) for p in CHECK_POSITIONS if first <= p < w.context]
    return picks + [(w.batch * w.q_len - 1, w.batch - 1)]


def _check_twin(w: Workload, b: Batch, o: torch.Tensor) -> float:
    """Some tokens against the PyTorch twin (fp32 inside, bf16 tolerance): each checked token
    becomes the last token of a one-token request of the twin (same rows, same position)."""
    from tilellm.kernels.reference import sparse_mla as ref

    picks = _check_tokens(w)
    toks = torch.tensor([t for t, _ in picks], device=DEVICE)
    reqs = torch.tensor([r for _, r in picks], device=DEVICE)
    first = w.context - w.q_len
    pos = first + toks - reqs * w.q_len  # each token's position in its request
    n = len(picks)
    expected = ref.sparse_mla_attention(
        b.q[toks], b.kv_cache, b.block_table[reqs].contiguous(),
        torch.arange(n + 1, device=DEVICE, dtype=torch.int32), b.topk[toks].contiguous(),
        (pos + 1).to(torch.int32), kv_lora_rank=KV_LORA_RANK, scale=SCALE,
    )  # fmt: skip
    return _check(w.name, o[toks], expected)


def _counts(w: Workload, b: Batch) -> tuple[float, float]:
    """(bytes, FLOPs) of one call: the selected rows once per token, q and out; 2 x H x
    (576 + 512) per valid entry."""
    elem = 2
    tokens = w.batch * w.q_len
    byts = b.valid * WIDTH * elem + tokens * w.heads * (WIDTH + KV_LORA_RANK) * elem
    flops = 2.0 * w.heads * b.valid * (WIDTH + KV_LORA_RANK)
    return byts, flops


def _row(w: Workload, b: Batch, variant: str, ms: float, ceilings: dict, note: str = "", extra=None) -> Row:
    byts, flops = _counts(w, b)
    t_mem = byts / (ceilings["copy_gbps"] * 1e9)
    t_mma = flops / (ceilings["matmul_tflops"] * 1e12)
    gbps, tflops = byts / ms / 1e6, flops / ms / 1e9
    ref_tflops = FLASHMLA_DECODE_TFLOPS if w.decode else FLASHMLA_PREFILL_TFLOPS
    kind = "FP8 decode" if w.decode else "prefill"
    share = f"{tflops / ref_tflops:.0%} of FlashMLA's sparse {kind} {ref_tflops:.0f} TFLOP/s (H800)"
    floor = max(t_mem, t_mma) * 1e3
    if math.isfinite(ms):
        note = "; ".join(x for x in (note, share, f"{floor / ms:.0%} of floor") if x)
    return Row(w.name, variant, ms, tflops, gbps, floor, note, extra or {})


def _dense(w: Workload, b: Batch):
    """Dense MLA over every causal key of the same cache and queries (default plan)."""
    from tilellm.kernels import mla

    kw = dict(kv_lora_rank=KV_LORA_RANK, scale=SCALE, max_seqlen_k=w.context)
    if w.decode:
        return lambda: mla.mla_decode_attention(b.q, b.kv_cache, b.block_table, b.seq_lens, **kw)
    return lambda: mla.mla_paged_attention(
        b.q, b.kv_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, w.q_len, **kw
    )


def _dense_counts(w: Workload) -> tuple[float, float]:
    keys_seen = w.batch * sum(w.context - w.q_len + j + 1 for j in range(w.q_len))
    byts = w.batch * w.context * WIDTH * 2 + w.batch * w.q_len * w.heads * (WIDTH + KV_LORA_RANK) * 2
    return byts, 2.0 * w.heads * keys_seen * (WIDTH + KV_LORA_RANK)


def bench_workload(w: Workload, page: int, rows: list[Row], ceilings: dict, *, dense, sweep, graph) -> None:
    from tilellm.kernels import sparse_mla

    t0 = time.time()
    b = make_batch(w, page, DTYPE)
    print(f"# {w.name}: batch built in {time.time() - t0:.1f} s ({b.valid} valid entries)", flush=True)
    plan = sparse_mla.plan_sparse_mla(b.q.shape[0], w.heads, w.topk, DTYPE, kv_lora_rank=KV_LORA_RANK,
                                      rope_dim=ROPE_DIM)  # fmt: skip
    o = _call(b, plan)
    err = _check_twin(w, b, o)
    cfg = plan.config
    label = f"tilellm bh{cfg.block_h} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} vs{cfg.value_splits}"
    slots = b.q.shape[0] * w.topk
    extra = {"max_rel_err": err, "plan": plan.reason, "config": asdict(cfg), "valid_entries": b.valid,
             "entry_slots": slots}  # fmt: skip
    ms = _bench(lambda: _call(b, plan))
    rows.append(_row(w, b, f"{label} splits={plan.num_splits}", ms, ceilings, extra=extra))
    if b.valid < slots:
        slot_tflops = 2.0 * w.heads * slots * (WIDTH + KV_LORA_RANK) / ms / 1e9
        rows[-1].note = f"{slot_tflops:.0f} TFLOP/s counting -1 slots; " + rows[-1].note
    if graph:
        out = torch.empty_like(o)
        rows.append(_row(w, b, "tilellm CUDA graph", _bench_graph(lambda: _call(b, plan, out)), ceilings))
    if sweep:
        _sweep(w, b, o, rows, ceilings)
    if dense:
        _bench_dense(w, b, ms, rows, ceilings)


def _bench_dense(w: Workload, b: Batch, ms_sparse: float, rows: list[Row], ceilings: dict) -> None:
    try:
        ms = _bench(_dense(w, b))
    except Exception as e:  # e.g. out of memory
        rows.append(Row(w.name, "dense MLA", float("nan"), note=f"{type(e).__name__}: {e}"[:120]))
        return
    byts, flops = _dense_counts(w)
    kernel = "mla_decode_attention" if w.decode else "mla_paged_attention"
    note = f"dense, every causal key; sparse is {ms / ms_sparse:.1f}x faster"
    floor = max(byts / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["matmul_tflops"] * 1e12)) * 1e3
    rows.append(Row(w.name, f"dense {kernel} (default plan)", ms, flops / ms / 1e9, byts / ms / 1e6, floor,
                    note, {"speedup_of_sparse": ms / ms_sparse}))  # fmt: skip


def _sweep(w: Workload, b: Batch, o: torch.Tensor, rows: list[Row], ceilings: dict) -> None:
    """Every config of the table (with its own planned split count), then forced split counts with
    the default config; each checked against the default output before it is timed."""
    from tilellm.kernels import sparse_mla

    T = b.q.shape[0]
    plan_kw = dict(kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM)
    for cfg in sparse_mla.SWEEP_CONFIGS:
        plan = sparse_mla.plan_sparse_mla(T, w.heads, w.topk, DTYPE, config=cfg, **plan_kw)
        label = (
            f"sweep bh{cfg.block_h} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
            f"vs{cfg.value_splits} splits={plan.num_splits}"
        )
        _time_plan(w, b, o, plan, label, rows, ceilings)
    for n in FORCED_SPLITS:
        plan = sparse_mla.plan_sparse_mla(T, w.heads, w.topk, DTYPE, num_splits=n, **plan_kw)
        _time_plan(w, b, o, plan, f"sweep default config splits={n}", rows, ceilings)


def _time_plan(
    w: Workload, b: Batch, o: torch.Tensor, plan, label: str, rows: list[Row], ceilings: dict
) -> None:
    try:
        _check(label, _call(b, plan), o)
        rows.append(_row(w, b, label, _bench(lambda: _call(b, plan)), ceilings))
    except Exception as e:  # a config that does not fit shared memory or registers, or a wrong answer
        rows.append(Row(w.name, label, float("nan"), note=f"{type(e).__name__}: {e}"[:120]))


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise UsageError(
            "this benchmark times the sparse MLA kernel on a CUDA GPU and none is visible here "
            "(on the CPU the kernel's tests run it: pytest tests/kernels/test_sparse_mla.py)"
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
        f"matmul {ceilings['matmul_tflops']:.0f} TFLOP/s  page {args.block_size}",
        flush=True,
    )
    rows: list[Row] = []
    for name in names:
        w = WORKLOADS[name]
        _guard(name, rows, bench_workload, w, args.block_size, rows, ceilings,
               dense=not args.no_dense, sweep=args.sweep, graph=args.graph)  # fmt: skip
    print(f"{'workload':8} {'variant':50} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'floor ms':>9}  note")
    for r in rows:
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else " " * 8
        gb = f"{r.gbps:7.0f}" if r.gbps is not None else " " * 7
        fl = f"{r.floor_ms:9.3f}" if r.floor_ms is not None else " " * 9
        print(f"{r.name:8} {r.variant:50} {r.ms:9.3f} {tf} {gb} {fl}  {r.note}")
    print(f"# {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "ceilings": ceilings,
                    "block_size": args.block_size,
                    "flashmla_reference": {
                        "decode_tflops": FLASHMLA_DECODE_TFLOPS,
                        "prefill_tflops": FLASHMLA_PREFILL_TFLOPS,
                        "gpu": "H800",
                        "decode_cache": "fp8",
                    },
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
    except UsageError as e:
        print(f"tilellm bench sparse_mla: error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
