"""Device time of short calls, as a CUDA graph replays them.

A kernel of a few microseconds timed eagerly measures the host that launches it; captured in a
graph, many calls replay back to back as a decode step's graph runs them, and the replay's time
over the calls is the device's time per call (including the gap between dependent kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graph_replay_us(calls: Sequence[Callable[[], object]], *, warmup: int = 10, rep: int = 100) -> float:
    """Microseconds per call of `calls`, captured once each, in order, in one CUDA graph whose
    replay `triton.testing.do_bench` times (median). Each call runs once first on a side stream,
    so that compilation, library handles and workspaces happen outside the capture. Give each call
    inputs of its own, more bytes in all than the L2 holds, to time reads from HBM."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    return ms * 1e3 / len(calls)


def copy_gbps(device: str = "cuda") -> float:
    """The device's copy rate, GB/s (bytes read + written), over a 1 GiB fp32 buffer: the floor of
    a memory-bound kernel, measured in the same run as the kernel it is set against."""
    import triton.testing

    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6
