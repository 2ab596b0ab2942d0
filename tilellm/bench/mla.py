"""Benchmark MLA over a paged latent cache (`tilellm.kernels.mla`) on DeepSeek's shapes, GPU only.

One attention layer of DeepSeek-V2/V3 in the absorbed form: bf16 rows of 576 values (the 512
latent values + 64 rope values), values the first 512, pages of 64 rows (`--block-size`).
Workloads (decode: one query token per request):

    M1  128 heads, 64 requests x 4096 keys        M2  128 heads, 8 requests x 32768 keys
    M3   16 heads, 64 requests x 4096 keys        M4   16 heads, 8 requests x 32768 keys
    M5  128 heads, 64 requests x 4096 keys, 2 new tokens each (verification)

The cache is random normal data (never zero) larger than L2, read through a permuted block
table. Each workload is first checked against the PyTorch twin (`tilellm.kernels.reference.mla`)
on its first requests, then timed with `triton.testing.do_bench` (median). Reported: ms,
latent-cache GB/s (bytes = sum(seq_lens) x 576 x 2 + q and out bytes), TFLOP/s (2 x H x keys
seen x (576 + 512)), the floor from the copy and matmul ceilings measured in the same run
(`tilellm.bench.kernels.measure_ceilings`), and the share of FlashMLA's published H800 figures
(about 3000 GB/s memory-bound, 660 TFLOP/s compute-bound; the bound is the one that sets the
floor). The peer is PyTorch on the same cache: gather the rows through the block table, then
bmm + fp32 softmax + bmm (its time includes the gather; a second row without it, on rows
gathered beforehand). `--sweep` times `tilellm.kernels.mla.SWEEP_CONFIGS` and forced split
counts, `--graph` the kernel replayed from a CUDA graph, `--json FILE` writes every row.

Run: `python -m tilellm.bench.mla [--sweep] [--graph] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import torch

from tilellm.bench.kernels import Row, _bench, _bench_graph, _check, _guard, measure_ceilings
from tilellm.commands.common import UsageError

KV_LORA_RANK, ROPE_DIM = 512, 64
WIDTH = KV_LORA_RANK + ROPE_DIM
SCALE = (128 + 64) ** -0.5  # DeepSeek-V3: qk_nope_head_dim 128 + qk_rope_head_dim 64
FLASHMLA_GBPS = 3000.0  # FlashMLA's published H800 figures (README), for reference
FLASHMLA_TFLOPS = 660.0
CHECK_REQUESTS = 4  # requests checked against the twin before timing
FORCED_SPLITS = [1, 2, 4, 8, 16, 32, 64]
DEVICE = "cuda"
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Workload:
    name: str
    heads: int
    batch: int
    context: int  # keys of each request after the step (its new tokens included)
    q_len: int = 1

    @property
    def decode(self) -> bool:
        return self.q_len == 1


WORKLOADS = {
    w.name: w
    for w in [
        Workload("M1", 128, 64, 4096),
        Workload("M2", 128, 8, 32768),
        Workload("M3", 16, 64, 4096),
        Workload("M4", 16, 8, 32768),
        Workload("M5", 128, 64, 4096, q_len=2),
    ]
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write results to this file")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of M1,M2,M3,M4,M5"
    )
    p.add_argument("--block-size", type=int, default=64, help="rows per page (DeepSeek uses 64)")
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch peer")
    p.add_argument("--sweep", action="store_true", help="also time the config table and forced split counts")
    p.add_argument("--graph", action="store_true", help="also time the kernel replayed from a CUDA graph")


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, 576]
    kv_cache: torch.Tensor  # [num_blocks, page, 1, 576]
    block_table: torch.Tensor  # [B, blocks per request] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32


def make_batch(w: Workload, page: int, dtype: torch.dtype, seed: int = 0) -> Batch:
    """Random q and latent cache (normal data, a few spare pages), each request's pages a random
    permutation of the pool."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    per_request = math.ceil(w.context / page)
    num_blocks = w.batch * per_request + 8
    kv_cache = torch.randn(num_blocks, page, 1, WIDTH, device=DEVICE, dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g)[: w.batch * per_request]
    block_table = perm.view(w.batch, per_request).to(torch.int32).contiguous()
    q = torch.randn(w.batch * w.q_len, w.heads, WIDTH, device=DEVICE, dtype=dtype, generator=g)
    cu = torch.arange(0, (w.batch + 1) * w.q_len, w.q_len, device=DEVICE, dtype=torch.int32)
    seq_lens = torch.full((w.batch,), w.context, device=DEVICE, dtype=torch.int32)
    return Batch(q, kv_cache, block_table, cu, seq_lens)


