"""Prefill kernel experiments on the GPU: tile configs x loop variants, against the package kernel.

    python benchmarks/prefill_variants.py [--json FILE] [--workloads P1,P2,P3]

Each variant is a copy of `tilellm.kernels.prefill`'s kernel with one knob changed, checked
against the package kernel's output (itself checked against fp32 SDPA by `tilellm bench kernels`)
and timed with `triton.testing.do_bench` (median) on SPEC's P1-P3 (bf16, Hq 32, Hkv 8, D 128).

Loop variants of the unmasked key tiles:
  plain     the package's loop
  ws        `tl.range(..., warp_specialize=True)` (Triton's automatic warp specialisation)
  prefetch  software-pipelined by hand: the next tile's Q K^T is issued before this tile's softmax
  lazy      the accumulator is rescaled only when a row's running max grows by more than 2^8
Grid orders: "hm" = (heads, requests, m tiles), the package's order before the fourth session;
"mh" = m tiles fastest, the package's order since (the "package" rows of round 2 ran an interim
order: the heads of a KV group fastest, then m tiles, then KV heads, then requests).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

import tilellm.kernels as tk
from tilellm.bench import kernels as kb
from tilellm.kernels.config import dot_precision
from tilellm.kernels.prefill import LOG2_E, _attend_tiles, _rows_view, _store_rows

MODES = {"plain": 0, "ws": 1, "prefetch": 2, "lazy": 3}
LAZY_THRESHOLD = 8.0  # log2 units: rescale only when some row's max grew by more than 2^8


@triton.jit
def _softmax_step(acc, l_i, m_i, qk, v, qk_scale):
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_ij


LAZY = tl.constexpr(LAZY_THRESHOLD)


@triton.jit
def _full_tiles(acc, l_i, m_i, q, k_desc, v_desc, kv_row0, kv_col, offs_m, offs_n, seq_len, n_end, qk_scale,
                BLOCK_N: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    if MODE == 0:  # the package's own loop
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_desc, v_desc, kv_row0, kv_col, offs_m, offs_n, seq_len,
            0, n_end, qk_scale, BLOCK_N, False, True, PRECISION,
        )  # fmt: skip
    elif MODE == 1:
        for n in tl.range(0, n_end, BLOCK_N, warp_specialize=True):
            k = k_desc.load([kv_row0 + n, kv_col])
            qk = tl.dot(q, tl.trans(k))
            v = v_desc.load([kv_row0 + n, kv_col])
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale)
    elif MODE == 3:
        # Lazy rescaling (FlashAttention-4's trick): keep the running max until some row's grows by
        # more than 2^8; until then P may reach 256 (fine in fp32 sums and a bf16 P), and the
        # [BLOCK_M, D] rescale of acc, a third of the softmax's ALU work, is skipped.
        for n in tl.range(0, n_end, BLOCK_N):
            k = k_desc.load([kv_row0 + n, kv_col])
            qk = tl.dot(q, tl.trans(k))
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if tl.max(m_ij - m_i, 0) > LAZY:
                alpha = tl.math.exp2(m_i - m_ij)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_ij
            p = tl.math.exp2(qk * qk_scale - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
            v = v_desc.load([kv_row0 + n, kv_col])
            acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        if n_end > 0:
            k = k_desc.load([kv_row0, kv_col])
            qk = tl.dot(q, tl.trans(k))
            for n in tl.range(BLOCK_N, n_end, BLOCK_N):
                k = k_desc.load([kv_row0 + n, kv_col])
                qk_next = tl.dot(q, tl.trans(k))
                v = v_desc.load([kv_row0 + n - BLOCK_N, kv_col])
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale)
                qk = qk_next
            v = v_desc.load([kv_row0 + n_end - BLOCK_N, kv_col])
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, qk_scale)
    return acc, l_i, m_i


@triton.jit
def _variant_kernel(q_desc, k_desc, v_desc, O, cu_seqlens, qk_scale, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, MODE: tl.constexpr, M_FAST: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    if M_FAST:
        m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(1)
        req = tl.program_id(2)
    else:
        head = tl.program_id(0)
        req = tl.program_id(1)
        m_tile = tl.num_programs(2) - 1 - tl.program_id(2)
    seq_start = tl.load(cu_seqlens + req)
    seq_len = tl.load(cu_seqlens + req + 1) - seq_start
    m_start = m_tile * BLOCK_M
    if m_start >= seq_len:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([seq_start + m_start, head * HEAD_DIM])
    kv_col = (head // GROUP) * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = (m_start + 1) // BLOCK_N * BLOCK_N
    diag_end = tl.minimum(m_start + BLOCK_M, seq_len)
    acc, l_i, m_i = _full_tiles(acc, l_i, m_i, q, k_desc, v_desc, seq_start, kv_col, offs_m, offs_n, seq_len,
                                full_end, qk_scale, BLOCK_N, MODE, PRECISION)  # fmt: skip
    # Diagonal tiles: the package's masked loop in every variant.
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_desc, v_desc, seq_start, kv_col, offs_m, offs_n, seq_len,
        full_end, diag_end, qk_scale, BLOCK_N, True, True, PRECISION,
    )  # fmt: skip
    _store_rows(O, acc, l_i, seq_start, offs_m, seq_len, head, stride_ot, stride_oh, HEAD_DIM)


def run_variant(q, k, v, cu, max_seqlen, bm, bn, warps, stages, mode, m_fast, o):
    T, Hq, D = q.shape
    batch = cu.numel() - 1
    q_desc = TensorDescriptor.from_tensor(_rows_view(q), [bm, D])
    k_desc = TensorDescriptor.from_tensor(_rows_view(k), [bn, D])
    v_desc = TensorDescriptor.from_tensor(_rows_view(v), [bn, D])
    m_tiles = triton.cdiv(max_seqlen, bm)
    grid = (m_tiles, Hq, batch) if m_fast else (Hq, batch, m_tiles)
    _variant_kernel[grid](
        q_desc, k_desc, v_desc, o, cu, D**-0.5 * LOG2_E, o.stride(0), o.stride(1),
        GROUP=Hq // k.shape[1], HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, MODE=mode, M_FAST=m_fast,
        PRECISION=dot_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return o


# (BLOCK_M, BLOCK_N, warps, stages, loop variant, grid order). Round 1 (fourth session, first
# call) timed 11 configs in "hm" order, 2 in "mh", 4 "prefetch" and 3 "ws" variants (RESULTS.md);
# round 2 compares the orders around the winner, 128x64 tiles of 4 warps and 2 stages.
ROUND_1 = [
    *[(bm, bn, w, st, "plain", "hm") for bm, bn, w, st in [
        (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2), (128, 64, 4, 3),
        (128, 64, 4, 4), (128, 32, 4, 3), (128, 128, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
        (256, 64, 8, 2),
    ]],
    (128, 128, 8, 3, "plain", "mh"),
    (128, 64, 4, 2, "plain", "mh"),
    *[(bm, bn, w, st, "prefetch", "hm") for bm, bn, w, st in [
        (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 2), (128, 64, 4, 3),
    ]],
    *[(bm, bn, w, st, "ws", "hm") for bm, bn, w, st in [(128, 128, 8, 3), (128, 64, 4, 2), (128, 64, 8, 2)]],
]  # fmt: skip
ROUND_3 = [
    (128, 64, 4, 2, "plain", "mh"),
    (128, 64, 4, 2, "lazy", "mh"),
    (64, 64, 4, 3, "plain", "mh"),
    (64, 64, 4, 3, "lazy", "mh"),
]
ROUND_2 = [
    (128, 64, 4, 2, "plain", "hm"),
    (128, 64, 4, 2, "plain", "mh"),
    (128, 32, 4, 2, "plain", "mh"),
    (64, 64, 4, 2, "plain", "mh"),
    (64, 64, 4, 3, "plain", "mh"),
    (128, 64, 4, 3, "plain", "mh"),
]
VARIANTS = {"1": ROUND_1, "2": ROUND_2, "3": ROUND_3}


def _time(fn) -> float:
    return float(triton.testing.do_bench(fn, return_mode="median"))


def bench_workload(name: str, lens: list[int], modes: list[str], variants: list, results: list[dict]) -> None:
    T, max_len = sum(lens), max(lens)
    q = torch.randn(T, kb.HQ, kb.D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, kb.HKV, kb.D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, kb.HKV, kb.D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + kb._cumsum(lens), dtype=torch.int32, device="cuda")
    flops = sum(4 * kb.D * kb.HQ * L * (L + 1) / 2 for L in lens)
    ref = tk.prefill_attention(q, k, v, cu, max_len)
    ms = _time(functools.partial(tk.prefill_attention, q, k, v, cu, max_len))
    print(f"{name:4} package default {'':25} {ms:8.3f} {flops / ms / 1e9:8.1f}")
    results.append({"workload": name, "variant": "package", "ms": ms, "tflops": flops / ms / 1e9})
    for bm, bn, w, st, mode_name, order in variants:
        if mode_name not in modes:
            continue
        o = torch.full_like(q, float("nan"))
        call = functools.partial(
            run_variant, q, k, v, cu, max_len, bm, bn, w, st, MODES[mode_name], order == "mh", o
        )
        label = dict(bm=bm, bn=bn, warps=w, stages=st, mode=mode_name, order=order)
        head = f"{name:4} {bm:4} {bn:4} {w:2} {st:2} {mode_name:9} {order:5}"
        try:
            call()
            torch.cuda.synchronize()
            err = ((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            if not err < 2e-2:  # NaN fails this too
                raise AssertionError(f"err {err}")
            ms = _time(call)
            tf = flops / ms / 1e9
            print(f"{head} {ms:8.3f} {tf:8.1f} {err:.1e}", flush=True)
            results.append({"workload": name, **label, "ms": ms, "tflops": tf, "err": err})
        except Exception as e:  # does not compile / fit / verify
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:90]
            print(f"{head} failed {msg}", flush=True)
            results.append({"workload": name, **label, "error": msg})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--workloads", default="P1,P2,P3")
    ap.add_argument("--modes", default="plain,prefetch,ws,lazy")
    ap.add_argument("--round", default="2", choices=sorted(VARIANTS))
    args = ap.parse_args()
    torch.manual_seed(0)
    workloads = {
        "P1": kb._lengths(512, 4096, 16, 1),
        "P2": [32768],
        "P3": kb._lengths(256, 1024, 64, 3),
    }
    results: list[dict] = []
    print("wl     bm   bn  w  s mode      order       ms  TFLOP/s err")
    for name in args.workloads.split(","):
        bench_workload(name, workloads[name], args.modes.split(","), VARIANTS[args.round], results)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
