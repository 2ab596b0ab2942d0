"""C1 (prefix-cached prefill through the block table) variants on the GPU, in one call.

C1 = 16 requests x (4096 cached + 512 new) tokens, Hq 32, Hkv 8, D 128, 16-key pages. Every
variant runs the package's `_paged_kernel` through `tilellm.kernels.paged._launch` and differs
only in:

- launch order: KV heads fastest (all 128 (request, KV head) pairs stream their K/V at once,
  ~300 MB against a 60 MB L2) or query tiles fastest (the running programs share a few
  requests' K/V in L2);
- tile config (rows, keys per tile, warps, stages, K gathered as rows);
- page order: the block table permuted (as a long-running pool hands out pages) or in
  physical order (a fresh pool), which bounds what the random gather costs.

Each variant's output is compared with the default launch's (itself checked against SDPA).
Usage (on the GPU): python benchmarks/chunk_variants.py [--json FILE] [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tilellm.bench.kernels import _bench, _check, _paged_inputs, _sdpa_ref_paged
from tilellm.kernels import config, paged

HQ, D = 32, 128
Q_LENS, KV_LENS = [512] * 16, [4096 + 512] * 16
CONFIGS = [  # rows, keys per tile, warps, stages, K as rows
    (128, 32, 4, 4, False),
    (128, 32, 4, 3, False),
    (128, 32, 4, 5, False),
    (128, 64, 4, 2, False),
    (128, 64, 4, 3, False),
    (128, 64, 8, 2, False),
    (128, 64, 8, 3, False),
    (128, 128, 8, 2, False),
    (256, 32, 8, 3, False),
    (256, 64, 8, 2, False),
    (64, 32, 4, 4, False),
    (64, 64, 4, 3, False),
    (128, 32, 4, 4, True),
    (128, 64, 4, 3, True),
]


def flops() -> float:
    return sum(4 * D * HQ * (p + 1) for ql, kv in zip(Q_LENS, KV_LENS) for p in range(kv - ql, kv))


def time_variants(dtype: torch.dtype, permute: bool, results: list[dict]) -> None:
    """Time every variant on one cache (pages permuted or in physical order)."""
    total = flops()
    q, kc, vc, bt, cu, seq = _paged_inputs(Q_LENS, KV_LENS, dtype, permute=permute)
    ref, n = _sdpa_ref_paged(q, kc, vc, bt, Q_LENS, KV_LENS)
    default = paged.paged_attention(q, kc, vc, bt, cu, seq, max(Q_LENS), max_seqlen_k=max(KV_LENS))
    err = _check("C1 default", default[:n], ref)
    pages = "permuted" if permute else "in-order"
    print(f"# pages {pages}: default launch max rel err vs SDPA {err:.2e}", flush=True)
    orders = (False, True) if permute else (True,)
    for rows, bn, warps, stages, k_rows in CONFIGS if permute else CONFIGS[:6]:
        cfg = config.TileConfig(rows, bn, warps, stages, k_rows=k_rows)
        for tiles_fastest in orders:
            out = torch.full_like(q, float("nan"))

            def run(out=out, tiles_fastest=tiles_fastest):
                paged._launch(q, kc, vc, bt, cu, seq, max(Q_LENS), out, None, 1, max(KV_LENS),
                              is_decode=False, tiles_fastest=tiles_fastest)  # fmt: skip

            order = "tiles-first" if tiles_fastest else "heads-first"
            label = f"rows{rows} bn{bn} w{warps} s{stages}{' k-rows' if k_rows else ''} {order} pages-{pages}"
            try:
                with config.override(paged=cfg):
                    run()
                    diff = float((out.float() - default.float()).abs().max())
                    ok = diff < 3e-2 and not bool(out.isnan().any())
                    ms = _bench(run) if ok else float("nan")
            except Exception as e:  # a config that does not compile (shared memory) is a row, not the end
                print(f"{label:64} FAILED {type(e).__name__}: {str(e)[:80]}", flush=True)
                results.append({"variant": label, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            tf = total / ms / 1e9 if ok else float("nan")
            print(f"{label:64} {ms:8.3f} ms {tf:7.1f} TFLOP/s  max|diff| {diff:.1e}", flush=True)
            results.append({"variant": label, "ms": ms, "tflops": tf, "max_abs_diff": diff, "ok": ok})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    results: list[dict] = []
    t0 = time.time()
    for permute in (True, False):
        time_variants(dtype, permute, results)
        torch.cuda.empty_cache()
    print(f"# {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            out = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": results}
            json.dump(out, f, indent=1)
    return 0 if all(r.get("ok", True) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
