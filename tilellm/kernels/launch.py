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

A call site that knows what its launches have in common passes a `key`, and skips the binder
too. The key stands for what selects the binary, tensors aside: the constexprs and launch
options, the device, and the values of the integers the kernel specialises on (Triton asks of
each whether it is 1, a multiple of 16, or needs 64 bits; a kernel's `do_not_specialize`
integers, such as a step's token count, stay out of it, and so does the grid). The first launch
of a key binds as above and remembers the binary, its tensors' dtypes and 16-byte alignments
(Triton's specialisation of a pointer) and the constexprs' values; a later one checks its
tensors' dtypes and alignments and hands the launcher each tensor's address as an integer,
which also spares the launcher a `data_ptr()` call and a driver query per pointer. A call whose
tensors differ in either binds again. The key must fix a TMA descriptor argument's element type,
block shape and layout. Where Triton's launcher has the form of Triton 3.6's, a keyed launch calls
its native launch function directly (`_DirectLaunch`): no scratch allocation in Python, and each
descriptor's tensor map built once per base address and layout instead of on every launch.
Under `TILELLM_DEBUG=1` every keyed launch binds, and one key that stands for two binaries
raises, so a key that misses something fails in tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch
from triton import knobs

from tilellm.kernels.config import debug_enabled


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
        or (_HAS_FPSAN and compilation.fpsan_homomorphic_casts)
        or (_HAS_STAGES_HOOK and runtime.add_stages_inspection_hook is not None)
    )


# (knobs that not every Triton has, looked up once: asking for a missing one on every launch
# costs an exception)
_HAS_FPSAN = hasattr(knobs.compilation, "fpsan_homomorphic_casts")
_HAS_STAGES_HOOK = hasattr(knobs.runtime, "add_stages_inspection_hook")


class LaunchKey(tuple):
    """A launch key that a remembered launch keeps and passes on every launch, its hash computed
    once. A key holds the constexprs' inputs, among them a tile config whose hash is Python code:
    a plain tuple would hash all of it again at every lookup (about 0.3 us, against 0.1). Equal
    to, and hashed as, the plain tuple of its items."""

    def __new__(cls, items: Any) -> LaunchKey:
        key = super().__new__(cls, items)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash


class _Bound(NamedTuple):
    """What a key's launch fixed: the device, the compiled kernel, the tensor arguments'
    positions, dtypes and alignments, and the values of the parameters after the positional ones."""

    device: int
    kernel: Any
    tensor_positions: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    # TMA descriptors, passed to the launcher as they are (it builds each one's tensor map): their
    # positions and types; the key fixes their element type, block shape and layout
    descriptor_positions: tuple[int, ...]
    descriptor_types: tuple[type, ...]
    # per tensor, its bit of `misaligned` where Triton specialises its alignment, else 0
    alignment_bits: tuple[int, ...]
    misaligned: int  # the bits of the tensors not 16-byte aligned
    tail: tuple
    direct: _DirectLaunch | None  # the native launcher, where Triton's Python around it can be skipped


class _DirectLaunch(NamedTuple):
    """Triton 3.6's native launcher of one compiled kernel, called without the Python around it.

    Triton's `CudaLauncher.__call__` allocates the kernel's global and profile scratch (none for
    the kernels here) and, for a kernel that takes TMA descriptors, runs a Python wrapper that
    rebuilds every descriptor's tensor map on every launch (`make_tensordesc_arg`: a driver call
    per descriptor). A tensor map is a pure function of its base address, shape, strides,
    padding and the binary's box, swizzle and element type, so one built before is reused for the
    same fields (`_tensormap_args`); the launcher copies it into the launch's parameters."""

    launch: Callable[..., None]  # the compiled C launcher (`mod.launch`)
    cooperative: bool
    pdl: bool
    # per TMA descriptor argument: (its position, the binary's metadata for it, that metadata as a key)
    descriptors: tuple[tuple[int, Any, tuple], ...]
    make_tensordesc_arg: Callable[[Any, Any], list] | None


class FastLaunch:
    """`FastLaunch(jit_fn)[grid](*args, **kwargs)`: `jit_fn[grid](*args, **kwargs)` with less host work.

    `grid` is a tuple of one to three ints (no callables). The compiled kernels are keyed per
    device by Triton's own specialisation of the arguments plus the launch options, so every call
    runs the binary that `jit_fn[grid]` would run. `run(grid, args, kwargs, key=...)` launches
    by a call site's key (the module docstring says what it must determine).
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self._kernels: dict[tuple, Any] = {}
        self._binders: dict[int, Callable | None] = {}  # None: this kernel takes Triton's path
        self._bound: dict[Hashable, _Bound] = {}  # by a call site's key
        self.fast_launches = 0  # calls that skipped JITFunction.run (tests read it)
        # Fixed when the kernel was decorated: under TRITON_INTERPRET=1 `triton.jit` returns an
        # interpreted function, with no compiled binaries to look up (Triton's path runs it).
        self._compiled = hasattr(fn, "device_caches")

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _slow(self, grid, args, kwargs):
        return self.fn[grid](*args, **kwargs)

    def run(
        self,
        grid: tuple[int, ...],
        args: tuple,
        kwargs: dict | Callable[[], dict],
        key: Hashable | None = None,
    ) -> None:
        """Launch `fn[grid](*args, **kwargs)`. `kwargs` may be a function that returns them:
        a launch by a known `key` does not need them."""
        if key is not None and self._launch_bound(key, grid, args):
            return
        if callable(kwargs):
            kwargs = kwargs()
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
        spec_key = (device, tuple(specialization), tuple(options.items()))
        kernel = self._kernels.get(spec_key)
        if kernel is None:
            kernel = self._slow(grid, args, kwargs)  # compiles, or finds Triton's cached binary
            if kernel is None:
                return
            kernel = self._kernels[spec_key] = getattr(kernel, "result", lambda: kernel)()
        else:
            g0, g1, g2 = _grid3(grid)
            kernel.run(g0, g1, g2, current_stream(device), kernel.function, kernel.packed_metadata, None, None, None,
                       *bound_args.values())  # fmt: skip
            self.fast_launches += 1
        if key is not None:
            if self._bound.get(key) is not _UNBOUND:
                self._bind(key, device, kernel, args, tuple(bound_args.values())[len(args) :])

    def _bind(self, key: Hashable, device: int, kernel: Any, args: tuple, tail: tuple) -> None:
        """Remember `key`'s binary for later launches, if its arguments allow the keyed path:
        tensors on `device` and plain scalars, and nothing but constexprs after them (the
        remembered tail is not passed again). Otherwise every launch of the key binds (`_UNBOUND`)."""
        params = getattr(self.fn, "params", None)
        if params is None or not all(p.is_constexpr for p in params[len(args) :]):
            self._bound[key] = _UNBOUND
            return
        tensor_positions, alignment_bits, misaligned, descriptor_positions = [], [], 0, []
        for i, a in enumerate(args):
            if type(a) in _TENSOR_TYPES:
                if a.device.type != "cuda" or a.device.index != device:
                    self._bound[key] = _UNBOUND
                    return
                p = params[i]
                specialised = not (p.do_not_specialize or getattr(p, "do_not_specialize_on_alignment", False))
                bit = 1 << len(tensor_positions) if specialised else 0
                tensor_positions.append(i)
                alignment_bits.append(bit)
                if a.data_ptr() & 15:
                    misaligned |= bit
            elif _is_descriptor(a):
                descriptor_positions.append(i)
            elif not (a is None or type(a) in (int, float, bool)):
                self._bound[key] = _UNBOUND  # another object the binder reads
                return
        dtypes = tuple(args[i].dtype for i in tensor_positions)
        bound = _Bound(
            device, kernel, tuple(tensor_positions), dtypes, tuple(descriptor_positions),
            tuple(type(args[i]) for i in descriptor_positions), tuple(alignment_bits), misaligned, tail,
            _direct_launch(kernel, tuple(descriptor_positions)),
        )  # fmt: skip
        earlier = self._bound.get(key)
        # (tensors of other dtypes under the same key are another binary: each launch checks them)
        if earlier is not None and earlier is not _UNBOUND and debug_enabled():
            if earlier._replace(kernel=kernel, tail=tail, direct=bound.direct) == bound != earlier:
                raise RuntimeError(
                    f"FastLaunch({getattr(self.fn, '__name__', self.fn)}): the launch key {key!r} stands for "
                    "two binaries (or constexprs): the call site's key misses something"
                )
        if len(self._bound) >= _MAX_BOUND_KEYS:
            self._bound.clear()
        self._bound[key] = bound

    def _launch_bound(self, key: Hashable, grid: tuple[int, ...], args: tuple) -> bool:
        """Launch by `key`'s bound binary; False (nothing launched) when the call must bind."""
        bound = self._bound.get(key)
        if bound is None or bound is _UNBOUND or debug_enabled() or not _default_settings():
            return False
        device = _current_device()
        if device != bound.device:
            return False
        values = list(args)
        misaligned = 0
        for i, dtype, bit in zip(bound.tensor_positions, bound.dtypes, bound.alignment_bits):
            tensor = values[i]
            if type(tensor) not in _TENSOR_TYPES or tensor.dtype is not dtype:
                return False  # another binary
            values[i] = address = tensor.data_ptr()
            if address & 15:
                misaligned |= bit
        if misaligned != bound.misaligned:
            return False  # another alignment: another binary
        for i, kind in zip(bound.descriptor_positions, bound.descriptor_types):
            if type(values[i]) is not kind:
                return False
        kernel, direct = bound.kernel, bound.direct
        if direct is None:
            kernel.run(*_grid3(grid), current_stream(device), kernel.function, kernel.packed_metadata, None, None,
                       None, *values, *bound.tail)  # fmt: skip
        else:
            for i, meta, meta_key in reversed(direct.descriptors):  # (each expands to several arguments)
                values[i : i + 1] = _tensormap_args(values[i], meta, meta_key, direct.make_tensordesc_arg)
            g0, g1, g2 = _grid3(grid)
            direct.launch(g0, g1, g2, current_stream(device), kernel.function, direct.cooperative, direct.pdl,
                          None, None, kernel.packed_metadata, None, None, None, *values, *bound.tail)  # fmt: skip
        self.fast_launches += 1
        return True

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


def _direct_launch(kernel: Any, descriptor_positions: tuple[int, ...]) -> _DirectLaunch | None:
    """`kernel`'s native launcher, where this Triton's launcher has the form `_DirectLaunch`
    relies on (Triton 3.6's `CudaLauncher`: the native launch function, or the TMA-descriptor
    wrapper around it, as `launch`; scratch sizes; a `__call__(grid, stream, function, *args)`)
    and the kernel needs no scratch; else None (launches go through `kernel.run`)."""
    runner = getattr(kernel, "run", None)
    code = getattr(vars(type(runner)).get("__call__"), "__code__", None)
    if (
        type(runner).__name__ != "CudaLauncher"
        or code is None
        or code.co_varnames[: code.co_argcount] != ("self", "gridX", "gridY", "gridZ", "stream", "function")
        or not code.co_flags & inspect.CO_VARARGS
        or getattr(runner, "global_scratch_size", 1) != 0
        or getattr(runner, "profile_scratch_size", 1) != 0
    ):
        return None
    launch = getattr(runner, "launch", None)
    cooperative, pdl = bool(runner.launch_cooperative_grid), bool(runner.launch_pdl)
    if not descriptor_positions:
        return _DirectLaunch(launch, cooperative, pdl, (), None) if inspect.isbuiltin(launch) else None
    # the descriptor wrapper (`wrap_handle_tensordesc`'s `inner`): its native launcher, which
    # arguments are descriptors, their metadata, and the function that expands one
    cells = dict(zip(getattr(getattr(launch, "__code__", None), "co_freevars", ()), launch.__closure__ or ()))
    if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
        return None
    native = cells["launcher"].cell_contents
    indices, metas = sorted(cells["tensordesc_indices"].cell_contents), cells["tensordesc_meta"].cell_contents
    make_arg = launch.__globals__.get("make_tensordesc_arg")
    if not inspect.isbuiltin(native) or tuple(indices) != descriptor_positions or make_arg is None:
        return None
    descriptors = tuple((i, meta, _meta_key(meta)) for i, meta in zip(indices, metas))
    return _DirectLaunch(native, cooperative, pdl, descriptors, make_arg)


def _meta_key(meta: Any) -> tuple | None:
    """A descriptor's binary metadata (swizzle, element size and type, box) as a key, or None
    (its tensor map is then built on every launch)."""
    if not isinstance(meta, dict):
        return None
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in meta.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _tensormap_args(
    desc: Any, meta: Any, meta_key: tuple | None, make_arg: Callable[[Any, Any], list]
) -> list:
    """The launcher's arguments for one TMA descriptor (its tensor map, shape and strides), built
    by Triton's `make_tensordesc_arg` once per base address, shape, strides, padding and binary
    metadata; without metadata (the descriptor passed as its base tensor) built every time."""
    if meta_key is None:
        return make_arg(desc, meta)
    shape, strides = desc.shape, desc.strides  # (tuples where built from a tensor, as here)
    if type(shape) is list or type(strides) is list:
        shape, strides = tuple(shape), tuple(strides)
    key = (meta_key, desc.base.data_ptr(), shape, strides, desc.padding)
    expanded = _TENSORMAPS.get(key)
    if expanded is None:
        expanded = make_arg(desc, meta)
        if len(_TENSORMAPS) >= _MAX_BOUND_KEYS:
            _TENSORMAPS.clear()
        _TENSORMAPS[key] = expanded
    return expanded


# built tensor maps (with their shape and strides) by base address, layout and binary metadata
_TENSORMAPS: dict[tuple, list] = {}
_MAX_BOUND_KEYS = 4096  # a call site's keys are shapes: past this many, start again
_UNBOUND: Any = object()  # a key whose launches always bind
# Tensors whose `data_ptr()` is their device address (a layer's weights are Parameters); other
# subclasses bind on every launch.
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def tma_descriptor(
    cls: type,
    base: torch.Tensor,
    block_shape: list[int],
    layout: Any = None,
    view: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """`cls.from_tensor(base, block_shape[, layout])`: a host-side TMA descriptor (Triton's
    `TensorDescriptor`, or Gluon's with its shared-memory layout) over `base`, or over
    `view(base)` (such as a [T, H, D] tensor's [T, H * D] rows).

    The descriptor dataclasses check their fields when built (rank, alignment of the address and
    strides, block shape: about 5 us of host time). A base whose shape, strides and dtype passed
    those checks before with the same block, layout and view passes them again, provided its
    address is 16-byte aligned: its descriptor is built from the remembered fields without them,
    and without building the view (the descriptor keeps `base`: the launcher reads its address,
    and the shape and strides from the fields). A view that copied (not of base's own memory) is
    built every time."""
    return _descriptor(cls, base, block_shape, layout, view)[0]


def _descriptor(cls, base, block_shape, layout, view) -> tuple[Any, dict | None]:
    """`tma_descriptor`'s descriptor, and the checked fields of base's layout (None for a view
    that copies)."""
    checked = (cls, base.shape, base.stride(), base.dtype, tuple(block_shape), layout, view)
    fields = _DESCRIPTOR_FIELDS.get(checked)
    if fields is None or base.data_ptr() % 16:
        spanned = base if view is None else view(base)
        desc = (
            cls.from_tensor(spanned, block_shape)
            if layout is None
            else cls.from_tensor(spanned, block_shape, layout)
        )
        if spanned.data_ptr() != base.data_ptr():
            return desc, None
        if len(_DESCRIPTOR_FIELDS) >= _MAX_BOUND_KEYS:
            _DESCRIPTOR_FIELDS.clear()
        fields = _DESCRIPTOR_FIELDS[checked] = {
            name: value for name, value in vars(desc).items() if name != "base"
        }
        return desc, fields
    return _from_fields(cls, fields, base), fields


class DescriptorTemplate:
    """`tma_descriptor(cls, ·, block_shape, layout, view)` for tensors of one layout (shape,
    strides, dtype) that the caller has already matched, such as a call remembered by its layout:
    `over(base)` builds the descriptor from the checked fields without looking them up again,
    provided base is 16-byte aligned (else, until the layout has passed the checks once, for a
    view that copies, and under TILELLM_DEBUG=1, it is `tma_descriptor`'s). A base of another
    layout would get the first one's shape and strides: the caller must not pass one."""

    __slots__ = ("cls", "block_shape", "layout", "view", "fields")

    def __init__(self, cls: type, block_shape: list[int], layout: Any = None, view: Callable | None = None):
        self.cls, self.block_shape, self.layout, self.view = cls, block_shape, layout, view
        self.fields: dict | None = None  # the checked fields, once known

    def over(self, base: torch.Tensor) -> Any:
        """The descriptor over `base` (a tensor of the template's layout)."""
        if self.fields is not None and not base.data_ptr() & 15 and not debug_enabled():
            return _from_fields(self.cls, self.fields, base)
        desc, self.fields = _descriptor(self.cls, base, self.block_shape, self.layout, self.view)
        return desc


def _from_fields(cls: type, fields: dict, base: torch.Tensor) -> Any:
    """A descriptor of checked `fields` over `base` (the dataclass's checks not run again)."""
    desc = object.__new__(cls)
    vars(desc).update(fields, base=base)
    return desc


# the fields (all but the base tensor, which they must not keep alive) of checked descriptors
_DESCRIPTOR_FIELDS: dict[tuple, dict] = {}


def _is_descriptor(a: Any) -> bool:
    """A host-side TMA descriptor (Triton's `TensorDescriptor` or Gluon's)."""
    return type(a).__name__ == "TensorDescriptor" and hasattr(a, "block_shape") and hasattr(a, "base")


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def current_stream(device: int) -> int:
    """The raw handle of `device`'s current CUDA stream (what the launcher takes)."""
    return torch.cuda.current_stream(device).cuda_stream if _raw_stream is None else _raw_stream(device)


# The current CUDA device without `torch.cuda.current_device()`'s lazy-init check (a bound key's
# launch comes after CUDA's start)
_current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device

try:  # the raw handle of the current stream without a Stream object (what Triton's driver calls)
    _raw_stream: Callable[[int], int] | None = torch._C._cuda_getCurrentRawStream
except AttributeError:
    _raw_stream = None
