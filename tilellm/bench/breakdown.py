"""Where an engine workload's time goes: device time by kernel class, the device's idle time, and
the host's work per step (`tilellm bench throughput --profile`).

The workload runs once more under torch.profiler (CUDA activity only: the kernels, also those
replayed from CUDA graphs). Kernels are grouped by name into classes (`kernel_class`); their
device time is summed per class and set against the run's wall time, and what no kernel covers
is the device's idle time (one stream: kernels do not overlap). The host's per-step work comes
from the engine's own step timings of the same run.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

# (class, name fragments), first match wins; names are lower-cased. Order matters: "_store_kernel"
# is the KV store, not attention (MLA's latent rows and the indexer's keys too); cuBLAS's split-K
# reduction, and the FP8 GEMM's, belong to their GEMM. A model whose
# attention layer rotates and stores in one launch (`apply_rotary` with the cache arguments, the
# default) counts that store under its "_rotary_kernel", with the element-wise ops.
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("KV store", ("store_kernel", "store_kvcache", "mla_rows", "store_index")),
    # (DeepSeek-V3.2's indexer, _score_kernel and _select_kernel, is part of its sparse attention)
    (
        "attention",
        (
            "paged",
            "decode",
            "prefill_kernel",
            "attention",
            "attn",
            "merge",
            "sparse",
            "mla",
            "_score_kernel",
            "_select_kernel",
        ),
    ),
    ("MoE experts", ("moe",)),
    # (before the FP8 quantization: RMSNorm and SiLU-and-mul kernels may quantize their output)
    ("RMSNorm", ("rms_norm", "rmsnorm")),
    ("SiLU-and-mul", ("silu",)),
    ("FP8 quantization", ("quant",)),
    (
        "GEMM (linear layers, LM head)",
        (
            "nvjet",
            "gemm",
            "cutlass",
            "xmma",
            "splitk",
            "split_k",
            "matmul",
            "cublas",
            "sm90",
            "skinny",
            "gemv",
            "aten::mm",
            "aten::addmm",
        ),
    ),
    ("rotary", ("rotary", "rope")),
    (
        "sampling",
        ("gumbel", "argmax", "softmax", "topk", "top_k", "sort", "multinomial", "penalt", "bitmask"),
    ),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
)
OTHER = "other"


def kernel_class(name: str) -> str:
    """The class of a kernel, from its name (see KERNEL_CLASSES); OTHER when nothing matches."""
    lowered = name.lower()
    for cls, fragments in KERNEL_CLASSES:
        if any(f in lowered for f in fragments):
            return cls
    return OTHER


@dataclass
class Breakdown:
    """Device seconds by kernel class over one run of `wall_s` seconds and `steps` steps."""

    wall_s: float
    steps: int
    device_s_by_class: dict[str, float] = field(default_factory=dict)
    launches_by_class: dict[str, int] = field(default_factory=dict)
    # The engine's host work per step (ms): schedule, prepare (inputs and launch), postprocess.
    host_ms_per_step: dict[str, float] = field(default_factory=dict)

    @property
    def busy_s(self) -> float:
        return sum(self.device_s_by_class.values())

    @property
    def idle_s(self) -> float:
        return max(self.wall_s - self.busy_s, 0.0)

    def as_dict(self) -> dict:
        return {
            "wall_s": round(self.wall_s, 4),
            "steps": self.steps,
            "device_busy_s": round(self.busy_s, 4),
            "device_idle_s": round(self.idle_s, 4),
            "device_s_by_class": {k: round(v, 4) for k, v in self.device_s_by_class.items()},
            "launches_by_class": dict(self.launches_by_class),
            "host_ms_per_step": {k: round(v, 4) for k, v in self.host_ms_per_step.items()},
        }

    def format(self, title: str) -> str:
        steps = max(self.steps, 1)
        lines = [
            f"where the time goes: {title} ({self.steps} steps, {self.wall_s:.2f} s wall; "
            f"device busy {self.busy_s:.2f} s = {self.busy_s / self.wall_s:.0%}, "
            f"idle {self.idle_s:.2f} s = {self.idle_s / self.wall_s:.0%})",
            f"  {'kernel class':32} {'device s':>9} {'of wall':>8} {'ms/step':>8} {'launches':>9}",
        ]
        for cls, sec in sorted(self.device_s_by_class.items(), key=lambda kv: -kv[1]):
            lines.append(
                f"  {cls:32} {sec:>9.3f} {sec / self.wall_s:>8.1%} {sec / steps * 1e3:>8.3f} "
                f"{self.launches_by_class.get(cls, 0):>9}"
            )
        host = ", ".join(f"{k} {v:.3f}" for k, v in self.host_ms_per_step.items())
        lines.append(f"  host per step (ms, overlapped with the device under async scheduling): {host}")
        return "\n".join(lines)


def breakdown_from_events(events, wall_s: float, steps: int) -> Breakdown:
    """Sum the profiler's kernel averages (`prof.key_averages()`) by class."""
    b = Breakdown(wall_s=wall_s, steps=steps)
    for ev in events:
        device_us = getattr(ev, "self_device_time_total", 0.0)
        if device_us <= 0:
            continue
        cls = kernel_class(ev.key)
        b.device_s_by_class[cls] = b.device_s_by_class.get(cls, 0.0) + device_us / 1e6
        b.launches_by_class[cls] = b.launches_by_class.get(cls, 0) + int(ev.count)
    return b


@dataclass
class KernelGaps:
    """The device's time over a run of steps, from its kernels' start and end times: kernels a
    step, their time a step, and the idle time a step between the kernels of one step (gaps up to
    `step_gap_us`; longer ones lie between steps, where the host prepares the next)."""

    steps: int
    kernels: int
    busy_us: float
    idle_within_us: float
    idle_between_us: float

    def format(self) -> str:
        steps = max(self.steps, 1)
        return (
            f"{self.kernels / steps:.0f} kernels a step, {self.busy_us / steps:.1f} us a step in them; "
            f"the device idles {self.idle_within_us / steps:.1f} us a step between a step's kernels "
            f"and {self.idle_between_us / steps:.1f} us between steps"
        )


def kernel_gaps(spans: list[tuple[float, float]], steps: int, step_gap_us: float = 20.0) -> KernelGaps:
    """`KernelGaps` of kernels given as (start, duration) in microseconds, over `steps` steps. A
    gap is time in which no kernel runs: measured from the latest end so far, so kernels that
    overlap (on other streams) leave none."""
    spans = sorted(spans)
    busy = sum(d for _, d in spans)
    within = between = 0.0
    end = spans[0][0] if spans else 0.0
    for start, dur in spans:
        gap = max(start - end, 0.0)
        if gap <= step_gap_us:
            within += gap
        else:
            between += gap
        end = max(end, start + dur)
    return KernelGaps(steps, len(spans), busy, within, between)


def kernel_spans_from_trace(path: str) -> list[tuple[float, float]]:
    """(start, duration) in microseconds of every kernel of a chrome trace exported by
    torch.profiler (`prof.export_chrome_trace(path)`): its events of category "kernel"."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [(float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "kernel"]


@contextlib.contextmanager
def profiled_kernels() -> Iterator[list]:
    """Profile the CUDA kernels of the block; the list yielded receives `key_averages()` after it.
    Without a GPU, the CPU's operators instead (their self time: a smoke run's breakdown)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    out: list = []
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        yield out
    for ev in prof.key_averages():
        # (on the CPU an operator's self time stands for its "device" time)
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        out.append(SimpleNamespace(key=ev.key, count=ev.count, self_device_time_total=us))
