"""Ask for a tensor's bytes in L2 without reading them: `prefetch_l2(t)`.

A decode step of a small batch is a chain of short kernels, and each linear layer in it reads its
whole weight for almost no arithmetic. Started cold, such a kernel spends much of its few
microseconds ramping its loads up: Qwen3-0.6B's one-row GEMMs take 5.7 us a call on an H100 where
their 4-13 MB of weight take 1.3-4.2 us at the copy rate (docs/benchmarks.md). If the weight is
already in L2 when the GEMM starts, it reads at L2's rate instead.

Each thread of this kernel issues one `cp.async.bulk.prefetch.L2` (Hopper's bulk copy engine: a
hint that fetches a range of global memory into L2 and writes no register) for CHUNK bytes of the
tensor, so a program covers PER_PROGRAM * CHUNK bytes and finishes as soon as its requests are
issued; the bytes arrive while later kernels run. Nothing is read back and nothing is written:
a prefetch that is dropped or evicted costs only bandwidth, never a wrong result.

On a GPU older than Hopper, under Triton's interpreter, or for a CPU tensor, it does nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import cdiv, interpreting

CHUNK_BYTES = 4096  # bytes one prefetch asks for (a multiple of 16, as the instruction requires)
PER_PROGRAM = 128  # prefetches a program issues: one per thread of its four warps


@triton.jit
def _prefetch_l2_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * (PER_PROGRAM * CHUNK) + tl.arange(0, PER_PROGRAM).to(tl.int64) * CHUNK
    ok = (offs < nbytes).to(tl.int32)
    # the last chunk is shorter; nbytes is a multiple of 16 (see prefetch_l2), so is every size
    size = tl.maximum(tl.minimum(nbytes - offs, CHUNK), 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [ptr + offs, size, ok],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch_supported(device: torch.device) -> bool:
    """Whether `prefetch_l2` issues anything for tensors on `device`: a CUDA device of compute
    capability 9.0 or newer (the bulk prefetch is Hopper's), not under the interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_l2(t: torch.Tensor) -> None:
    """Ask for the bytes of `t` (contiguous) in L2, on the current stream; returns at once.

    Bytes past the last multiple of 16 are not asked for. A no-op where `prefetch_supported` is
    false or `t` is empty."""
    if not prefetch_supported(t.device):
        return
    if not t.is_contiguous():
        raise ValueError("prefetch_l2 needs a contiguous tensor")
    nbytes = (t.numel() * t.element_size()) // 16 * 16
    if nbytes == 0:
        return
    if t.data_ptr() % 16:
        raise ValueError("prefetch_l2 needs a 16-byte aligned tensor")
    flat = t.view(-1).view(torch.uint8)
    grid = (cdiv(nbytes, PER_PROGRAM * CHUNK_BYTES),)
    _prefetch_l2_kernel[grid](flat, nbytes, CHUNK=CHUNK_BYTES, PER_PROGRAM=PER_PROGRAM, num_warps=4)
