"""Launching a Triton kernel with little host work.

`kernel[grid](*args)` cost 30.7 us of host time on an H200 machine's host for a kernel of 34
arguments, of which the compiled launcher took 9.2 (the rest is Triton's `JITFunction.run`:
option and knob lookups, the cache key as a string, launch metadata for profiler hooks). An eager
decode call launches one kernel, or two when it splits the keys (the split-KV pass and its
merge): through `kernel[grid]`, about 60 of a split call's 145-158 us (docs/benchmarks.md,
"Kernels called with their required arguments").

`FastLaunch(kernel)[grid](*args)` launches the same compiled binary with the same arguments. It
runs Triton's own binder (native code: each argument's type, 16-byte alignment and integer
specialisation, exactly as Triton keys its cache) and looks the compiled kernel up by that
specialisation; only a first call, or one Triton would compile anew, goes through
`JITFunction.run`. The slow path runs instead under the interpreter, with launch or pre-run
hooks installed (a profiler such as proton), in Triton's debug, instrumentation or sanitiser
modes, or on a Triton whose internals differ. One check of `JITFunction.run` is not repeated:
that the module globals a kernel read when it was compiled still hold the same values (the
kernels here read only constants).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from triton import knobs


def _default_settings() -> bool:
    """Whether Triton runs with its default settings: no launch hook (a profiler), no debug mode,
    no instrumentation or sanitiser mode, no stage-inspection hook. Those change what
    `JITFunction.run` does or compiles, so every launch then takes Triton's path."""
    runtime, compilation = knobs.runtime, knobs.compilation
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return not (
        runtime.debug
        or compilation.instrumentation_mode
        or getattr(compilation, "fpsan_homomorphic_casts", False)
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
    )


class FastLaunch:
    """`FastLaunch(jit_fn)[grid](*args, **kwargs)`: `jit_fn[grid](*args, **kwargs)` with less host work.

    `grid` is a tuple of one to three ints (no callables). The compiled kernels are keyed per
    device by Triton's own specialisation of the arguments plus the launch options, so every call
    runs the binary that `jit_fn[grid]` would run.
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self._kernels: dict[tuple, Any] = {}
        self._binders: dict[int, Callable | None] = {}  # None: this kernel takes Triton's path
        self.fast_launches = 0  # calls that skipped JITFunction.run (tests read it)
        # Fixed when the kernel was decorated: under TRITON_INTERPRET=1 `triton.jit` returns an
        # interpreted function, with no compiled binaries to look up (Triton's path runs it).
        self._compiled = hasattr(fn, "device_caches")

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _slow(self, grid, args, kwargs):
        return self.fn[grid](*args, **kwargs)

    def run(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if not self._compiled or getattr(self.fn, "pre_run_hooks", None) or not _default_settings():
            self._slow(grid, args, kwargs)
            return
        device = torch.cuda.current_device()
        if device not in self._binders:
            self._binders[device] = self._find_binder(device)
        binder = self._binders[device]
        if binder is None:
            self._slow(grid, args, kwargs)
            return
        bound_args, specialization, options = binder(*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._slow(grid, args, kwargs)  # compiles, or finds Triton's cached binary
            if kernel is not None:
                self._kernels[key] = getattr(kernel, "result", lambda: kernel)()
            return
        stream = _current_stream(device)
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *bound_args.values())  # fmt: skip
        self.fast_launches += 1

    def _find_binder(self, device: int) -> Callable | None:
        """Triton's argument binder for `device`, or None (the slow path for good) when this
        Triton keeps it elsewhere or the kernel was built with `debug=True`."""
        if getattr(self.fn, "debug", False):
            return None
        try:
            caches = self.fn.device_caches[device]
        except (AttributeError, KeyError, TypeError):
            return None
        # (kernel cache, key cache, target, backend, binder) in Triton 3.4-3.9
        if not isinstance(caches, tuple) or len(caches) != 5 or not callable(caches[4]):
            return None
        return caches[4]


def _current_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream if _raw_stream is None else _raw_stream(device)


try:  # the raw handle of the current stream without a Stream object (what Triton's driver calls)
    _raw_stream: Callable[[int], int] | None = torch._C._cuda_getCurrentRawStream
except AttributeError:
    _raw_stream = None
