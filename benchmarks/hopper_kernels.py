"""The Gluon Hopper kernels (`tilellm.kernels.hopper`) on the GPU: correctness over a shape
matrix, then P1-P3 against the portable Triton kernel and cuDNN, and C1 (plus a 128-token chunk
batch) against the Triton paged kernel, in the same run.

    python benchmarks/hopper_kernels.py [--json FILE] [--variants pp128x3,ws128x3]

Correctness: every case is checked against fp32 SDPA per request (GQA expanded), output poisoned
with NaN first; bf16 and fp16; D 64 and 128; GQA 1, 4 and MQA; lengths 1, block edges, primes.
Timing: `triton.testing.do_bench` (median) on SPEC's P1-P3 (bf16, Hq 32, Hkv 8, D 128); cuDNN
is one SDPA call per request with K/V expanded outside the timed region (SPEC section 6).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tilellm.kernels as tk
from tilellm.bench import kernels as kb
from tilellm.kernels import config, hopper
from tilellm.kernels.prefill import LOG2_E, _rows_view

TRITON_TILE = config.TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)  # prefill.py's best
TRITON_CHUNK = config.TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)  # paged.py's chunk tile


def gluon_call(q, k, v, cu, max_len, o, variant):
    block_n, stages, pp = variant
    hopper.launch_prefill(
        _rows_view(q), _rows_view(k), _rows_view(v), o, cu, max_len,
        q.shape[1] // k.shape[1], q.shape[-1] ** -0.5 * LOG2_E, block_n=block_n, stages=stages,
        pingpong=pp,
    )  # fmt: skip
    return o


def parse_variant(text: str) -> tuple[int, int, bool]:
    """`pp128x3` = ping-pong consumers, 128-key tiles, 3 stages; `ws128x3` = no ping-pong."""
    if text[:2] not in ("pp", "ws"):
        raise ValueError(f"variant {text!r}: expected ppNxS or wsNxS")
    bn, st = text[2:].split("x")
    return int(bn), int(st), text.startswith("pp")


def label(variant) -> str:
    bn, st, pp = variant
    return f"gluon {'pp' if pp else 'ws'} bn{bn} st{st}"


def reference(q, k, v, lens):
    out, s = [], 0
    group = q.shape[1] // k.shape[1]
    for L in lens:
        qq = q[s : s + L].float().transpose(0, 1)
        kk = k[s : s + L].float().transpose(0, 1).repeat_interleave(group, 0)
        vv = v[s : s + L].float().transpose(0, 1).repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1))
        s += L
    return torch.cat(out)


CASES = [  # (lengths, Hq, Hkv, D)
    ([1], 32, 8, 128),
    ([127, 128, 129], 32, 8, 128),
    ([1, 255, 256, 257, 2], 8, 8, 128),
    ([1000, 1, 3001], 16, 1, 128),
    ([4096], 32, 8, 128),
    ([65, 64, 63, 1, 513], 32, 8, 64),
    ([2048, 131], 8, 2, 64),
    ([7, 389, 1024, 4099], 32, 8, 128),
]


def check(variants, results) -> bool:
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for lens, hq, hkv, d in CASES:
            T = sum(lens)
            g = torch.Generator(device="cuda").manual_seed(T)
            q = torch.randn(T, hq, d, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(T, hkv, d, device="cuda", dtype=dtype, generator=g)
            v = torch.randn(T, hkv, d, device="cuda", dtype=dtype, generator=g)
            cu = torch.tensor([0] + kb._cumsum(lens), dtype=torch.int32, device="cuda")
            ref = reference(q, k, v, lens)
            for var in variants:
                o = torch.full_like(q, float("nan"))
                try:
                    gluon_call(q, k, v, cu, max(lens), o, var)
                    torch.cuda.synchronize()
                    err = (o.float() - ref).abs().max().item()
                except Exception as e:  # does not compile / fit
                    err = float("nan")
                    print(f"  {type(e).__name__}: {str(e)[:200]}")
                good = err < (2e-2 if dtype == torch.bfloat16 else 4e-3)  # NaN fails
                ok &= good
                tag = f"{str(dtype)[6:]:8} lens {str(lens)[:28]:28} Hq {hq:2} Hkv {hkv} D {d:3} {label(var)}"
                print(f"{tag} max err {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
                results.append(dict(check=tag, err=err, ok=good))
            # the public entry point dispatches here on Hopper
            o = tk.prefill_attention(q, k, v, cu, max(lens))
            err = (o.float() - ref).abs().max().item()
            ok &= err < (2e-2 if dtype == torch.bfloat16 else 4e-3)
            print(f"{str(dtype)[6:]:8} lens {str(lens)[:28]:28} public prefill_attention max err {err:.2e}")
    return ok


def bench(variants, results) -> None:
    workloads = {"P1": kb._lengths(512, 4096, 16, 1), "P2": [32768], "P3": kb._lengths(256, 1024, 64, 3)}
    print(f"{'wl':4} {'kernel':28} {'ms':>8} {'TFLOP/s':>8}")
    for name, lens in workloads.items():
        bench_workload(name, lens, variants, results)
        torch.cuda.empty_cache()


def bench_workload(name, lens, variants, results) -> None:
    T = sum(lens)
    q = torch.randn(T, kb.HQ, kb.D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, kb.HKV, kb.D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, kb.HKV, kb.D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + kb._cumsum(lens), dtype=torch.int32, device="cuda")
    flops = kb._causal_flops(lens)
    o = torch.empty_like(q)

    def row(label, fn):
        ms = kb._bench(fn)
        print(f"{name:4} {label:28} {ms:8.3f} {flops / ms / 1e9:8.1f}", flush=True)
        results.append(dict(workload=name, kernel=label, ms=ms, tflops=flops / ms / 1e9))

    with config.override(prefill=TRITON_TILE):
        row("triton (portable)", lambda: tk.prefill_attention(q, k, v, cu, max(lens), out=o))
    for var in variants:
        row(label(var), lambda var=var: gluon_call(q, k, v, cu, max(lens), o, var))
    per_req, s = [], 0
    for L in lens:
        per_req.append(
            tuple(
                x[s : s + L].transpose(0, 1).repeat_interleave(kb.HQ // x.shape[1], 0).unsqueeze(0)
                for x in (q, k, v)
            )
        )
        s += L

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for qq, kk, vv in per_req:
                F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

    row("sdpa cudnn (per request)", cudnn)


def paged(variants, results) -> None:
    """C1 (16 x (4096 cached + 512 new)) and a 128-token chunk batch, Gluon vs Triton paged."""
    workloads = {"C1": ([512] * 16, [4608] * 16), "C128": ([128] * 32, [2048 + 128] * 32)}
    print(f"{'wl':4} {'kernel':28} {'ms':>8} {'TFLOP/s':>8} {'err':>8}")
    for name, (q_lens, kv_lens) in workloads.items():
        paged_workload(name, q_lens, kv_lens, variants, results)
        torch.cuda.empty_cache()


def paged_workload(name, q_lens, kv_lens, variants, results) -> None:
    q, kc, vc, bt, cu, sl = kb._paged_inputs(q_lens, kv_lens, torch.bfloat16)
    flops = sum(4 * kb.D * kb.HQ * (p + 1) for ql, kv in zip(q_lens, kv_lens) for p in range(kv - ql, kv))
    ref, n_ref = kb._sdpa_ref_paged(q, kc, vc, bt, q_lens, kv_lens, limit=2)
    o = torch.empty_like(q)

    def row(label, fn):
        o.fill_(float("nan"))
        fn()
        err = ((o[:n_ref].float() - ref).abs().max()).item()
        ms = kb._bench(fn)
        print(f"{name:4} {label:28} {ms:8.3f} {flops / ms / 1e9:8.1f} {err:8.1e}", flush=True)
        results.append(dict(workload=name, kernel=label, ms=ms, tflops=flops / ms / 1e9, err=err))

    with config.override(paged=TRITON_CHUNK):
        row(
            "triton paged (chunk tile)", lambda: tk.paged_attention(q, kc, vc, bt, cu, sl, max(q_lens), out=o)
        )
    for var in variants:
        bn, st, pp = var
        row(
            label(var),
            lambda bn=bn, st=st, pp=pp: hopper.launch_paged(
                _rows_view(q), kc, vc, o, bt, cu, sl, max(q_lens), kb.HQ // kb.HKV,
                kb.D**-0.5 * LOG2_E, block_n=bn, stages=st, pingpong=pp,
            ),
        )  # fmt: skip
    row("public paged_attention", lambda: tk.paged_attention(q, kc, vc, bt, cu, sl, max(q_lens), out=o))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="pp128x3,ws128x3,pp128x2")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants.split(",")]
    results: list[dict] = []
    ok = check(variants, results)
    print("correctness:", "all ok" if ok else "FAILURES", flush=True)
    bench(variants, results)
    paged(variants, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
