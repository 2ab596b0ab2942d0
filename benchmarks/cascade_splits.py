"""Cascade decode's prefix segments on X1's batch (GPU only), timed inside a CUDA graph.

    python benchmarks/cascade_splits.py

X1: 256 requests sharing a 2048-key prefix (the same physical blocks), 128..256 own keys each,
Hq 32, Hkv 8, D 128, bf16. For each `prefix_splits` (None: the kernel's own rule) it prints the
median time of one call replayed from a CUDA graph (as the engine runs it: no host cost), the
same call made eagerly (host launch cost included), and the error against plain decode.
"""

from __future__ import annotations

import torch
import triton.testing

import tilellm.kernels as tk
from tilellm.bench import kernels as kb


def main() -> None:
    with kb._query_heads(32):
        B, P = 256, 2048
        own = kb._lengths(128, 256, B, 7)
        kv = [P + n for n in own]
        q, kc, vc, bt, _, seq = kb._paged_inputs([1] * B, kv, torch.bfloat16)
        bt[:, : P // kb.PAGE] = bt[0, : P // kb.PAGE]  # the prefix cache's shared blocks
        prefix_len = torch.tensor([P], dtype=torch.int32, device="cuda")
        dense = tk.decode_attention(q, kc, vc, bt, seq, max_seqlen_k=max(kv)).float()
        for splits in (None, 16, 15, 7, 4):
            o = torch.empty_like(q)

            def call(splits=splits, o=o):
                tk.cascade_decode_attention(q, kc, vc, bt, seq, prefix_len, prefix_splits=splits, out=o)

            call()
            torch.cuda.synchronize()
            err = ((o.float() - dense).abs().max() / dense.abs().max()).item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            ms_graph = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
            ms_eager = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
            print(
                f"prefix_splits={splits}: graph {ms_graph * 1e3:.1f} us, eager {ms_eager * 1e3:.1f} us, "
                f"rel err {err:.2e}"
            )


if __name__ == "__main__":
    main()
