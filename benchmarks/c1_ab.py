"""C1 through the public `paged_attention` vs a direct `hopper.launch_paged`, interleaved, eager
(do_bench median) and replayed from a CUDA graph (device time only): run 34 timed the direct
call at 618 TFLOP/s and the public one at 551, run 35's `bench kernels` 557 for the public one.

    python benchmarks/c1_ab.py
"""

from __future__ import annotations

import torch

import tilellm.kernels as tk
from tilellm.bench import kernels as kb
from tilellm.kernels import hopper
from tilellm.kernels.prefill import LOG2_E, _rows_view


def main() -> None:
    q_lens, kv_lens = [512] * 16, [4608] * 16
    q, kc, vc, bt, cu, sl = kb._paged_inputs(q_lens, kv_lens, torch.bfloat16)
    flops = sum(4 * kb.D * kb.HQ * (p + 1) for ql, kv in zip(q_lens, kv_lens) for p in range(kv - ql, kv))
    o = torch.empty_like(q)

    def public():
        tk.paged_attention(q, kc, vc, bt, cu, sl, 512, out=o)

    def direct():
        hopper.launch_paged(_rows_view(q), kc, vc, o, bt, cu, sl, 512, kb.HQ // kb.HKV, kb.D**-0.5 * LOG2_E)

    print(f"{'call':8} {'eager ms':>9} {'TFLOP/s':>8} {'graph ms':>9} {'TFLOP/s':>8} {'host ms':>8}")
    for _ in range(2):
        for name, fn in (("public", public), ("direct", direct)):
            fn()
            ms = kb._bench(fn)
            ms_g = kb._bench_graph(fn)
            host = kb._host_ms(fn)
            tf, tf_g = flops / ms / 1e9, flops / ms_g / 1e9
            print(f"{name:8} {ms:9.3f} {tf:8.1f} {ms_g:9.3f} {tf_g:8.1f} {host:8.3f}", flush=True)


if __name__ == "__main__":
    main()
