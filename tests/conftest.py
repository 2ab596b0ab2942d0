"""Test configuration shared by every test module.

The Triton interpreter must be switched on before anything imports triton, and only when
there is no CUDA device: then the same tests run the real kernels on a GPU unchanged.
"""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = _cuda_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _patch_triton_language_once_per_launch() -> None:
    """Under Triton's interpreter, patch `triton.language` once per kernel launch, not again at
    every call of a `@triton.jit` helper inside it.

    A launch (`GridExecutor.__call__`) swaps the language's builtins for interpreted ones, runs
    the grid and restores them. Each helper call inside it (`InterpretedFunction.__call__`: the
    kernels' own helpers, and `tl.sum`, `tl.max`, `tl.zeros`...) re-ran the same patching, which
    walks every member of the language modules, and never restored it: the same state again,
    at every call, about a third of an interpreted kernel's time. Here a helper whose language
    modules are patched already in the running launch skips it; every other call patches as
    before. The kernels run the same interpreted operations: outputs are bit for bit the same.
    If this Triton's interpreter is laid out differently, nothing is changed.
    """
    import threading

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton is a hard dependency
        return
    real_patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if not callable(real_patch) or executor is None:
        return
    grid_call = executor.__call__
    lang_modules = (tl, tl.core)
    langs_of: dict[object, frozenset[int]] = {}  # function -> ids of the language modules it sees
    running = threading.local()  # .launches: per running launch, the modules patched so far

    def langs(fn) -> frozenset[int]:
        got = langs_of.get(fn)
        if got is None:
            got = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in lang_modules))
            langs_of[fn] = got
        return got

    class _NothingToRestore:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        launches = getattr(running, "launches", None)
        if launches and launches[-1] is not None and langs(fn) <= launches[-1]:
            return _NothingToRestore()  # a helper whose modules this launch has patched
        scope = real_patch(fn)
        if launches:  # the launch's own patch, or a helper's (which holds to the launch's end)
            launches[-1] = langs(fn) | (launches[-1] or frozenset())
        return scope

    def call(self, *args, **kwargs):
        if not hasattr(running, "launches"):
            running.launches = []
        running.launches.append(None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.launches.pop()

    interpreter._patch_lang = patch_lang
    executor.__call__ = call


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for `-n auto` (pyproject's addopts): on CPU one per core, at most 4 (each holds
    its own torch and interpreter state); with a GPU none, a plain run (the GPU tests size their
    memory as if they ran alone)."""
    return 0 if HAS_CUDA else max(1, min(4, os.cpu_count() or 1))


if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker of several: its share of the cores
    import torch

    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow test: set TILELLM_SLOW=1 to run")
    # (a model on the CPU with the Triton ops: the kernels' own tests cover them on a GPU)
    skip_interpreter = pytest.mark.skip(reason="Triton on CPU tensors needs the interpreter (no CUDA)")
    run_slow = os.environ.get("TILELLM_SLOW") == "1"
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if HAS_CUDA and "device" in getattr(item, "fixturenames", ()):
            # a test on the `device` fixture runs on the GPU here: `-m gpu` (the GPU script's
            # selection) includes it
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(skip_interpreter)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture
def device() -> str:
    return DEVICE
