"""`FastLaunch`: the same compiled kernel as `kernel[grid](...)`, with less host work.

The fast path must never launch a binary specialised for other arguments: a misaligned pointer,
an integer that becomes 1 or a multiple of 16, a new dtype or constexpr each get the kernel that
Triton itself would run. On the CPU the interpreter runs every launch (the slow path).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tests.conftest import DEVICE, HAS_CUDA
from tilellm.kernels.launch import DescriptorTemplate, FastLaunch, LaunchKey, tma_descriptor


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, stride_x, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride_x, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    r = alpha * x + y
    if NEGATE:
        r = -r
    tl.store(out_ptr + offs, r, mask=mask)


_axpy_launch = FastLaunch(_axpy_kernel)


def _axpy(x: torch.Tensor, y: torch.Tensor, alpha: float, *, negate: bool = False, block: int = 64):
    n = y.numel()
    out = torch.empty_like(y)
    stride = x.stride(0)
    _axpy_launch[(triton.cdiv(n, block),)](x, y, out, n, alpha, stride, BLOCK=block, NEGATE=negate)
    return out


def _axpy_keyed(
    x: torch.Tensor, y: torch.Tensor, alpha: float, *, negate: bool = False, block: int = 64, key=None
):
    """`_axpy` launched by a key (or `key`): the device, the constexprs and the scalars, which the
    kernel all specialises on."""
    n = y.numel()
    out = torch.empty_like(y)
    scalars = (n, alpha, x.stride(0))
    consts = (x.device, block, negate)
    _axpy_launch.run(
        (triton.cdiv(n, block),),
        (x, y, out, *scalars),
        lambda: dict(BLOCK=block, NEGATE=negate),
        key=(consts, scalars) if key is None else key,
    )
    return out


def _expected(x, y, alpha, negate=False):
    r = alpha * x + y
    return -r if negate else r


@pytest.mark.parametrize("axpy", [_axpy, _axpy_keyed], ids=["fast", "keyed"])
def test_launch_matches_the_kernel(axpy):
    torch.manual_seed(0)
    for n in (1, 16, 17, 100):
        x = torch.randn(n, device=DEVICE)
        y = torch.randn(n, device=DEVICE)
        for negate in (False, True):
            for _ in range(2):  # the first call binds, the second launches by the binding
                torch.testing.assert_close(axpy(x, y, 0.5, negate=negate), _expected(x, y, 0.5, negate))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the fast path runs compiled kernels only")
def test_keyed_launch_takes_new_tensors_and_binds_what_it_cannot_take(monkeypatch):
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    torch.manual_seed(0)
    base = torch.randn(4096 + 64, device=DEVICE)
    y = torch.randn(4096, device=DEVICE)
    _axpy_keyed(base[:4096], y, 2.0)  # binds the key
    before = _axpy_launch.fast_launches
    for _ in range(3):  # new tensors each time (new addresses), the same key
        x2, y2 = torch.randn(4096, device=DEVICE), torch.randn(4096, device=DEVICE)
        torch.testing.assert_close(_axpy_keyed(x2, y2, 2.0), _expected(x2, y2, 2.0))
    assert _axpy_launch.fast_launches == before + 3
    # a Parameter (a layer's weight) is a tensor to the keyed path too
    w = torch.nn.Parameter(torch.randn(4096, device=DEVICE), requires_grad=False)
    torch.testing.assert_close(_axpy_keyed(w, y, 2.0), _expected(w, y, 2.0))
    assert _axpy_launch.fast_launches == before + 4
    # a misaligned tensor under the same key: Triton's specialisation for it, through the binder,
    # then by the key again (bound to that alignment)
    for _ in range(2):
        torch.testing.assert_close(_axpy_keyed(base[1:4097], y, 2.0), _expected(base[1:4097], y, 2.0))
    before = _axpy_launch.fast_launches
    torch.testing.assert_close(_axpy_keyed(base[1:4097], y, 2.0), _expected(base[1:4097], y, 2.0))
    assert _axpy_launch.fast_launches == before + 1
    # and aligned tensors again, and another dtype: each its own binary
    torch.testing.assert_close(_axpy_keyed(base[:4096], y, 2.0), _expected(base[:4096], y, 2.0))
    xd, yd = base[:4096].double(), y.double()
    torch.testing.assert_close(_axpy_keyed(xd, yd, 2.0), _expected(xd, yd, 2.0))


@triton.jit
def _copy_rows_kernel(desc, out_ptr, BLOCK: tl.constexpr, COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tile = desc.load([tl.program_id(0) * BLOCK, 0])
    tl.store(out_ptr + rows[:, None] * COLS + tl.arange(0, COLS)[None, :], tile)


_copy_rows_launch = FastLaunch(_copy_rows_kernel)


def _copy_rows(x: torch.Tensor, block: int, key=None) -> torch.Tensor:
    """x [R, C] copied through a TMA descriptor of [block, C] boxes, launched by a key."""
    out = torch.empty_like(x)
    desc = tma_descriptor(TensorDescriptor, x, [block, x.shape[1]])
    _copy_rows_launch.run(
        (x.shape[0] // block,),
        (desc, out),
        lambda: dict(BLOCK=block, COLS=x.shape[1]),
        key=(x.device, x.dtype, block, x.shape[1]) if key is None else key,
    )
    return out


@pytest.mark.gpu
@pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9, reason="TMA descriptors need an sm_90 GPU"
)
def test_keyed_launch_passes_tma_descriptors(monkeypatch):
    """A kernel that takes a TMA descriptor launches by its key too (the launcher builds the
    descriptor's tensor map), with new tensors each time; under TILELLM_DEBUG=1 a key that
    misses the block shape raises."""
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    x = torch.randn(256, 64, device=DEVICE)
    torch.testing.assert_close(_copy_rows(x, 32), x)  # binds the key
    before = _copy_rows_launch.fast_launches
    for _ in range(3):
        x = torch.randn(256, 64, device=DEVICE)
        torch.testing.assert_close(_copy_rows(x, 32), x)
    assert _copy_rows_launch.fast_launches == before + 3
    monkeypatch.setenv("TILELLM_DEBUG", "1")
    torch.testing.assert_close(_copy_rows(x, 32, key="same"), x)
    with pytest.raises(RuntimeError, match="misses something"):
        _copy_rows(x, 64, key="same")


@pytest.mark.gpu
@pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9, reason="TMA descriptors need an sm_90 GPU"
)
def test_keyed_tma_launch_reuses_a_tensor_map_only_for_its_own_address_and_layout(monkeypatch):
    """Where Triton's native launcher is called directly (Triton 3.6), a descriptor's tensor map
    is built once per base address and layout: new contents at the same address, a view at the
    same address with fewer rows, a view at another address and new tensors all copy right, and
    repeated launches of one layout build no new map."""
    from tilellm.kernels import launch

    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    monkeypatch.setattr(launch, "_TENSORMAPS", {})  # (no map of an earlier test at a reused address)
    key = ("tensor maps", DEVICE)
    x = torch.randn(256, 64, device=DEVICE)
    torch.testing.assert_close(_copy_rows(x, 32, key=key), x)  # binds the key
    direct = _copy_rows_launch._bound[key].direct
    if triton.__version__.startswith("3.6."):
        assert direct is not None and [i for i, *_ in direct.descriptors] == [0]
    torch.testing.assert_close(_copy_rows(x, 32, key=key), x)
    maps = len(launch._TENSORMAPS)
    assert maps == (1 if direct is not None else 0)
    for _ in range(3):
        torch.testing.assert_close(_copy_rows(x, 32, key=key), x)
    x.copy_(torch.randn_like(x))  # the same address and layout, new contents
    torch.testing.assert_close(_copy_rows(x, 32, key=key), x)
    assert len(launch._TENSORMAPS) == maps
    for rows in (x[:128], x[64:192], torch.randn(512, 64, device=DEVICE)):
        for _ in range(2):
            torch.testing.assert_close(_copy_rows(rows, 32, key=key), rows)
    if direct is not None:
        assert len(launch._TENSORMAPS) == maps + 3


class CudaLauncher:
    """The shape of Triton 3.6's launcher object (`triton.backends.nvidia.driver.CudaLauncher`),
    around a stand-in for its native launch function."""

    def __init__(self, launch, scratch: int = 0):
        self.launch = launch
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, False, True, None, None, *args)


class _Kernel:
    def __init__(self, runner):
        self.run = runner


def make_tensordesc_arg(arg, metadata):  # (its name: what the wrapper's globals are searched for)
    make_tensordesc_arg.calls += 1
    return [("map", arg.base.data_ptr(), tuple(arg.shape)), *arg.shape, *arg.strides]


make_tensordesc_arg.calls = 0


def _descriptor_wrapper(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.6's `wrap_handle_tensordesc` wrapper: a closure over these three names."""

    def inner(*args):
        final_args = list(args[:13])
        for i, arg in enumerate(args[13:]):
            final_args.extend(
                make_tensordesc_arg(arg, tensordesc_meta[0]) if i in tensordesc_indices else [arg]
            )
        return launcher(*final_args)

    return inner


def test_native_launcher_is_found_only_in_triton_3_6s_form():
    """`_direct_launch` takes the native launch function out of a launcher of Triton 3.6's form
    (with or without the descriptor wrapper) and gives up on anything else: another `__call__`,
    a kernel that needs scratch, descriptors at other positions, a launch that is not native."""
    from tilellm.kernels.launch import _direct_launch

    native = len  # any built-in function stands in for the compiled `mod.launch`
    direct = _direct_launch(_Kernel(CudaLauncher(native)), ())
    assert (
        direct is not None and direct.launch is native and (direct.cooperative, direct.pdl) == (False, True)
    )
    assert _direct_launch(_Kernel(CudaLauncher(native, scratch=64)), ()) is None
    assert _direct_launch(_Kernel(CudaLauncher(lambda *a: None)), ()) is None  # not native
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [64, 64], "fp4_padded": False}
    wrapped = _Kernel(CudaLauncher(_descriptor_wrapper(native, {0}, [meta])))
    direct = _direct_launch(wrapped, (0,))
    assert (
        direct is not None and direct.launch is native and direct.make_tensordesc_arg is make_tensordesc_arg
    )
    assert [(i, key) for i, _, key in direct.descriptors] == [
        (
            0,
            (
                ("block_size", (64, 64)),
                ("elem_size", 2),
                ("elem_type", 6),
                ("fp4_padded", False),
                ("swizzle", 3),
            ),
        )
    ]
    assert _direct_launch(wrapped, (1,)) is None  # the descriptors the launcher expands are others

    class OtherLauncher(CudaLauncher):  # another release's call signature
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):
            pass

    assert _direct_launch(_Kernel(OtherLauncher(native)), ()) is None