def _call(w: Workload, b: Batch, plan=None, out=None):
    """The kernel of the workload: decode, or the paged kernel for verification."""
    from tilellm.kernels import mla

    kw = dict(kv_lora_rank=KV_LORA_RANK, scale=SCALE, num_splits=plan, max_seqlen_k=w.context, out=out)
    if w.decode:
        return mla.mla_decode_attention(b.q, b.kv_cache, b.block_table, b.seq_lens, **kw)
    return mla.mla_paged_attention(b.q, b.kv_cache, b.block_table, b.cu_seqlens_q, b.seq_lens, w.q_len, **kw)


def _check_twin(w: Workload, b: Batch, o: torch.Tensor) -> float:
    """The first CHECK_REQUESTS requests against the PyTorch twin (fp32 inside, bf16 tolerance)."""
    from tilellm.kernels.reference import mla as ref

    n = min(CHECK_REQUESTS, w.batch)
    t = n * w.q_len
    expected = ref.mla_paged_attention(
        b.q[:t], b.kv_cache, b.block_table[:n], b.cu_seqlens_q[: n + 1], b.seq_lens[:n], w.q_len,
        kv_lora_rank=KV_LORA_RANK, scale=SCALE,
    )  # fmt: skip
    return _check(w.name, o[:t], expected)


def _counts(w: Workload) -> tuple[float, float]:
    """(bytes, FLOPs) of one call: the latent rows once, q and out; 2 x H x (576 + 512) per key seen."""
    elem = 2
    byts = w.batch * w.context * WIDTH * elem + w.batch * w.q_len * w.heads * (WIDTH + KV_LORA_RANK) * elem
    keys_seen = w.batch * sum(w.context - w.q_len + j + 1 for j in range(w.q_len))
    flops = 2.0 * w.heads * keys_seen * (WIDTH + KV_LORA_RANK)
    return byts, flops


def _row(w: Workload, variant: str, ms: float, ceilings: dict, note: str = "", extra=None) -> Row:
    byts, flops = _counts(w)
    t_mem = byts / (ceilings["copy_gbps"] * 1e9)
    t_mma = flops / (ceilings["matmul_tflops"] * 1e12)
    gbps, tflops = byts / ms / 1e6, flops / ms / 1e9
    if t_mem >= t_mma:
        share = f"{gbps / FLASHMLA_GBPS:.0%} of FlashMLA's {FLASHMLA_GBPS:.0f} GB/s"
    else:
        share = f"{tflops / FLASHMLA_TFLOPS:.0%} of FlashMLA's {FLASHMLA_TFLOPS:.0f} TFLOP/s"
    floor = max(t_mem, t_mma) * 1e3
    if math.isfinite(ms):
        note = "; ".join(x for x in (note, share, f"{floor / ms:.0%} of floor") if x)
    return Row(w.name, variant, ms, tflops, gbps, floor, note, extra or {})


