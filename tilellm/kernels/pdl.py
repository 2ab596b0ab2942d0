"""Programmatic dependent launch (PDL): a kernel that starts while the kernel before it finishes.

In a decode step of a small batch every kernel is short (2-9 us) and a good part of each is the
gap between kernels: a kernel starts only once the one before it has finished and its writes are
flushed, and then ramps its loads up. On Hopper a kernel launched with the "programmatic stream
serialization" attribute (Triton's `launch_pdl=True`) may start as soon as every program of the
kernel before it has run `griddepcontrol.launch_dependents` (or finished), and waits where it
must with `griddepcontrol.wait`, which returns once the kernel before has completed and its writes
are visible. Whatever a kernel does before that wait must not read what the kernels before it
write, nor write anything: here, only loads of weights (the GEMVs' whole weight tiles,
`gemv.py` and `fp8_gemv.py`) and L2 prefetches of them (`skinny.py`); `tests/kernels/
test_pdl_order.py` reads each kernel's machine code for it. Each kernel lets the next launch right
after its own wait, so at most the kernel before, this one and the next hold SM slots at a time.
A kernel launched so after one that was not (cuBLAS's, NCCL's, a copy) waits for it as usual.

The kernels that take part are those of a decoder layer's decode path: RMSNorm, rotary, the K/V
store, paged attention and its split-KV merge, SiLU-and-mul, and the few-row linear layers
(`gemv.py`, `fp8_gemv.py`, `skinny.py`). Each launch asks with its row (token) count:

- `TILELLM_PDL=1`: every such launch, and the linear layers of up to `SKINNY_MAX_ROWS` rows run
  `skinny_linear` instead of cuBLAS (a gated MLP's gate-up projection and its SiLU-and-mul as one
  `skinny_linear_silu_and_mul`, the RMSNorm before qkv and gate-up in their launches,
  `skinny_rms_norm_linear`); at eight rows the step is slower than with cuBLAS (docs/benchmarks.md,
  "Programmatic dependent launch");
- `TILELLM_PDL=0`: none;
- unset (or any other value): launches of at most DEFAULT_PDL_ROWS rows, whose linear layers run
  `gemv.py`'s one-row kernels anyway (`gemv.gemv_max_rows`). `TILELLM_PDL_ROWS=N` moves that
  bound to N rows; the linear layers of more than one row keep cuBLAS, whose kernels do not take
  part (the Triton kernels between them do).

`TILELLM_PDL=1 python benchmarks/small_batch_decode.py` against the same command with
`TILELLM_PDL=0` measures it; `--ab TILELLM_PDL_ROWS=N` the bound.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tilellm.kernels.config import env_flag, interpreting

# Launches of at most this many rows take part when TILELLM_PDL is unset (0: none). One: a
# batch-1 decode step (its linear layers are `gemv.py`'s, which load their weight before the
# wait) measured 7% less device time with PDL on an H100 (docs/benchmarks.md, "Programmatic
# dependent launch at one row"); at eight rows the step runs cuBLAS, which does not take part.
DEFAULT_PDL_ROWS = 1


def pdl_enabled(device: torch.device, rows: int | None = None) -> bool:
    """Whether a launch of `rows` rows (tokens) on `device` uses PDL: a CUDA device of compute
    capability 9.0 or newer, not Triton's interpreter, and `TILELLM_PDL=1`, or `TILELLM_PDL`
    unset (or any value but 0 and 1) and 1 to DEFAULT_PDL_ROWS rows (`TILELLM_PDL_ROWS`, where
    set; module docstring). `rows` None: whether every launch does (`TILELLM_PDL=1`)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _pdl_enabled(index):
        return True
    if rows is None or rows <= 0:
        return False
    bound = _rows_bound()
    return rows <= (DEFAULT_PDL_ROWS if bound is None else bound) and not _pdl_off() and _pdl_capable(index)


def pdl_launch_kwargs(device: torch.device, rows: int | None = None) -> dict[str, bool]:
    """The launch keywords of a kernel that takes part, for a launch of `rows` rows: its `USE_PDL`
    constexpr and Triton's `launch_pdl` option, always set together (a kernel launched with PDL
    must wait before it reads; the wait is compiled in only with USE_PDL)."""
    return pdl_flags(pdl_enabled(device, rows))


def pdl_flags(on: bool) -> dict[str, bool]:
    """`USE_PDL` and `launch_pdl`, both `on`: a launch decided before (`pdl_enabled`)."""
    return {"USE_PDL": on, "launch_pdl": on}


_pdl_off = env_flag("TILELLM_PDL", "0")


@functools.cache
def _rows_bound() -> int | None:
    """`TILELLM_PDL_ROWS` as an int, or None where it is unset (then DEFAULT_PDL_ROWS holds);
    cached: tests clear it when they set the variable."""
    value = os.environ.get("TILELLM_PDL_ROWS")
    if value is None or value == "":
        return None
    try:
        bound = int(value)
    except ValueError:
        bound = -1
    if bound < 0:
        raise ValueError(f"TILELLM_PDL_ROWS={value!r}: give a row count >= 0 (0: no launch takes part)")
    return bound


@functools.cache
def _pdl_enabled(index: int) -> bool:
    """`TILELLM_PDL=1` on a device that can (cached: tests clear it when they set the variable)."""
    return os.environ.get("TILELLM_PDL") == "1" and _pdl_capable(index)


def _pdl_capable(index: int) -> bool:
    return not interpreting() and _compute_capability(index) >= 9


@functools.cache
def _compute_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has come here (no-op unless
    USE_PDL)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the kernel before to complete, its writes visible (no-op unless USE_PDL)."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """The prologue of a kernel that reads its inputs at once: wait for the kernel before, then
    let the next kernel launch (no-op unless USE_PDL). In that order: a kernel that let the next
    one launch before its own wait let every later kernel of the chain launch too, each holding
    SM slots while it waited."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