def test_tensor_maps_are_reused_for_the_same_address_and_layout_only(monkeypatch):
    from tilellm.kernels import launch

    monkeypatch.setattr(launch, "_TENSORMAPS", {})
    make_tensordesc_arg.calls = 0
    meta_key = (("block_size", (2, 64)),)
    x = torch.zeros(8, 64)
    desc = tma_descriptor(TensorDescriptor, x, [2, 64])
    first = launch._tensormap_args(desc, {}, meta_key, make_tensordesc_arg)
    assert (
        launch._tensormap_args(
            tma_descriptor(TensorDescriptor, x, [2, 64]), {}, meta_key, make_tensordesc_arg
        )
        is first
    )
    assert make_tensordesc_arg.calls == 1
    for other in (x[:4], x[2:6], torch.zeros(8, 64)):  # another shape, another address, another tensor
        again = launch._tensormap_args(
            tma_descriptor(TensorDescriptor, other, [2, 64]), {}, meta_key, make_tensordesc_arg
        )
        assert again[0] == ("map", other.data_ptr(), tuple(other.shape))
    assert make_tensordesc_arg.calls == 4
    launch._tensormap_args(desc, {}, (("block_size", (4, 64)),), make_tensordesc_arg)  # another binary's box
    assert make_tensordesc_arg.calls == 5
    launch._tensormap_args(desc, None, None, make_tensordesc_arg)  # no metadata: built every time
    launch._tensormap_args(desc, None, None, make_tensordesc_arg)
    assert make_tensordesc_arg.calls == 7


