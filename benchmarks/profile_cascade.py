"""Device time of each launch inside cascade decode (GPU only): X1's batch, 20 calls profiled.

    python benchmarks/profile_cascade.py [--hq 32] [--out DIR]

X1: 256 requests sharing a 2048-key prefix (the same physical blocks), 128..256 own keys each,
bf16, Hkv 8, D 128, page 16. Prints the kernels by device time per call (prefix pass, suffix pass,
merge, and any small torch ops) beside plain decode of the same batch.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from torch.profiler import ProfilerActivity, profile

import tilellm.kernels as tk
from tilellm.bench import kernels as kb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args()
    B, P, calls = 256, 2048, 20
    report = {}
    with kb._query_heads(args.hq):
        own = kb._lengths(128, 256, B, 7)
        kv = [P + n for n in own]
        q, kc, vc, bt, _, seq = kb._paged_inputs([1] * B, kv, torch.bfloat16)
        bt[:, : P // kb.PAGE] = bt[0, : P // kb.PAGE]
        prefix_len = torch.tensor([P], dtype=torch.int32, device="cuda")
        for name, fn in (
            ("cascade", lambda: tk.cascade_decode_attention(q, kc, vc, bt, seq, prefix_len)),
            ("plain", lambda: tk.decode_attention(q, kc, vc, bt, seq, max_seqlen_k=max(kv))),
        ):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            rows = [
                (ev.key[:70], ev.count // calls, ev.self_device_time_total / calls)
                for ev in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
                if ev.self_device_time_total > 0
            ]
            total = sum(r[2] for r in rows)
            print(f"\n{name} decode, Hq {args.hq}: {total:.1f} us of kernels per call")
            for key, count, us in rows:
                print(f"  {key:70} x{count:<3} {us:8.1f} us")
            report[name] = {"us_per_call": total, "kernels": rows}
    out = pathlib.Path(args.out) / f"profile_cascade_hq{args.hq}.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
