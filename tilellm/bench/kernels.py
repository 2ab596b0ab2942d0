"""Benchmark the attention kernels on the workloads of docs/workloads.md, beside torch SDPA (cuDNN, flash).

Each workload is one attention layer (bf16, Hq=32, Hkv=8, D=128, page 16) built from docs/workloads.md's
seeded lengths. Output: a table with TFLOP/s (prefill) or effective GB/s (decode/verify), the
floor of each workload from the ceilings measured in the same run, and the peers; `--json FILE`
writes everything. Every timed tilellm kernel is first checked against torch SDPA in fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from tilellm.commands.common import UsageError

HQ, HKV, D, PAGE = 32, 8, 128, 16
PREFILL_SWEEP = [
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (128, 64, 4, 2),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
]
DECODE_SWEEP = [
    (16, 64, 4, 3),
    (16, 64, 2, 3),
    (16, 64, 2, 4),
    (16, 64, 2, 2),
    (16, 64, 1, 3),
    (16, 128, 4, 3),
    (16, 128, 2, 3),
    (16, 128, 2, 2),
    (16, 64, 4, 4),
    (16, 32, 2, 4),
    (16, 32, 1, 4),
    (16, 64, 2, 5),
    (16, 32, 2, 6),
    (16, 32, 1, 6),
]
# Verification (a few new tokens per request): 32-row tiles (V1: 6 tokens x 4 heads).
VERIFY_SWEEP = [
    (32, 64, 4, 3),
    (32, 64, 2, 3),
    (32, 64, 4, 4),
    (32, 64, 2, 4),
    (32, 128, 4, 3),
    (32, 128, 2, 3),
    (32, 128, 4, 4),
    (32, 128, 2, 4),
    (32, 256, 4, 3),
    (32, 32, 2, 4),
]
# Chunks and cached prefill: 128-row tiles of 8 warps, or of 4 warps (two programs per SM);
# a fifth field True gathers K as [block_n, D] rows (TileConfig.k_rows).
CHUNK_SWEEP = [
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (64, 64, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 4),
    (128, 64, 4, 2),
    (128, 64, 4, 3),
    (128, 32, 4, 3),
    (64, 64, 4, 4),
    (128, 64, 4, 4),
    (128, 32, 4, 4),
    (128, 32, 4, 5),
    (128, 64, 4, 3, True),
    (128, 32, 4, 4, True),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write results to this file")
    p.add_argument(
        "--workloads",
        default="P1,P2,P3,D1,D2,D3,D4,V1,C1,P1P,S1,X1,E1D",
        help="comma-separated subset (X1: cascade decode; E1D: E1's decode step at 256 requests, 16/8 heads; "
        "P1P: P1 through the paged kernel)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--no-peers", action="store_true", help="skip the torch SDPA baselines")
    p.add_argument("--flex", action="store_true", help="also time FlexAttention (slow to compile)")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time tile configs and forced split counts "
        "(with --fp8-cache: the FP8 cache's, from CUDA graphs under --graph)",
    )
    p.add_argument(
        "--fp8-cache",
        action="store_true",
        help="also time each paged/decode workload on an FP8 (e4m3) copy of its cache (GB/s of the FP8 "
        "bytes, and the speed-up over the 16-bit cache)",
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="also time the paged/decode workloads replayed from a CUDA graph (no host work in the "
        "timing, as the engine runs decode) and report the host time of one eager call",
    )


@dataclass
class Row:
    name: str
    variant: str
    ms: float
    tflops: float | None = None
    gbps: float | None = None
    floor_ms: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _lengths(lo: int, hi: int, n: int, seed: int) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _bench(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_graph(fn: Callable[[], object], calls: int = 10) -> float:
    """Device time of one `fn` call replayed from a CUDA graph, L2 flushed before each call.

    Eager timing (`_bench`) of a kernel shorter than the host work of launching it measures the
    host: the events bracket the Python that validates, plans and launches. Here a graph of
    `calls` x (flush L2, fn) and a graph of `calls` x (flush L2) are each timed with do_bench
    (median); the difference over `calls` is the device time of fn alone.
    """
    import triton.testing

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    work, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(work):
        for _ in range(calls):
            flush.zero_()
            fn()
    with torch.cuda.graph(flush_only):
        for _ in range(calls):
            flush.zero_()
    t_work = triton.testing.do_bench(work.replay, warmup=25, rep=200, return_mode="median")
    t_flush = triton.testing.do_bench(flush_only.replay, warmup=25, rep=200, return_mode="median")
    return float(t_work - t_flush) / calls


def _host_ms(fn: Callable[[], object], calls: int = 50) -> float:
    """Host time of one eager call (validation, planning, launches), the GPU left to run behind."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return host


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (read + write) and bf16 matmul rate on this card, on random data."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x))
    copy_gbps = 2 * x.numel() * 2 / ms / 1e6
    x = y = None  # free 4 GiB before the matmul
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b)
    return {"copy_gbps": copy_gbps, "matmul_tflops": 2 * 8192**3 / ms / 1e9}


