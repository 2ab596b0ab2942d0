"""The element-wise kernels of a decode layer at decode sizes: us per call, bytes, GB/s.

    python benchmarks/decode_layer_ops.py [--tokens 1,8,64,128,256,1024] [--json FILE]

Qwen3-0.6B's layer (16 query heads, 8 KV heads, head dim 128, hidden 1024, intermediate 3072),
bf16, as the engine calls each op in a decode step:

- `rotary`: `apply_rotary` on q and k, strided views of the packed qkv projection [T, 4096], with
  Qwen3's per-head q/k norms, storing the rotated keys and v into a paged cache of 16-token pages
  in the same launch (random distinct slots); `rotary fp8` the same into an e4m3 cache with
  per-layer scales;
- `rms_norm`: the residual add and RMSNorm before qkv_proj (`rms_norm(x, w, eps, residual=r)`);
- `silu_and_mul`: SiLU-and-mul of gate_up's output [T, 6144].

Each op's calls are captured in one CUDA graph, one call per layer of its own inputs and cache
(28, as the model's layers, and more if the inputs would fit in the 50 MB L2), as a decode
step's graph runs them; the replay is timed by `triton.testing.do_bench` (median) and divided by
the calls. Bytes: what the call must read and write (the cos/sin rows and norm weights once per
token and once per call); GB/s against the copy rate measured in the same run says how far each
call is from its floor; at a few tokens every call is bound by its launch and its chain of
dependent loads, not by bytes. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from tilellm.bench.timing import copy_gbps, graph_replay_us

HQ, HKV, D, HIDDEN, INTER = 16, 8, 128, 1024, 3072
LAYERS = 28
L2_BYTES = 50 << 20
PAGE = 16
DEVICE = "cuda"


def _count(bytes_per_call: int) -> int:
    return max(LAYERS, -(-2 * L2_BYTES // max(bytes_per_call, 1)))


def _rotary_calls(t: int, fp8: bool) -> tuple[list, int]:
    import tilellm.kernels.fused as tk

    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    e = 1 if fp8 else 2
    # q, k, v in and q, k out (bf16), k and v into the cache, positions, slots, cos/sin rows (fp32)
    nbytes = t * ((HQ + 2 * HKV) * D * 2 + (HQ + HKV) * D * 2 + 2 * HKV * D * e + 8 + D * 4) + 2 * D * 2
    num_blocks = max(64, 4 * -(-t // PAGE))
    calls = []
    for _ in range(_count(nbytes)):
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEVICE, dtype=torch.bfloat16)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)
        k_cache = torch.zeros(num_blocks, PAGE, HKV, D, device=DEVICE, dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * PAGE, device=DEVICE)[:t].to(torch.int64)
        positions = torch.randint(0, 4096, (t,), device=DEVICE, dtype=torch.int64)
        cos_sin = torch.randn(8192, D, device=DEVICE, dtype=torch.float32)
        qw = torch.rand(D, device=DEVICE, dtype=torch.bfloat16) + 0.5
        kw = torch.rand(D, device=DEVICE, dtype=torch.bfloat16) + 0.5
        kwargs = dict(q_norm_weight=qw, k_norm_weight=kw, eps=1e-6, v=v, k_cache=k_cache, v_cache=v_cache)
        if fp8:
            kwargs |= dict(
                k_scale=torch.full((1,), 0.03, device=DEVICE), v_scale=torch.full((1,), 0.04, device=DEVICE)
            )
        calls.append(
            functools.partial(tk.apply_rotary, q, k, positions, cos_sin, slot_mapping=slots, **kwargs)
        )
    return calls, nbytes


def _rms_norm_calls(t: int) -> tuple[list, int]:
    import tilellm.kernels.fused as tk

    nbytes = t * HIDDEN * 2 * 4 + HIDDEN * 2  # x and residual in, out and the new residual out
    calls = []
    for _ in range(_count(nbytes)):
        x = torch.randn(t, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.rand(HIDDEN, device=DEVICE, dtype=torch.bfloat16) + 0.5
        calls.append(lambda x=x, r=r, w=w: tk.rms_norm(x, w, 1e-6, residual=r))
    return calls, nbytes


def _silu_calls(t: int) -> tuple[list, int]:
    import tilellm.kernels.fused as tk

    nbytes = t * INTER * 2 * 3
    calls = []
    for _ in range(_count(nbytes)):
        x = torch.randn(t, 2 * INTER, device=DEVICE, dtype=torch.bfloat16)
        calls.append(lambda x=x: tk.silu_and_mul(x))
    return calls, nbytes


def measure(tokens: list[int]) -> list[dict]:
    rows = []
    for t in tokens:
        for name, make in (
            ("rotary", lambda t=t: _rotary_calls(t, False)),
            ("rotary fp8", lambda t=t: _rotary_calls(t, True)),
            ("rms_norm", lambda t=t: _rms_norm_calls(t)),
            ("silu_and_mul", lambda t=t: _silu_calls(t)),
        ):
            calls, nbytes = make()
            us = graph_replay_us(calls)
            rows.append({"op": name, "tokens": t, "us": us, "bytes": nbytes, "gbps": nbytes / us / 1e3})
            del calls
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64,128,256,1024", help="comma-separated token counts")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_layer_ops.py needs a CUDA GPU", file=sys.stderr)
        return 1
    copy = copy_gbps()
    rows = measure([int(t) for t in args.tokens.split(",")])
    print(f"# {torch.cuda.get_device_name()}, copy rate {copy:.0f} GB/s; us per call (GB/s)")
    for r in rows:
        mb, us, gbps = r["bytes"] / 1e6, r["us"], r["gbps"]
        print(f"{r['op']:14} T={r['tokens']:5d} {us:7.2f} us  {mb:8.3f} MB  {gbps:6.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": copy, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