def test_descriptors_of_a_checked_layout_skip_the_checks():
    """`tma_descriptor` builds a descriptor equal to `from_tensor`'s; once a layout passed the
    dataclass's checks, its next descriptors are built without them, but a misaligned base still
    goes through them (and fails as `from_tensor` does)."""
    base = torch.zeros(4 * 64 + 4)
    x = base[:256].view(4, 64)
    first = tma_descriptor(TensorDescriptor, x, [2, 64])
    assert vars(first) == vars(TensorDescriptor.from_tensor(x, [2, 64]))
    y = torch.ones(4, 64)
    again = tma_descriptor(TensorDescriptor, y, [2, 64])
    assert again.base is y and vars(again) == vars(TensorDescriptor.from_tensor(y, [2, 64]))
    with pytest.raises(AssertionError, match="16-byte aligned"):
        tma_descriptor(TensorDescriptor, base[1:257].view(4, 64), [2, 64])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [T, H * D]: a view of packed heads, else a packed copy (as prefill.rows_view)."""
    return x.reshape(x.shape[0], -1)


def test_descriptors_over_a_view_of_a_checked_layout_keep_the_base():
    """With `view`, a layout seen before (its view of its own memory, 16-byte aligned) gets the
    checked descriptor's fields with the base itself, not the view; a view that copies, and a
    misaligned base, are built and checked every time."""
    block = [16, 32]
    x = torch.randn(40, 4, 32)
    first = tma_descriptor(TensorDescriptor, x, block, view=_rows)
    assert first.base is not x and vars(first) == vars(TensorDescriptor.from_tensor(_rows(x), block)) | {
        "base": first.base
    }
    y = torch.randn(40, 4, 32)  # another tensor of the same layout
    again = tma_descriptor(TensorDescriptor, y, block, view=_rows)
    assert again.base is y
    assert {n: v for n, v in vars(again).items() if n != "base"} == {
        n: v for n, v in vars(first).items() if n != "base"
    }
    assert (list(again.shape), list(again.strides)) == ([40, 128], [128, 1])
    # heads not packed (the first 32 columns of every 64): the view copies, never remembered
    wide = torch.randn(40, 4, 64)[:, :, :32]
    for _ in range(2):
        desc = tma_descriptor(TensorDescriptor, wide, block, view=_rows)
        assert desc.base.data_ptr() != wide.data_ptr() and torch.equal(desc.base, _rows(wide))
    # a base off the 16-byte grid after its layout was remembered: checked again, and refused
    storage = torch.randn(40 * 128 + 1)
    tma_descriptor(TensorDescriptor, storage[: 40 * 128].view(40, 4, 32), block, view=_rows)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        tma_descriptor(TensorDescriptor, storage[1:].view(40, 4, 32), block, view=_rows)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the fast path runs compiled kernels only")
def test_a_key_that_misses_a_constexpr_fails_under_debug(monkeypatch):
    x = torch.randn(256, device=DEVICE)
    y = torch.randn(256, device=DEVICE)
    monkeypatch.setenv("TILELLM_DEBUG", "1")
    torch.testing.assert_close(_axpy_keyed(x, y, 1.0, key="same"), _expected(x, y, 1.0))
    with pytest.raises(RuntimeError, match="misses something"):
        _axpy_keyed(x, y, 1.0, negate=True, key="same")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the fast path runs compiled kernels only")
def test_fast_path_is_taken_and_respects_every_specialisation():
    torch.manual_seed(0)
    base = torch.randn(4096 + 64, device=DEVICE)
    y = torch.randn(4096, device=DEVICE)
    _axpy(base[:4096], y, 2.0)  # the first call takes Triton's path and records the binary
    before = _axpy_launch.fast_launches
    torch.testing.assert_close(_axpy(base[:4096], y, 2.0), _expected(base[:4096], y, 2.0))
    assert _axpy_launch.fast_launches == before + 1
    # Inputs Triton specialises differently: each result must still be right, the first call of
    # each new specialisation through Triton's path, the second through the fast one.
    cases = [
        (base[1:4097], y),  # a pointer not 16-byte aligned
        (base[:1], y[:1]),  # n == 1
        (base[:17], y[:17]),  # n not a multiple of 16
        (base[::2][:2048], y[:2048]),  # stride 2
        (base[:4096].double(), y.double()),  # another dtype
    ]
    for x, yy in cases:
        for _ in range(2):
            torch.testing.assert_close(_axpy(x, yy, -1.5), _expected(x, yy, -1.5))
        torch.testing.assert_close(_axpy(x, yy, -1.5, block=128), _expected(x, yy, -1.5))
    for negate in (True, False):
        for _ in range(2):
            got = _axpy(base[:4096], y, 3.0, negate=negate)
            torch.testing.assert_close(got, _expected(base[:4096], y, 3.0, negate))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the fast path runs compiled kernels only")
def test_launch_hooks_take_tritons_path():
    from triton import knobs

    x = torch.randn(64, device=DEVICE)
    y = torch.randn(64, device=DEVICE)
    _axpy(x, y, 1.0)
    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        before = _axpy_launch.fast_launches
        torch.testing.assert_close(_axpy(x, y, 1.0), _expected(x, y, 1.0))
        assert _axpy_launch.fast_launches == before
        assert seen, "a profiler's launch hook must see every launch"
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_fast_launch_is_captured_in_a_cuda_graph():
    x = torch.randn(256, device=DEVICE)
    y = torch.randn(256, device=DEVICE)
    out = _axpy(x, y, 1.0)
    out = _axpy(x, y, 1.0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = _axpy(x, y, 1.0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _expected(x, y, 1.0))


def test_descriptor_template_builds_from_the_checked_fields():
    """`DescriptorTemplate.over` gives `tma_descriptor`'s descriptors: once its layout passed the
    checks, new tensors of that layout get the checked fields with the tensor itself as the base;
    a misaligned base is checked again and refused; a view that copies is built every time and
    never gives the template fields."""
    block = [16, 32]
    template = DescriptorTemplate(TensorDescriptor, block, view=_rows)
    x = torch.randn(40, 4, 32)
    first = template.over(x)
    assert template.fields is not None
    assert vars(first) == vars(TensorDescriptor.from_tensor(_rows(x), block)) | {"base": first.base}
    y = torch.randn(40, 4, 32)
    again = template.over(y)
    assert again.base is y
    assert {n: v for n, v in vars(again).items() if n != "base"} == template.fields
    storage = torch.randn(40 * 128 + 1)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        template.over(storage[1:].view(40, 4, 32))
    copying = DescriptorTemplate(TensorDescriptor, block, view=_rows)
    wide = torch.randn(40, 4, 64)[:, :, :32]  # heads not packed: the view copies
    for _ in range(2):
        desc = copying.over(wide)
        assert desc.base.data_ptr() != wide.data_ptr() and torch.equal(desc.base, _rows(wide))
        assert copying.fields is None


def test_launch_key_is_its_tuple():
    """A `LaunchKey` equals, and hashes as, the plain tuple of its items (either finds the other's
    entry in `FastLaunch`'s table)."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Tiles:
        block_m: int
        block_n: int

    items = ((torch.device("cpu"), torch.bfloat16, Tiles(16, 64), True), (32, 4096, 128))
    key = LaunchKey(items)
    assert key == items and hash(key) == hash(items) and isinstance(key, tuple)
    assert {items: "plain"}[key] == "plain" and {key: "kept"}[items] == "kept"
    assert LaunchKey(items) == key and LaunchKey(((1,), (2,))) != key
