"""`tilellm/kernels/hopper.py` against another version of itself, on the same inputs in one
process: a schedule change checked bit for bit, then timed with its baseline beside it.

The baseline is a hopper.py file (its imports resolve against this checkout), for example the
committed one before a change:

    git show HEAD~1:tilellm/kernels/hopper.py > /tmp/hopper_base.py
    python benchmarks/hopper_ab.py --baseline /tmp/hopper_base.py [--workloads P1,P2] [--json out.json]

Workloads (docs/workloads.md; 32 query heads, 8 KV heads, D 128): P1, P2, P3 (packed prefill,
run through hopper.py whatever `prefill_attention` would pick), P1-fp16, C1 and P1P (paged,
pages of 16 keys), and "chunks" (32 chunks of 128 tokens over 2048 cached). Each is checked
first: the tree's output equal to the baseline's bit for bit (once, and again after three more
calls), and against fp32 SDPA on its first requests. Then `do_bench` (L2 cleared before each call)
of the two, alternated three times; the median of each is reported in TFLOP/s, with the median
of back-to-back calls (L2 warm) beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch
import torch.nn.functional as F
import triton.testing

from tilellm.bench import kernels as bk
from tilellm.kernels import hopper
from tilellm.kernels.config import LOG2_E
from tilellm.kernels.prefill import rows_view

HQ, HKV, D = bk.HQ, bk.HKV, bk.D
GROUP = HQ // HKV
SCALE_LOG2 = D**-0.5 * LOG2_E


def _load(path: str):
    spec = importlib.util.spec_from_file_location("hopper_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _packed(kernels, lens, dtype):
    """(launchers by name, q, FLOPs, check) for causal prefill over packed K/V."""
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, device="cuda", dtype=dtype) for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, *bk._cumsum(lens)], dtype=torch.int32, device="cuda")
    rows = rows_view(q), rows_view(k), rows_view(v)
    launch = {
        name: (lambda o, m=m: m.launch_prefill(*rows, o, cu, max(lens), GROUP, SCALE_LOG2))
        for name, m in kernels.items()
    }

    def check(o):
        start = 0
        for i in range(min(2, len(lens))):
            n = min(lens[i], 2048)  # causal: the first n queries see only the first n keys
            qq = q[start : start + n].float().transpose(0, 1)
            kk, vv = (
                x[start : start + n].float().transpose(0, 1).repeat_interleave(GROUP, 0) for x in (k, v)
            )
            ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1)
            bk._check(f"request {i}", o[start : start + n], ref)
            start += lens[i]

    return launch, q, bk._causal_flops(lens), check


def _paged(kernels, q_lens, kv_lens, dtype):
    """The same for new tokens over a paged cache (permuted pages of 16 keys)."""
    q, k_cache, v_cache, block_table, cu, seq_lens = bk._paged_inputs(q_lens, kv_lens, dtype)
    args = (k_cache, v_cache)
    launch = {
        name: (
            lambda o, m=m: m.launch_paged(
                rows_view(q), *args, o, block_table, cu, seq_lens, max(q_lens), GROUP, SCALE_LOG2
            )
        )
        for name, m in kernels.items()
    }
    flops = sum(4 * D * HQ * (p + 1) for ql, kv in zip(q_lens, kv_lens) for p in range(kv - ql, kv))

    def check(o):
        ref, n = bk._sdpa_ref_paged(q, k_cache, v_cache, block_table, q_lens, kv_lens, limit=2)
        bk._check("first requests", o[:n], ref)

    return launch, q, flops, check


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a hopper.py file to compare the tree's against")
    p.add_argument("--workloads", default="P1,P2,P3,P1-fp16,C1,P1P,chunks")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    kernels = {"baseline": _load(args.baseline), "tree": hopper}
    p1 = bk._lengths(512, 4096, 16, 1)
    bf16 = torch.bfloat16
    workloads = {
        "P1": lambda: _packed(kernels, p1, bf16),
        "P2": lambda: _packed(kernels, [32768], bf16),
        "P3": lambda: _packed(kernels, bk._lengths(256, 1024, 64, 3), bf16),
        "P1-fp16": lambda: _packed(kernels, p1, torch.float16),
        "C1": lambda: _paged(kernels, [512] * 16, [4096 + 512] * 16, bf16),
        "P1P": lambda: _paged(kernels, p1, p1, bf16),
        "chunks": lambda: _paged(kernels, [128] * 32, [2048 + 128] * 32, bf16),
    }
    print(f"# {torch.cuda.get_device_name()}  baseline {args.baseline}")
    print(
        f"{'workload':9s} {'baseline TFLOP/s':>17s} {'tree TFLOP/s':>13s} {'change':>7s}"
        "   warm L2: baseline / tree"
    )
    results = {}
    for name in args.workloads.split(","):
        launch, q, flops, check = workloads[name]()
        outs = {}
        for kernel, fn in launch.items():
            outs[kernel] = torch.full_like(q, float("nan"))
            fn(outs[kernel])
        check(outs["tree"])
        if not torch.equal(outs["tree"], outs["baseline"]):
            raise AssertionError(f"{name}: the tree's output differs from the baseline's")
        again = torch.empty_like(q)
        for _ in range(3):
            launch["tree"](again)
        if not torch.equal(again, outs["baseline"]):
            raise AssertionError(f"{name}: repeated calls differ from the first")
        cold = {kernel: [] for kernel in launch}
        warm = {kernel: [] for kernel in launch}
        for _ in range(3):
            for kernel, fn in launch.items():
                o = torch.empty_like(q)
                cold[kernel].append(
                    triton.testing.do_bench(
                        lambda fn=fn, o=o: fn(o), warmup=25, rep=200, return_mode="median"
                    )
                )
                events = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
                for c in range(4):
                    events[2 * c].record()
                    fn(o)
                    events[2 * c + 1].record()
                torch.cuda.synchronize()
                warm[kernel] += [events[2 * c].elapsed_time(events[2 * c + 1]) for c in range(1, 4)]
        tf = {kernel: flops / _median(ms) / 1e9 for kernel, ms in cold.items()}
        tf_warm = {kernel: flops / _median(ms) / 1e9 for kernel, ms in warm.items()}
        change = tf["tree"] / tf["baseline"] - 1
        print(
            f"{name:9s} {tf['baseline']:17.1f} {tf['tree']:13.1f} {change:+7.1%}   "
            f"{tf_warm['baseline']:.1f} / {tf_warm['tree']:.1f}",
            flush=True,
        )
        results[name] = {"tflops": tf, "tflops_warm_l2": tf_warm, "ms": cold, "ms_warm_l2": warm}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "baseline": args.baseline, "workloads": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
