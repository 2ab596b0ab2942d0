"""Host time of one eager kernel call, and where it goes (cProfile), on the GPU.

A decode over one long request (D3: 131072 keys) runs for ~140 us on an H200; if validating,
planning and launching the call take longer than the work queued before it, eager timing
measures the host, not the kernel. This prints the host microseconds per call for D3-, D1- and
C1-shaped calls and the top of a profile of the D3 call.
Usage (on the GPU): python benchmarks/host_overhead.py
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

import tilellm.kernels as tk
from tilellm.bench.kernels import _host_ms, _paged_inputs


def report(name: str, q_lens: list[int], kv_lens: list[int], decode: bool, profile: bool) -> None:
    q, kc, vc, bt, cu, seq = _paged_inputs(q_lens, kv_lens, torch.bfloat16)
    if decode:
        fn = lambda: tk.decode_attention(q, kc, vc, bt, seq, max_seqlen_k=max(kv_lens))  # noqa: E731
    else:
        fn = lambda: tk.paged_attention(q, kc, vc, bt, cu, seq, max(q_lens), max_seqlen_k=max(kv_lens))  # noqa: E731
    print(f"{name:32} host {_host_ms(fn) * 1e3:7.1f} us per eager call", flush=True)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue())


def main() -> None:
    report("D3 decode 1 x 131072", [1], [131072], decode=True, profile=True)
    torch.cuda.empty_cache()
    report("D1 decode 256 x 2048", [1] * 256, [2048] * 256, decode=True, profile=False)
    torch.cuda.empty_cache()
    report("C1 paged 16 x (4096 + 512)", [512] * 16, [4608] * 16, decode=False, profile=False)


if __name__ == "__main__":
    main()