def _torch_peer(w: Workload, b: Batch, page: int):
    """PyTorch on the same cache: (gather + bmm / softmax / bmm, the same on rows gathered once)."""
    B, H, N, Q = w.batch, w.heads, w.context, w.q_len
    pos = torch.arange(N, device=DEVICE)
    slots = b.block_table[:, pos // page].long() * page + (pos % page)  # [B, N]
    flat = b.kv_cache.view(-1, WIDTH)
    q = b.q.view(B, Q * H, WIDTH)  # rows = tokens x heads
    q_pos = (N - Q + torch.arange(Q, device=DEVICE)).repeat_interleave(H)  # [Q * H]
    hidden = pos[None, :] > q_pos[:, None]  # [Q * H, N]: future keys of verification tokens

    def attend(rows: torch.Tensor) -> torch.Tensor:  # rows [B, N, 576]
        scores = torch.bmm(q, rows.transpose(1, 2)).float() * SCALE  # [B, Q * H, N]
        if Q > 1:
            scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(rows.dtype)
        return torch.bmm(probs, rows[:, :, :KV_LORA_RANK])  # [B, Q * H, 512]

    gathered = flat[slots]  # [B, N, 576]
    return (lambda: attend(flat[slots])), (lambda: attend(gathered)), attend(gathered).view(B * Q, H, -1)


def bench_workload(w: Workload, page: int, rows: list[Row], ceilings: dict, *, peers, sweep, graph) -> None:
    from tilellm.kernels import mla

    dtype = DTYPE
    b = make_batch(w, page, dtype)
    plan = mla.plan_mla(w.batch, w.heads, w.q_len, w.context, dtype, page,
                        kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM)  # fmt: skip
    o = _call(w, b, plan)
    err = _check_twin(w, b, o)
    cfg = plan.config
    label = f"tilellm bh{cfg.block_h} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} vs{cfg.value_splits}"
    ms = _bench(lambda: _call(w, b, plan))
    rows.append(_row(w, f"{label} splits={plan.num_splits}", ms, ceilings,
                     extra={"max_rel_err": err, "plan": plan.reason, "config": asdict(cfg)}))  # fmt: skip
    ms_none = _bench(lambda: _call(w, b))  # planned inside every call, as the engine's eager path
    rows.append(_row(w, "tilellm planned per call", ms_none, ceilings))
    if graph:
        out = torch.empty_like(o)
        rows.append(_row(w, "tilellm CUDA graph", _bench_graph(lambda: _call(w, b, plan, out)), ceilings))
    if sweep:
        _sweep(w, b, o, page, rows, ceilings)
    if peers:
        try:
            with_gather, no_gather, o_peer = _torch_peer(w, b, page)
            peer_err = float((o_peer.float() - o.float()).abs().max() / o.float().abs().max().clamp_min(1e-6))
            extra = {"max_rel_err_vs_tilellm": peer_err}
            rows.append(_row(w, "torch gather + bmm/softmax/bmm", _bench(with_gather), ceilings,
                             note="peer, gather timed", extra=extra))  # fmt: skip
            rows.append(_row(w, "torch bmm/softmax/bmm (pre-gathered)", _bench(no_gather), ceilings,
                             note="peer, contiguous rows", extra=extra))  # fmt: skip
            del with_gather, no_gather, o_peer
        except Exception as e:  # e.g. out of memory for the fp32 scores
            rows.append(Row(w.name, "torch peer", float("nan"), note=f"{type(e).__name__}: {e}"[:120]))


def _sweep(w: Workload, b: Batch, o: torch.Tensor, page: int, rows: list[Row], ceilings: dict) -> None:
    """Every config of the table (with its own planned split count), then forced split counts with
    the default config; each checked against the default output before it is timed."""
    from tilellm.kernels import mla

    plan_kw = dict(kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM)
    for cfg in mla.SWEEP_CONFIGS:
        plan = mla.plan_mla(w.batch, w.heads, w.q_len, w.context, b.q.dtype, page, config=cfg, **plan_kw)
        label = (
            f"sweep bh{cfg.block_h} rows{cfg.rows} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
            f"vs{cfg.value_splits} splits={plan.num_splits}"
        )
        _time_plan(w, b, o, plan, label, rows, ceilings)
    for n in FORCED_SPLITS:
        plan = mla.plan_mla(w.batch, w.heads, w.q_len, w.context, b.q.dtype, page, num_splits=n, **plan_kw)
        _time_plan(w, b, o, plan, f"sweep default config splits={n}", rows, ceilings)


def _time_plan(
    w: Workload, b: Batch, o: torch.Tensor, plan, label: str, rows: list[Row], ceilings: dict
) -> None:
    try:
        _check(label, _call(w, b, plan), o)
        rows.append(_row(w, label, _bench(lambda: _call(w, b, plan)), ceilings))
    except Exception as e:  # a config that does not fit shared memory or registers, or a wrong answer
        rows.append(Row(w.name, label, float("nan"), note=f"{type(e).__name__}: {e}"[:120]))


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise UsageError(
            "this benchmark times the MLA kernels on a CUDA GPU and none is visible here "
            "(on the CPU the kernels' tests run them: pytest tests/kernels/test_mla.py)"
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
        f"matmul {ceilings['matmul_tflops']:.0f} TFLOP/s  page {args.block_size}"
    )
    rows: list[Row] = []
    for name in names:
        w = WORKLOADS[name]
        _guard(name, rows, bench_workload, w, args.block_size, rows, ceilings,
               peers=not args.no_peers, sweep=args.sweep, graph=args.graph)  # fmt: skip
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
                    "flashmla_reference": {"gbps": FLASHMLA_GBPS, "tflops": FLASHMLA_TFLOPS, "gpu": "H800"},
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return 1 if any(r.variant == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
