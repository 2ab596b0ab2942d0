"""The Gluon FP8 decode kernel (`tilellm/kernels/decode_fp8.py`) against `paged.py`'s FP8 decode
tiles on the same e4m3 cache: checked first (the twin on the dequantized cache for small batches
of every supported shape, and the two kernels against each other on each workload), then timed
from CUDA graphs (`bench kernels`' graph timer: L2 flushed before each call): paged.py (its tiles
forced), `decode_attention` as called (the Gluon kernel where the plan gives it the batch), and
the Gluon kernel at the planned segment count, half and twice it.

Workloads (docs/workloads.md): D1-D4 (32 query heads, 8 KV heads, D 128, page 16) and E1D (E1's
decode step: 256 requests, 16 query heads over 8 KV heads), both launch orders. GB/s counts the
FP8 bytes of K and V read.

Verification (`paged_attention` of a few new tokens a request, causal among themselves): V1 (32
requests x 8192 cached + 6 new tokens, 32 query heads over 8: 24 query rows a request) and V1-G2
(the same with Qwen3-0.6B's heads, 16 over 8, and 4 new tokens: 8 rows), timed as paged.py's FP8
tiles, `paged_attention` as called (the Gluon kernel where the plan gives it the batch: with
`TILELLM_FP8_VERIFY=gluon`), and the Gluon kernel with 8 and 16 MMA columns a program at the
planned segment count (the Gluon plan's), half and twice it.

    python benchmarks/decode_fp8.py [--workloads D1,D2,D3,D4,E1D,V1,V1-G2] [--json out.json]
        [--verify-splits 1,2,4] [--paged-splits 8,16,32] [--verify-shape NAME=HQ:NEW:REQUESTS:CACHED ...]
        [--decode-shape NAME=HQ:REQUESTS:CONTEXT ...]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
from unittest import mock

import torch

import tilellm.kernels as tk
from tilellm.bench import kernels as bk
from tilellm.kernels import config, decode_fp8
from tilellm.kernels.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8
from tilellm.kernels.merge import merge_into
from tilellm.kernels.paged import LOG2_E, plan_paged


def fp8_cache(kc, vc):
    k_scale = (kc.float().abs().amax() / FP8_MAX * 2).reshape(1)
    v_scale = (vc.float().abs().amax() / FP8_MAX * 2).reshape(1)
    return quantize_fp8(kc, k_scale), quantize_fp8(vc, v_scale), k_scale, v_scale


def run_gluon(
    q, kc8, vc8, bt, seq, k_scale, v_scale, splits, min_keys, out, block_n=16, stages=0, cu_q=None, max_q=1,
    cols=None, maxnreg=None,
):  # fmt: skip
    T, Hq, D = q.shape
    parts = lse = None
    if splits > 1:
        parts = torch.empty(splits, T, Hq, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, T, Hq, dtype=torch.float32, device=q.device)
    decode_fp8.launch_decode_fp8(
        q,
        kc8,
        vc8,
        out,
        bt,
        seq,
        D**-0.5 * LOG2_E,
        k_scale,
        v_scale,
        splits,
        min_keys,
        parts,
        lse,
        block_n,
        stages,
        cu_seqlens_q=cu_q,
        max_seqlen_q=max_q,
        cols=cols,
        maxnreg=maxnreg,
    )
    if splits > 1:
        merge_into(parts, lse, out)
    return out


def check_edge_cases(variants) -> list[dict]:
    """Small batches of every supported shape against the twin on the dequantized cache: head
    dims 64 / 128, groups 1-8, pages smaller and larger than a key tile, bf16 and fp16 queries,
    unsplit and split (segments of 16 keys: some empty), contexts of 1 key to a few tiles."""
    from tilellm.kernels import reference as ref

    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    kv, hkv = [1, 15, 16, 17, 33, 200, 700], 2
    for (block_n, stages, *_), D, group, page, dtype, splits in itertools.product(
        variants, (128, 64), (1, 2, 8), (16, 8), (torch.bfloat16, torch.float16), (1, 3)
    ):
        pages = [-(-x // page) for x in kv]
        nb = sum(pages) + 3
        kc8, vc8, ks, vs = fp8_cache(
            torch.randn(nb, page, hkv, D, device="cuda", generator=g) * 3,
            torch.randn(nb, page, hkv, D, device="cuda", generator=g),
        )
        perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
        bt = torch.zeros(len(kv), max(pages) + 2, dtype=torch.int32, device="cuda")
        for i, start in enumerate(itertools.accumulate([0] + pages[:-1])):
            bt[i, : pages[i]] = perm[start : start + pages[i]]
        seq = torch.tensor(kv, dtype=torch.int32, device="cuda")
        q = torch.randn(len(kv), hkv * group, D, device="cuda", dtype=dtype, generator=g)
        out = run_gluon(
            q, kc8, vc8, bt, seq, ks, vs, splits, 16, torch.full_like(q, float("nan")), block_n, stages
        )
        kd, vd = dequantize_fp8(kc8, ks, torch.float32), dequantize_fp8(vc8, vs, torch.float32)
        want = ref.decode_attention(q.float(), kd, vd, bt, seq)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        ok = err < 8e-3 and not out.isnan().any().item()
        results.append(dict(block_n=block_n, stages=stages, D=D, group=group, page=page, dtype=str(dtype),
                            splits=splits, err=err, ok=ok))  # fmt: skip
        if not ok:
            print("FAIL", results[-1])
    passed, worst = sum(r["ok"] for r in results), max(r["err"] for r in results)
    print(f"edge cases: {passed}/{len(results)} pass, max err {worst:.2e}")
    return results


def bench_workload(name: str, hq: int, kv: list[int], variants, report: dict) -> None:
    """One workload: `decode_attention` (paged.py's FP8 tiles, planned) and each Gluon variant at
    the planned segment count, half and twice it; every output checked against paged.py's."""
    bk.HQ = hq
    q, kc, vc, bt, _, seq = bk._paged_inputs([1] * len(kv), kv, torch.bfloat16)
    kc8, vc8, ks, vs = fp8_cache(kc, vc)
    del kc, vc
    max_k = max(kv)
    plan = plan_paged(
        len(kv),
        hq,
        8,
        128,
        q.dtype,
        16,
        1,
        num_tokens=len(kv),
        max_seqlen_k=max_k,
        is_decode=True,
        kv_fp8=True,
    ).split
    out = torch.empty_like(q)

    def triton_fn():  # paged.py: its FP8 decode tiles forced (so the plan never takes the Gluon kernel)
        with config.override(paged=config.paged_config(128, q.dtype, hq // 8, 1, kv_fp8=True)[0]):
            return tk.decode_attention(q, kc8, vc8, bt, seq, max_seqlen_k=max_k, k_scale=ks, v_scale=vs)

    def public_fn():  # what decode_attention runs as called
        return tk.decode_attention(q, kc8, vc8, bt, seq, max_seqlen_k=max_k, k_scale=ks, v_scale=vs)

    def gluon_fn(splits, block_n, stages, maxnreg=None):
        min_keys = plan.min_keys_per_split
        args = (q, kc8, vc8, bt, seq, ks, vs, splits, min_keys, out, block_n, stages)
        return lambda: run_gluon(*args, maxnreg=maxnreg)

    ref_out = triton_fn().float()
    byts = sum(kv) * 8 * 128 * 2  # e4m3 K and V
    planned = plan.num_splits
    rows = [(f"paged.py fp8 (planned {planned})", triton_fn), ("decode_attention as called", public_fn)]
    counts = sorted({planned, max(1, planned // 2), planned * 2})
    for (bn, st, *regs), s in itertools.product(variants, counts):
        if s > max(1, max_k // 64):
            continue
        fn = gluon_fn(s, bn, st, regs[0] if regs else None)
        err = ((fn().float() - ref_out).abs().max() / ref_out.abs().max()).item()
        assert err < 1e-2, (name, bn, st, s, err)
        label = f"gluon bn{bn} st{st}" + (f" regs{regs[0]}" if regs else "") + f" splits={s}"
        rows.append((label + (" (planned)" if s == planned else ""), fn))
    for label, fn in rows:
        ms = bk._bench_graph(fn)
        print(f"{name:<20}{label:<38}{ms:>9.4f}{byts / ms / 1e6:>8.0f}")
        report["rows"].append(dict(workload=name, kernel=label, ms=ms, gbps=byts / ms / 1e6))


def bench_verify(
    name: str,
    hq: int,
    q_len: int,
    num_requests: int,
    context: int,
    report: dict,
    splits: list[int] | None = None,
    paged_splits: list[int] | None = None,
) -> None:
    """A verification workload: `paged_attention` (paged.py's FP8 tiles forced: as planned, and
    at each segment count of `paged_splits`; and as called) and the Gluon kernel with 8 and 16
    columns a program at each segment count of `splits` (default: the planned count, half and
    twice it); every output checked against paged.py's as planned."""
    bk.HQ = hq
    q_lens, kv = [q_len] * num_requests, [context + q_len] * num_requests
    q, kc, vc, bt, cu_q, seq = bk._paged_inputs(q_lens, kv, torch.bfloat16)
    kc8, vc8, ks, vs = fp8_cache(kc, vc)
    del kc, vc
    max_k, group = max(kv), hq // 8
    shape = (num_requests, hq, 8, 128, q.dtype, 16, q_len)
    plan = plan_paged(*shape, num_tokens=q.shape[0], max_seqlen_k=max_k, kv_fp8=True)
    with mock.patch.dict(os.environ, {"TILELLM_FP8_VERIFY": "gluon"}):  # the Gluon kernel's segments
        gluon_plan = plan_paged(*shape, num_tokens=q.shape[0], max_seqlen_k=max_k, kv_fp8=True)
    out = torch.empty_like(q)
    args = (q, kc8, vc8, bt, cu_q, seq, q_len)

    def triton_fn(
        num_splits=None,
    ):  # paged.py: its FP8 tiles forced (so the plan never takes the Gluon kernel)
        with config.override(paged=config.paged_config(128, q.dtype, group, q_len, kv_fp8=True)[0]):
            return tk.paged_attention(
                *args, max_seqlen_k=max_k, k_scale=ks, v_scale=vs, num_splits=num_splits
            )

    def public_fn():
        return tk.paged_attention(*args, max_seqlen_k=max_k, k_scale=ks, v_scale=vs)

    ref_out = triton_fn().float()
    byts = sum(kv) * 8 * 128 * 2  # e4m3 K and V
    planned = gluon_plan.split.num_splits
    with config.override(paged=config.paged_config(128, q.dtype, group, q_len, kv_fp8=True)[0]):
        paged_planned = plan_paged(
            *shape, num_tokens=q.shape[0], max_seqlen_k=max_k, kv_fp8=True
        ).split.num_splits
    rows = [
        (f"paged.py fp8 tiles (planned {paged_planned})", triton_fn),
        (f"paged_attention as called ({plan.kernel})", public_fn),
    ]
    for s in paged_splits or []:
        fn = functools.partial(triton_fn, s)
        err = ((fn().float() - ref_out).abs().max() / ref_out.abs().max()).item()
        assert err < 1e-2, (name, "paged.py", s, err)
        rows.append((f"paged.py fp8 tiles splits={s}", fn))
    counts = splits or sorted({planned, max(1, planned // 2), planned * 2})
    for cols, s in itertools.product((8, 16), counts):
        if s > max(1, max_k // 64):
            continue
        fn = functools.partial(
            run_gluon, q, kc8, vc8, bt, seq, ks, vs, s, gluon_plan.split.min_keys_per_split, out,
            decode_fp8.BLOCK_N, decode_fp8.STAGES, cu_q, q_len, cols,
        )  # fmt: skip
        err = ((fn().float() - ref_out).abs().max() / ref_out.abs().max()).item()
        assert err < 1e-2, (name, cols, s, err)
        rows.append((f"gluon cols{cols} splits={s}" + (" (planned)" if s == planned else ""), fn))
    for label, fn in rows:
        ms = bk._bench_graph(fn)
        print(f"{name:<20}{label:<38}{ms:>9.4f}{byts / ms / 1e6:>8.0f}")
        report["rows"].append(dict(workload=name, kernel=label, ms=ms, gbps=byts / ms / 1e6))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="D1,D2,D3,D4,E1D,E1D-longest-first,V1,V1-G2")
    p.add_argument(
        "--variants",
        default=f"{decode_fp8.BLOCK_N}:{decode_fp8.STAGES}",
        help="block_n:stages[:maxnreg] of the Gluon kernel, comma-separated (stages 0: register prefetch; "
        "maxnreg: a cap on the registers a thread)",
    )
    p.add_argument(
        "--verify-splits",
        help="segment counts for the verification workloads, comma-separated (default: the planned count, "
        "half and twice it)",
    )
    p.add_argument(
        "--paged-splits",
        help="segment counts forced on paged.py's tiles in the verification workloads, comma-separated "
        "(default: only its planned count)",
    )
    p.add_argument(
        "--verify-shape",
        action="append",
        default=[],
        metavar="NAME=HQ:NEW:REQUESTS:CACHED",
        help="an extra verification workload (8 KV heads, D 128): query heads, new tokens a request, "
        "requests, cached keys a request; repeatable",
    )
    p.add_argument(
        "--decode-shape",
        action="append",
        default=[],
        metavar="NAME=HQ:REQUESTS:CONTEXT",
        help="an extra decode workload (8 KV heads, D 128): query heads, requests, keys each; repeatable",
    )
    p.add_argument("--no-check", action="store_true", help="skip the edge-case checks")
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_fp8.py needs a CUDA GPU (an H100 or H200)")
    variants = [tuple(map(int, v.split(":"))) for v in args.variants.split(",")]
    report = {"device": torch.cuda.get_device_name(), "rows": []}
    if not args.no_check:
        report["edge_cases"] = check_edge_cases(variants)
    e1d = bk._lengths(100, 1100, 256, 9)
    workloads = {
        "D1": (32, [2048] * 256),
        "D2": (32, [32768] * 8),
        "D3": (32, [131072]),
        "D4": (32, bk._lengths(128, 16384, 64, 4)),
        "E1D": (16, e1d),
        "E1D-longest-first": (16, sorted(e1d, reverse=True)),
    }
    verify = {"V1": (32, 6, 32, 8192), "V1-G2": (16, 4, 32, 8192)}  # heads, new tokens, requests, cached
    names = args.workloads.split(",") if args.workloads else []
    for spec in args.verify_shape:
        name, shape = spec.split("=")
        verify[name] = tuple(map(int, shape.split(":")))
        names.append(name)
    for spec in args.decode_shape:
        name, shape = spec.split("=")
        hq, requests, context = map(int, shape.split(":"))
        workloads[name] = (hq, [context] * requests)
        names.append(name)
    verify_splits = [int(x) for x in args.verify_splits.split(",")] if args.verify_splits else None
    paged_splits = [int(x) for x in args.paged_splits.split(",")] if args.paged_splits else None
    print(f"{'workload':<20}{'kernel':<38}{'ms':>9}{'GB/s':>8}")
    for name in names:
        if name in verify:
            bench_verify(name, *verify[name], report, verify_splits, paged_splits)
        else:
            bench_workload(name, *workloads[name], variants, report)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