def _causal_flops(lens: list[int]) -> float:
    return sum(4 * D * HQ * L * (L + 1) / 2 for L in lens)


def _paged_inputs(q_lens: list[int], kv_lens: list[int], dtype, *, seed: int = 0, permute: bool = True):
    """Random q and a paged cache holding each request's context, with a permuted block table
    (`permute=False`: each request's pages in physical order, a locality probe)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per = [math.ceil(kv / PAGE) for kv in kv_lens]
    num_blocks = sum(blocks_per)
    k_cache = torch.randn(num_blocks, PAGE, HKV, D, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, PAGE, HKV, D, device="cuda", dtype=dtype, generator=g)
    if permute:
        perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    else:
        perm = torch.arange(num_blocks, device="cuda", dtype=torch.int32)
    block_table = torch.zeros(len(kv_lens), max(blocks_per), dtype=torch.int32, device="cuda")
    start = 0
    for i, nb in enumerate(blocks_per):
        block_table[i, :nb] = perm[start : start + nb]
        start += nb
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=dtype, generator=g)
    cu = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, block_table, cu, seq_lens


def _cumsum(xs: list[int]) -> list[int]:
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


def _kv_bytes(kv_lens: list[int], elem: int = 2) -> float:
    return sum(kv_lens) * HKV * D * 2 * elem


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> float:
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    if not err < tol:
        raise AssertionError(f"{name}: relative max error {err:.3e} over {tol}")
    return err


def _sdpa_ref_paged(q, k_cache, v_cache, block_table, q_lens, kv_lens, limit: int = 4):
    """fp32 SDPA over the first `limit` requests, gathered from the cache (the correctness oracle)."""
    import torch.nn.functional as F

    outs, start = [], 0
    for i, (ql, kv) in enumerate(zip(q_lens[:limit], kv_lens[:limit])):
        idx = torch.arange(kv, device="cuda")
        blocks = block_table[i, idx // PAGE].long()
        k = k_cache[blocks, idx % PAGE].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        v = v_cache[blocks, idx % PAGE].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        qq = q[start : start + ql].float().transpose(0, 1)
        pos_q = torch.arange(kv - ql, kv, device="cuda")
        mask = idx[None, :] <= pos_q[:, None]
        outs.append(F.scaled_dot_product_attention(qq, k, v, attn_mask=mask).transpose(0, 1))
        start += ql
    return torch.cat(outs), start


def bench_prefill(
    name: str, lens: list[int], dtype, rows: list[Row], ceilings, peers: bool, flex: bool, sweep: bool
):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tilellm.kernels as tk
    from tilellm.kernels import config

    T = sum(lens)
    q = torch.randn(T, HQ, D, device="cuda", dtype=dtype)
    k = torch.randn(T, HKV, D, device="cuda", dtype=dtype)
    v = torch.randn(T, HKV, D, device="cuda", dtype=dtype)
    cu = torch.tensor([0] + _cumsum(lens), dtype=torch.int32, device="cuda")
    flops = _causal_flops(lens)
    floor = flops / (ceilings["matmul_tflops"] * 1e12) * 1e3

    # correctness on the first requests (fp32 SDPA oracle)
    o = tk.prefill_attention(q, k, v, cu, max(lens))
    n_chk = min(len(lens), 2)
    s = 0
    for i in range(n_chk):
        L = min(lens[i], 2048)  # causal: the first L queries depend only on the first L keys
        qq = q[s : s + L].float().transpose(0, 1)
        kk = k[s : s + L].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        vv = v[s : s + L].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1)
        _check(f"{name} request {i}", o[s : s + L], ref)
        s += lens[i]

    ms = _bench(lambda: tk.prefill_attention(q, k, v, cu, max(lens)))
    rows.append(Row(name, f"tilellm {str(dtype)[6:]}", ms, flops / ms / 1e9, None, floor))
    if sweep:
        sweep_cfgs = [
            (f"bm{bm} bn{bn} w{w} s{st}", config.TileConfig(bm, bn, w, st)) for bm, bn, w, st in PREFILL_SWEEP
        ]
        if D == 128 and config.gluon_ok():  # hopper.py on any batch, long or short
            sweep_cfgs.append(("hopper.py", config.TileConfig(128, 128, 8, 3, kernel="gluon")))
        for label, cfg in sweep_cfgs:
            try:
                with config.override(prefill=cfg):
                    ms_c = _bench(lambda: tk.prefill_attention(q, k, v, cu, max(lens)))
                rows.append(Row(name, f"tilellm {label}", ms_c, flops / ms_c / 1e9, None, floor))
            except Exception as e:  # a config that does not fit shared memory
                rows.append(Row(name, f"tilellm {label}", float("nan"), note=type(e).__name__))
    if peers:
        # one call per request, K/V expanded to Hq heads outside the timed region
        per_req = []
        s = 0
        for L in lens:
            per_req.append(
                (
                    q[s : s + L].transpose(0, 1).unsqueeze(0),
                    k[s : s + L].transpose(0, 1).repeat_interleave(HQ // HKV, 0).unsqueeze(0),
                    v[s : s + L].transpose(0, 1).repeat_interleave(HQ // HKV, 0).unsqueeze(0),
                )
            )
            s += L
        for label, backend in [
            ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa flash", SDPBackend.FLASH_ATTENTION),
        ]:
            try:

                def run(backend=backend):
                    with sdpa_kernel(backend):
                        for qq, kk, vv in per_req:
                            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

                ms_p = _bench(run)
                rows.append(Row(name, label + " (per request)", ms_p, flops / ms_p / 1e9, None, floor))
            except Exception as e:
                rows.append(Row(name, label, float("nan"), note=f"{type(e).__name__}: {e}"[:80]))
    if flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            doc = torch.repeat_interleave(
                torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda")
            )

            def mask_mod(b, h, qi, ki):
                return (doc[qi] == doc[ki]) & (qi >= ki)

            bm = create_block_mask(mask_mod, None, None, T, T, device="cuda")
            fa = torch.compile(flex_attention)
            qf, kf, vf = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            fa(qf, kf, vf, block_mask=bm, enable_gqa=True)
            ms_f = _bench(lambda: fa(qf, kf, vf, block_mask=bm, enable_gqa=True))
            rows.append(Row(name, "flex document-causal", ms_f, flops / ms_f / 1e9, None, floor))
        except Exception as e:
            rows.append(Row(name, "flex", float("nan"), note=f"{type(e).__name__}: {e}"[:80]))


def bench_paged(
    name: str, q_lens, kv_lens, dtype, rows, ceilings, *, decode: bool, sweep: bool, peers: bool,
    graph: bool = False, fp8_cache: bool = False,
):  # fmt: skip
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tilellm.kernels as tk
    from tilellm.kernels.schedule import plan_split_kv

    q, kc, vc, bt, cu, seq = _paged_inputs(q_lens, kv_lens, dtype)
    byts = _kv_bytes(kv_lens)
    flops = sum(4 * D * HQ * (p + 1) for ql, kv in zip(q_lens, kv_lens) for p in range(kv - ql, kv))
    # the larger of reading K/V once at the copy rate and the products at the matmul rate
    floor = max(byts / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["matmul_tflops"] * 1e12)) * 1e3
    max_q, max_k = max(q_lens), max(kv_lens)
    if decode:
        fn = lambda splits=None: tk.decode_attention(
            q, kc, vc, bt, seq, num_splits=splits, max_seqlen_k=max_k
        )
    else:
        fn = lambda splits=None: tk.paged_attention(
            q, kc, vc, bt, cu, seq, max_q, num_splits=splits, max_seqlen_k=max_k
        )
    ref, n = _sdpa_ref_paged(q, kc, vc, bt, q_lens, kv_lens)
    err = _check(name, fn()[:n], ref)
    plan = plan_split_kv(cu, seq, HQ, HKV, head_dim=D, dtype=dtype)
    ms = _bench(fn)
    rows.append(
        Row(
            name,
            f"tilellm {str(dtype)[6:]} splits={plan.num_splits}",
            ms,
            flops / ms / 1e9,
            byts / ms / 1e6,
            floor,
            extra={"max_rel_err": err, "plan": plan.reason},
        )
    )
    if graph:
        ms_g, host = _bench_graph(fn), _host_ms(fn)
        rows.append(
            Row(name, f"tilellm {str(dtype)[6:]} CUDA graph", ms_g, flops / ms_g / 1e9, byts / ms_g / 1e6,
                floor, note=f"eager call: {host * 1e3:.0f} us of host work")
        )  # fmt: skip
        # As most users call it: required arguments only (the plan comes from the block table's
        # width, no host sync), eagerly and captured in a graph as called.
        if decode:
            bare = lambda: tk.decode_attention(q, kc, vc, bt, seq)
        else:
            bare = lambda: tk.paged_attention(q, kc, vc, bt, cu, seq, max_q)
        _check(f"{name} required args", bare()[:n], ref)
        ms_b, host_b, ms_bg = _bench(bare), _host_ms(bare), _bench_graph(bare)
        rows.append(
            Row(name, f"tilellm {str(dtype)[6:]} eager, required args", ms_b, flops / ms_b / 1e9,
                byts / ms_b / 1e6, floor,
                note=f"{host_b * 1e3:.0f} us host; {ms_bg / ms_b:.0%} of its graph ({ms_bg * 1e3:.1f} us)")
        )  # fmt: skip
    if fp8_cache:
        _bench_fp8_cache(
            name, q, kc, vc, bt, cu, seq, q_lens, kv_lens, max_k, decode, (ms, ms_g if graph else None), rows,
            ceilings, graph, sweep,
        )  # fmt: skip
    if sweep and not fp8_cache:  # (with an FP8 cache the sweep is the FP8 cache's, above)
        from tilellm.kernels import config

        sweep_configs = DECODE_SWEEP if max_q == 1 else VERIFY_SWEEP if max_q <= 16 else CHUNK_SWEEP
        for rows_, bn, w, st, *k_rows in sweep_configs:
            cfg = config.TileConfig(rows_, bn, w, st, k_rows=bool(k_rows and k_rows[0]))
            label = f"tilellm rows{rows_} bn{bn} w{w} s{st}" + (" k-rows" if cfg.k_rows else "")
            try:
                with config.override(paged=cfg):
                    ms_c = _bench(fn)
                rows.append(Row(name, label, ms_c, flops / ms_c / 1e9, byts / ms_c / 1e6, floor))
            except Exception as e:
                rows.append(Row(name, label, float("nan"), note=type(e).__name__))
        for s in [1, 2, 4, 8, 16, 32, 64] + ([96, 128] if max_k >= 65536 else []):
            if s == plan.num_splits:
                continue
            ms_s = _bench(lambda s=s: fn(s))
            rows.append(Row(name, f"tilellm splits={s}", ms_s, flops / ms_s / 1e9, byts / ms_s / 1e6, floor))
        if max_k >= 65536:
            # Locality probe: the same batch with each request's pages in physical order. A large
            # gap to the permuted table points at page-translation (TLB) or DRAM-page locality.
            del q, kc, vc, bt
            q, kc, vc, bt, cu, seq = _paged_inputs(q_lens, kv_lens, dtype, permute=False)
            ref, n = _sdpa_ref_paged(q, kc, vc, bt, q_lens, kv_lens)
            _check(f"{name} in-order pages", fn()[:n], ref)
            ms_o = _bench(fn)
            rows.append(
                Row(name, "tilellm pages in order", ms_o, flops / ms_o / 1e9, byts / ms_o / 1e6, floor)
            )
    if peers and decode and len(set(kv_lens)) == 1 and len(kv_lens) * kv_lens[0] <= 1 << 20:
        # SDPA on contiguous (not paged) K/V, all requests in one batched call
        B, L = len(kv_lens), kv_lens[0]
        qd = q.view(B, HQ, 1, D)
        kd = torch.randn(B, HKV, L, D, device="cuda", dtype=dtype)
        vd = torch.randn(B, HKV, L, D, device="cuda", dtype=dtype)
        for label, backend in [
            ("sdpa cudnn contiguous", SDPBackend.CUDNN_ATTENTION),
            ("sdpa flash contiguous", SDPBackend.FLASH_ATTENTION),
        ]:
            try:

                def run(backend=backend):
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

                run()
                ms_p = _bench(run)
                rows.append(Row(name, label + " (GQA)", ms_p, None, byts / ms_p / 1e6, floor))
                if graph:  # the same method as tilellm's graph row
                    ms_g = _bench_graph(run)
                    rows.append(Row(name, label + " (GQA) CUDA graph", ms_g, None, byts / ms_g / 1e6, floor))
            except Exception as e:
                rows.append(Row(name, label, float("nan"), note=f"{type(e).__name__}: {e}"[:80]))
        del kd, vd
    return ms


def _bench_fp8_cache(
    name, q, kc, vc, bt, cu, seq, q_lens, kv_lens, max_k, decode, ms_16bit, rows, ceilings, graph, sweep
):
    """The workload on an FP8 copy of its cache (per-tensor K and V scales): checked against fp32
    SDPA on the dequantized cache, timed eagerly (and from a CUDA graph with `graph`).
    `ms_16bit` = (eager, graph or None) times of the 16-bit cache: each FP8 time is compared with
    the one taken the same way."""
    import tilellm.kernels as tk
    from tilellm.kernels.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8

    k_scale = (kc.float().abs().amax() / FP8_MAX * 2).reshape(1)
    v_scale = (vc.float().abs().amax() / FP8_MAX * 2).reshape(1)
    kc8, vc8 = quantize_fp8(kc, k_scale), quantize_fp8(vc, v_scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if decode:
        fn = lambda splits=None: tk.decode_attention(
            q, kc8, vc8, bt, seq, num_splits=splits, max_seqlen_k=max_k, **scales
        )
    else:
        fn = lambda splits=None: tk.paged_attention(
            q, kc8, vc8, bt, cu, seq, max(q_lens), num_splits=splits, max_seqlen_k=max_k, **scales
        )
    kd, vd = dequantize_fp8(kc8, k_scale, q.dtype), dequantize_fp8(vc8, v_scale, q.dtype)
    ref, n = _sdpa_ref_paged(q, kd, vd, bt, q_lens, kv_lens)
    del kd, vd
    err = _check(f"{name} fp8 cache", fn()[:n], ref)
    byts = _kv_bytes(kv_lens, elem=1)
    flops = sum(4 * D * HQ * (p + 1) for ql, kv in zip(q_lens, kv_lens) for p in range(kv - ql, kv))
    floor = max(byts / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["matmul_tflops"] * 1e12)) * 1e3
    timings = [("tilellm fp8 cache", _bench(fn), False)] + (
        [("tilellm fp8 cache CUDA graph", _bench_graph(fn), True)] if graph else []
    )
    if sweep:
        from tilellm.kernels import config
        from tilellm.kernels.schedule import plan_split_kv

        # Timed as the figure compared with the target is (a graph's device time with `graph`):
        # eagerly, a call shorter than its host work measures the host.
        timer = _bench_graph if graph else _bench
        configs = DECODE_SWEEP if max(q_lens) == 1 else VERIFY_SWEEP if max(q_lens) <= 16 else CHUNK_SWEEP
        # and decode tiles of 64 rows (4 warps: Triton's warpgroup MMA, whose e4m3 operands are
        # widened from shared memory in a vectorised layout; the rows past the GQA group are masked)
        extra = [
            (16, 256, 4, 3),
            (16, 256, 4, 2),
            (16, 128, 4, 4),
            (64, 64, 4, 3),
            (64, 128, 4, 3),
            (64, 128, 4, 2),
        ]
        for rows_, bn, w, st, *_ in configs + extra:
            for k_rows in (False, True):
                cfg = config.TileConfig(rows_, bn, w, st, k_rows=k_rows)
                label = f"fp8 rows{rows_} bn{bn} w{w} s{st}" + (" k-rows" if k_rows else "")
                try:
                    with config.override(paged=cfg):
                        _check(f"{name} {label}", fn()[:n], ref)
                        timings.append((label, timer(fn), graph))
                except Exception as e:
                    rows.append(Row(name, label, float("nan"), note=type(e).__name__))
        # Forced segment counts: an FP8 key is half the bytes, so the split rule's minimum
        # segment (MIN_KEYS_PER_SPLIT keys) holds half the bytes it holds in a 16-bit cache.
        planned = plan_split_kv(cu, seq, HQ, HKV, head_dim=D, dtype=q.dtype).num_splits
        for s in [1, 2, 4, 8, 16, 32, 64] + ([96, 128] if max_k >= 65536 else []):
            if s != planned and s <= max(1, max_k // 64):
                _check(f"{name} fp8 splits={s}", fn(s)[:n], ref)
                timings.append((f"fp8 splits={s} (planned {planned})", timer(lambda s=s: fn(s)), graph))
    for label, ms, graphed in timings:
        base = ms_16bit[1] if graphed else ms_16bit[0]
        rows.append(
            Row(name, label, ms, flops / ms / 1e9, byts / ms / 1e6, floor,
                note=f"{base / ms:.2f}x the 16-bit cache's tokens/s ({'graphs' if graphed else 'eager'})",
                extra={"max_rel_err": err})
        )  # fmt: skip


def bench_cascade(rows, ceilings, dtype, *, graph: bool = False):
    """X1 (E2's decode): 256 requests sharing a 2048-key cached prefix, + 128..256 own keys."""
    import tilellm.kernels as tk

    B, P = 256, 2048
    own = _lengths(128, 256, B, 7)
    kv = [P + n for n in own]
    q, kc, vc, bt, cu, seq = _paged_inputs([1] * B, kv, dtype)
    n_prefix = P // PAGE
    bt[:, :n_prefix] = bt[0, :n_prefix]  # the prefix cache hands every request the same blocks
    prefix_len = torch.tensor([P], dtype=torch.int32, device="cuda")
    dense = tk.decode_attention(q, kc, vc, bt, seq, max_seqlen_k=max(kv))
    err = _check("X1", tk.cascade_decode_attention(q, kc, vc, bt, seq, prefix_len), dense)
    cascade = lambda: tk.cascade_decode_attention(q, kc, vc, bt, seq, prefix_len)
    plain = lambda: tk.decode_attention(q, kc, vc, bt, seq, max_seqlen_k=max(kv))
    ms_c, ms_d = _bench(cascade), _bench(plain)
    unique = _kv_bytes([P] + own)  # bytes cascade must read: the prefix once, each suffix once
    dense = _kv_bytes(kv)
    unique_floor, dense_floor = (b / (ceilings["copy_gbps"] * 1e9) * 1e3 for b in (unique, dense))
    rows.append(Row("X1", "tilellm cascade decode", ms_c, None, unique / ms_c / 1e6, unique_floor,
                    extra={"max_rel_err": err}))  # fmt: skip
    rows.append(Row("X1", "tilellm plain decode (same batch)", ms_d, None, dense / ms_d / 1e6, dense_floor,
                    note=f"cascade speedup {ms_d / ms_c:.1f}x"))  # fmt: skip
    if graph:
        ms_g, host, ms_pg = _bench_graph(cascade), _host_ms(cascade), _bench_graph(plain)
        rows.append(Row("X1", "tilellm cascade decode CUDA graph", ms_g, None, unique / ms_g / 1e6,
                        unique_floor, note=f"eager call: {host * 1e3:.0f} us of host work"))  # fmt: skip
        rows.append(Row("X1", "tilellm plain decode CUDA graph", ms_pg, None, dense / ms_pg / 1e6,
                        dense_floor, note=f"cascade speedup in graphs {ms_pg / ms_g:.1f}x"))  # fmt: skip


def bench_sparse(rows, ceilings, dtype):
    import tilellm.kernels as tk

    B, L, K = 64, 65536, 2048
    q, kc, vc, bt, cu, seq = _paged_inputs([1] * B, [L] * B, dtype)
    g = torch.Generator(device="cuda").manual_seed(5)
    topk = torch.stack([torch.randperm(L, device="cuda", generator=g)[:K] for _ in range(B)]).to(torch.int32)
    topk, _ = topk.sort(dim=1)
    o = tk.sparse_attention(q, kc, vc, bt, cu, topk, seq_lens=seq)
    # oracle: dense attention restricted to the selected keys, first request
    import torch.nn.functional as F

    idx = topk[0].long()
    blocks = bt[0, idx // PAGE].long()
    k = kc[blocks, idx % PAGE].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    v = vc[blocks, idx % PAGE].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    ref = F.scaled_dot_product_attention(q[0:1].float().transpose(0, 1), k, v).transpose(0, 1)
    err = _check("S1", o[0:1], ref)
    ms_sparse = _bench(lambda: tk.sparse_attention(q, kc, vc, bt, cu, topk, seq_lens=seq))
    ms_dense = _bench(lambda: tk.decode_attention(q, kc, vc, bt, seq, max_seqlen_k=L))
    byts_sparse = B * K * HKV * D * 2 * 2
    rows.append(
        Row(
            "S1",
            "tilellm sparse top-2048",
            ms_sparse,
            None,
            byts_sparse / ms_sparse / 1e6,
            byts_sparse / (ceilings["copy_gbps"] * 1e9) * 1e3,
            extra={"max_rel_err": err},
        )
    )
    rows.append(
        Row(
            "S1",
            "tilellm dense decode (same context)",
            ms_dense,
            None,
            _kv_bytes([L] * B) / ms_dense / 1e6,
            _kv_bytes([L] * B) / (ceilings["copy_gbps"] * 1e9) * 1e3,
            note=f"sparse speedup {ms_dense / ms_sparse:.1f}x",
        )
    )


def _guard(name: str, rows: list[Row], fn: Callable, *args, **kwargs) -> None:
    """Run one workload; a failure is recorded as a row (and fails the command) instead of ending the run."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        import traceback

        traceback.print_exc()
        rows.append(Row(name, "FAILED", float("nan"), note=f"{type(e).__name__}: {e}"[:200]))
    torch.cuda.empty_cache()


@contextlib.contextmanager
def _query_heads(hq: int) -> Iterator[None]:
    """Run a workload with another query-head count (the module's HQ, read by every helper)."""
    global HQ
    saved, HQ = HQ, hq
    try:
        yield
    finally:
        HQ = saved


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise UsageError(
            "this benchmark times the kernels on a CUDA GPU and none is visible here "
            "(on the CPU the kernels' tests run them: pytest tests/kernels)"
        )
    dtype = getattr(torch, args.dtype)
    want = set(args.workloads.split(","))
    t0 = time.time()
    ceilings = measure_ceilings()
    print(
        f"# {torch.cuda.get_device_name()}  copy {ceilings['copy_gbps']:.0f} GB/s  "
        f"matmul {ceilings['matmul_tflops']:.0f} TFLOP/s"
    )
    rows: list[Row] = []
    peers, sweep = not args.no_peers, args.sweep
    prefill = {"P1": _lengths(512, 4096, 16, 1), "P2": [32768], "P3": _lengths(256, 1024, 64, 3)}
    for name, lens in prefill.items():
        if name in want:
            _guard(name, rows, bench_prefill, name, lens, dtype, rows, ceilings, peers, args.flex, sweep)
    decode = {"D1": [2048] * 256, "D2": [32768] * 8, "D3": [131072], "D4": _lengths(128, 16384, 64, 4)}
    for name, kv in decode.items():
        if name in want:
            _guard(
                name,
                rows,
                bench_paged,
                name,
                [1] * len(kv),
                kv,
                dtype,
                rows,
                ceilings,
                decode=True,
                sweep=sweep and (args.fp8_cache or name in ("D1", "D3", "D4")),
                peers=peers,
                graph=args.graph,
                fp8_cache=args.fp8_cache,
            )
            torch.cuda.empty_cache()
    if "E1D" in want:
        # E1's decode steps at 256 running requests as the engine runs them: Qwen3-0.6B's heads
        # (16 query, 8 KV: group 2) and E1's contexts (prompt 100..1024 plus a few outputs).
        with _query_heads(16):
            kv = _lengths(100, 1100, 256, 9)
            _guard("E1D", rows, bench_paged, "E1D", [1] * len(kv), kv, dtype, rows, ceilings,
                   decode=True, sweep=sweep, peers=False, graph=args.graph,
                   fp8_cache=args.fp8_cache)  # fmt: skip
            # The same batch with the longest contexts first: programs launch in request order,
            # so this is longest-processing-time-first scheduling (a shorter tail of the grid).
            lpt = sorted(kv, reverse=True)
            _guard("E1D-longest-first", rows, bench_paged, "E1D-longest-first", [1] * len(kv), lpt, dtype,
                   rows, ceilings, decode=True, sweep=False, peers=False, graph=args.graph,
                   fp8_cache=args.fp8_cache)  # fmt: skip
    if "V1" in want:
        _guard(
            "V1",
            rows,
            bench_paged,
            "V1",
            [6] * 32,
            [8192 + 6] * 32,
            dtype,
            rows,
            ceilings,
            decode=False,
            sweep=sweep,
            peers=False,
            graph=args.graph,
            fp8_cache=args.fp8_cache,
        )
    if "C1" in want:
        _guard(
            "C1",
            rows,
            bench_paged,
            "C1",
            [512] * 16,
            [4096 + 512] * 16,
            dtype,
            rows,
            ceilings,
            decode=False,
            sweep=sweep,
            peers=False,
            graph=args.graph,
            fp8_cache=args.fp8_cache,
        )
    if "P1P" in want:
        # P1's prompts through the paged kernel (all tokens new, K/V read through a permuted block
        # table): the paged family's own P1, the other reading of "C1 >= 90% of the same
        # kernel family's P1".
        p1 = prefill["P1"]
        _guard("P1P", rows, bench_paged, "P1P", p1, p1, dtype, rows, ceilings, decode=False, sweep=False,
               peers=False)  # fmt: skip
    # C1's target, ">= 90% of P1": against the prefill kernel's P1, and P1 through the paged kernel
    first = {n: next((r for r in rows if r.name == n and r.variant.startswith("tilellm") and r.tflops), None)
             for n in ("C1", "P1", "P1P")}  # fmt: skip
    if first["C1"] and first["P1P"]:
        first["P1P"].note = f"C1 / P1P = {first['C1'].tflops / first['P1P'].tflops:.0%}"
    if first["C1"] and first["P1"]:
        ratio = f"C1 / P1 = {first['C1'].tflops / first['P1'].tflops:.0%}"
        first["C1"].note = f"{first['C1'].note}; {ratio}" if first["C1"].note else ratio
    torch.cuda.empty_cache()
    if "S1" in want:
        _guard("S1", rows, bench_sparse, rows, ceilings, dtype)
    if "X1" in want:
        _guard("X1", rows, bench_cascade, rows, ceilings, dtype, graph=args.graph)
    print(f"{'workload':8} {'variant':44} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>7} {'floor ms':>9}  note")
    for r in rows:
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else " " * 8
        gb = f"{r.gbps:7.0f}" if r.gbps is not None else " " * 7
        fl = f"{r.floor_ms:9.3f}" if r.floor_ms is not None else " " * 9
        print(f"{r.name:8} {r.variant:44} {r.ms:9.3f} {tf} {gb} {fl}  {r.note}")
    print(f"# {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "ceilings": ceilings,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return 1 if any(r.variant == "FAILED" for r in rows) else 0
