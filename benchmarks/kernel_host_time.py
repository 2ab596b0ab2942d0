"""Host time of eager kernel calls: microseconds of Python and launch work per call.

Each call is repeated 200 times with the GPU left to run behind (one synchronize per round),
best of 7 rounds; the shapes are D1-D3's decode batches (docs/workloads.md), a small decode
batch whose plan splits short contexts, a verification-shaped `paged_attention`, a prefill, the
KV store and an RMSNorm. A kernel whose device time is longer than its host time hides the
host in an eager loop, so the figures say which calls a host can keep up with.

Usage: python benchmarks/kernel_host_time.py [--json FILE] [--profile N]   (a CUDA GPU; about 20 s)
       python benchmarks/kernel_host_time.py --python-only [--json FILE]   (any machine)
Compare two trees by running it with each on PYTHONPATH, one after the other, on one machine.
`--profile N` then runs each call 200 times more under cProfile and prints its N costliest
functions by own time, in microseconds per call (native functions, such as Triton's binder and
launcher, appear as built-ins). The profiler adds its own cost to every Python call it sees, so
its figures give shares, not times.

`--python-only` measures the host path's Python work alone, on the CPU: the same calls on CPU
tensors, every launch by a key through `FastLaunch`'s keyed path (its key lookup, settings checks,
each tensor's dtype, address and alignment, the tensor maps' cache) with Triton's native launcher
replaced by a no-op, the device and stream queries by constants, and the value checks off (as on
a GPU without TILELLM_DEBUG), so that a change to the host path can be weighed without a GPU.
Launches without a key (Triton's binder) are not counted. Allocations are the CPU's, not the CUDA
caching allocator's; decode and verification calls take `max_seqlen_k` (with CPU tensors the
required-arguments path plans from `seq_lens`, which a GPU call never reads).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import tilellm.kernels as tk
from tilellm.kernels.config import gluon_ok
from tilellm.kernels.fused import apply_rotary, rms_norm, silu_and_mul

DEVICE = "cuda"
HQ, HKV, D, PAGE = 32, 8, 128, 16


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _python_only() -> None:
    """CPU tensors, value checks as on a GPU, and every launch by a key through `FastLaunch`'s
    keyed path with the native launcher replaced by a no-op (see the docstring)."""
    import importlib

    global DEVICE
    DEVICE = "cpu"
    launch = importlib.import_module("tilellm.kernels.launch")
    # (the device and stream queries of a GPU launch: constants here)
    launch._current_device = lambda: 0
    launch.current_stream = lambda device: 0

    def keyed_launch(self, grid, args, kwargs, key=None):
        if key is None:
            return  # (a launch without a key binds on every call: Triton's binder, not counted)
        if key not in self._bound:
            self._bound[key] = _stub_binding(launch, args)
        if not self._launch_bound(key, grid, args):
            raise RuntimeError(f"--python-only: the keyed launch of {self.fn} did not take its bound path")

    launch.FastLaunch.run = keyed_launch
    importlib.import_module("tilellm.kernels.validation").deep_checks_enabled = lambda t: False


def _stub_binding(launch, args: tuple):
    """What `FastLaunch._bind` would remember for these arguments, on device 0, with a native
    launcher that does nothing (`"".format` takes any arguments) and tensor maps that are their
    descriptors."""
    tensors = [i for i, a in enumerate(args) if type(a) in launch._TENSOR_TYPES]
    descriptors = [i for i, a in enumerate(args) if launch._is_descriptor(a)]
    bits = tuple(1 << n for n in range(len(tensors)))
    return launch._Bound(
        device=0,
        kernel=type("Kernel", (), {"function": 0, "packed_metadata": None})(),
        tensor_positions=tuple(tensors),
        dtypes=tuple(args[i].dtype for i in tensors),
        descriptor_positions=tuple(descriptors),
        descriptor_types=tuple(type(args[i]) for i in descriptors),
        alignment_bits=bits,
        misaligned=sum(bit for i, bit in zip(tensors, bits) if args[i].data_ptr() & 15),
        tail=(),
        direct=launch._DirectLaunch(
            launch="".format,
            cooperative=False,
            pdl=False,
            descriptors=tuple((i, {}, ("stub", i)) for i in descriptors),
            make_tensordesc_arg=lambda desc, meta: [desc],
        ),
    )


def _decode_batch(batch: int, seq_len: int):
    blocks = batch * -(-seq_len // PAGE)
    k_cache = torch.randn(blocks, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(blocks, device=DEVICE, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), seq_len, device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device=DEVICE, dtype=torch.bfloat16)
    return q, k_cache, v_cache, block_table, seq_lens


def host_us(fn: Callable[[], object], calls: int = 200, rounds: int = 7) -> float:
    """Best of `rounds` of `calls` eager calls: microseconds of host time per call."""
    fn()
    fn()
    _sync()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        _sync()
    return best


def profile_calls(calls: dict[str, Callable[[], object]], top: int, n: int = 200) -> dict[str, list]:
    """Each call `n` times under cProfile: its `top` costliest functions by own time, as
    (function, microseconds per call)."""
    import cProfile
    import pstats

    out = {}
    for name, fn in calls.items():
        fn()
        _sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        _sync()
        stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        out[name] = [
            (f"{func} ({file.rsplit('/', 1)[-1]}:{line})", tot / n * 1e6)
            for (file, line, func), (_, _, tot, _, _) in rows
        ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--python-only", action="store_true", help="the wrappers' Python work, on the CPU")
    p.add_argument(
        "--profile", type=int, default=0, metavar="N", help="print each call's N costliest functions"
    )
    args = p.parse_args()
    if args.python_only:
        _python_only()
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --python-only)")
    torch.manual_seed(0)
    calls: dict[str, Callable[[], object]] = {}
    decode = {"D1": (256, 2048), "D2": (8, 32768), "D3": (1, 131072), "4 x 256": (4, 256)}
    for name, (batch, seq_len) in decode.items():
        a = _decode_batch(batch, seq_len)
        if DEVICE == "cuda":
            calls[f"decode {name}, required args"] = lambda a=a: tk.decode_attention(*a)
        calls[f"decode {name}, max_seqlen_k"] = lambda a=a, n=seq_len: tk.decode_attention(*a, max_seqlen_k=n)
    if DEVICE == "cuda" and gluon_ok():  # decode over an FP8 cache runs the Gluon kernel (H100/H200)
        a = _decode_batch(8, 32768)
        k8, v8 = a[1].to(torch.float8_e4m3fn), a[2].to(torch.float8_e4m3fn)
        scale = torch.ones((), device=DEVICE)
        fp8 = (a[0], k8, v8, a[3], a[4])
        calls["decode D2, FP8 cache (Gluon), required args"] = lambda: tk.decode_attention(
            *fp8, k_scale=scale, v_scale=scale
        )
    q, kc, vc, bt, seq = _decode_batch(64, 1024)
    q_verify = torch.randn(256, HQ, D, device=DEVICE, dtype=torch.bfloat16)
    cu = torch.arange(0, 257, 4, device=DEVICE, dtype=torch.int32)
    # (with CPU tensors the call would plan from seq_lens: give the bound a GPU call derives)
    hint = {} if DEVICE == "cuda" else {"max_seqlen_k": 1024}
    calls["paged_attention 64 x 4 tokens"] = lambda: tk.paged_attention(
        q_verify, kc, vc, bt, cu, seq, 4, **hint
    )
    q_pre = torch.randn(2048, HQ, D, device=DEVICE, dtype=torch.bfloat16)
    k_pre = torch.randn(2048, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    cu_pre = torch.arange(0, 2049, 512, device=DEVICE, dtype=torch.int32)
    calls["prefill_attention 4 x 512"] = lambda: tk.prefill_attention(q_pre, k_pre, k_pre, cu_pre, 512)
    slots = torch.arange(256, device=DEVICE, dtype=torch.int64)
    k_new = torch.randn(256, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    calls["store_kvcache 256 tokens"] = lambda: tk.store_kvcache(k_new, k_new, kc, vc, slots)
    x = torch.randn(256, 1024, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16)
    calls["rms_norm 256 x 1024"] = lambda: rms_norm(x, w, 1e-6)
    gate_up = torch.randn(256, 6144, device=DEVICE, dtype=torch.bfloat16)
    calls["silu_and_mul 256 x 6144"] = lambda: silu_and_mul(gate_up)
    q_rot, k_rot = torch.randn(256, 16, D, device=DEVICE, dtype=torch.bfloat16), k_new[:, :HKV]
    positions = torch.arange(256, device=DEVICE)
    cos_sin = torch.randn(4096, D, device=DEVICE)
    norm_w = torch.randn(D, device=DEVICE, dtype=torch.bfloat16)
    calls["apply_rotary 256 tokens, q/k norms"] = lambda: apply_rotary(
        q_rot, k_rot, positions, cos_sin, q_norm_weight=norm_w, k_norm_weight=norm_w
    )
    # (the prefill's device time is long: fewer calls a round)
    res = {name: host_us(fn, calls=50 if name.startswith("prefill") else 200) for name, fn in calls.items()}
    where = "Python work only, no native launch (CPU)" if DEVICE == "cpu" else torch.cuda.get_device_name()
    print(f"# {where}, tilellm from {tk.__file__}")
    for k, v in res.items():
        print(f"{k:40s} {v:8.1f} us")
    if args.profile:
        for name, rows in profile_calls(calls, args.profile).items():
            print(f"\n{name}: own time per call")
            for func, us in rows:
                print(f"  {us:7.2f} us  {func}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
