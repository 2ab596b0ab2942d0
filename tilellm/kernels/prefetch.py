"""A decoder layer's later weights into L2 while its short kernels run.

In a decode step of a small batch a layer's linear layers are bound by reading their weights
(`gemv.py`: 4-12 MB each for Qwen3-0.6B), while the kernels between them (the per-head norms,
rotary and the K/V store, paged attention, its split-KV merge) read a few kilobytes and take
several microseconds each: during those the HBM is idle. The rotary launch, the first after the
qkv projection, can ask for the weights the layer reads next (o_proj, gate-up, down_proj) in L2
with asynchronous bulk prefetches (`cp.async.bulk.prefetch.L2`: no register is written and no
kernel waits for them), so that by the time those layers run their weights stream from L2.

The addresses come from a table built once the weights are final (`l2_prefetch_table`): an
int64 [2, chunks] tensor of each chunk's address and byte count, chunks of PREFETCH_CHUNK_BYTES
(a tensor's last chunk shorter). No kernel writes the weights, so the prefetches may go out
before a kernel waits for the one before it (`pdl.py`).

`TILELLM_L2_PREFETCH=1` turns it on for steps of up to L2_PREFETCH_MAX_ROWS tokens on a CUDA
device of compute capability 9.0 or newer (off by default until it is timed in the engine);
`TILELLM_L2_PREFETCH=next` also asks for the next layer's qkv projection in the same launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tilellm.kernels.config import env_flag, interpreting

PREFETCH_CHUNK_BYTES = 16384
# Steps of up to this many tokens prefetch (a small batch's decode; larger steps read each weight
# once for many tokens, and their activations would evict it)
L2_PREFETCH_MAX_ROWS = 16
# Chunks one program's threads ask for in one pass of `prefetch_l2`'s loop
PREFETCH_BLOCK = tl.constexpr(128)

_prefetch_on = env_flag("TILELLM_L2_PREFETCH", "1")
_prefetch_next = env_flag("TILELLM_L2_PREFETCH", "next")


def l2_prefetch_mode(device: torch.device) -> str | None:
    """What layers on `device` prefetch, where the device can (`bulk_prefetch_capable`): "1"
    (`TILELLM_L2_PREFETCH=1`) the weights each layer reads after its attention, "next"
    (`TILELLM_L2_PREFETCH=next`) those and the next layer's qkv projection; None: nothing."""
    mode = "1" if _prefetch_on() else "next" if _prefetch_next() else None
    return mode if mode is not None and bulk_prefetch_capable(device) else None


def l2_prefetch_enabled(device: torch.device) -> bool:
    """Whether layers on `device` prefetch their later weights (`l2_prefetch_mode`)."""
    return l2_prefetch_mode(device) is not None


def bulk_prefetch_capable(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (the bulk prefetch instruction), not
    Triton's interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def check_l2_prefetch_table(table: torch.Tensor | None, device: torch.device) -> None:
    """A table as `l2_prefetch_table` builds it, on `device`, or None."""
    if table is None:
        return
    if (
        not isinstance(table, torch.Tensor)
        or table.dtype != torch.int64
        or table.dim() != 2
        or table.shape[0] != 2
    ):
        got = (
            f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
        )
        raise ValueError(
            f"l2_prefetch: give an int64 [2, chunks] table (prefetch.l2_prefetch_table), got {got}"
        )
    if table.device != device or not table.is_contiguous():
        raise ValueError(f"l2_prefetch: the table must be contiguous on {device}, got {table.device}")


def l2_prefetch_table(tensors: list[torch.Tensor], chunk_bytes: int = PREFETCH_CHUNK_BYTES) -> torch.Tensor:
    """[2, chunks] int64 on the tensors' device: row 0 each chunk's address, row 1 its bytes
    (multiples of 16), over each tensor's storage in order. The tensors must be contiguous, 16-byte
    aligned and stay where they are (a model's weights once loaded)."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(
            f"l2_prefetch_table: chunk_bytes must be a positive multiple of 16, got {chunk_bytes}"
        )
    addrs: list[int] = []
    sizes: list[int] = []
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("l2_prefetch_table: tensors must be contiguous and 16-byte aligned")
        base, nbytes = t.data_ptr(), t.numel() * t.element_size() // 16 * 16
        for offset in range(0, nbytes, chunk_bytes):
            addrs.append(base + offset)
            sizes.append(min(chunk_bytes, nbytes - offset))
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.tensor([addrs, sizes], dtype=torch.int64, device=device).reshape(2, len(addrs))


@triton.jit
def prefetch_l2(TABLE, num_chunks, pid, num_programs, BLOCK: tl.constexpr):
    """Ask for the chunks of TABLE ([2, num_chunks]: addresses, byte counts) in L2, this program's
    share of them (chunk i goes to program (i // BLOCK) % num_programs), one chunk a thread at a
    time. Nothing is written and nothing waits for the data."""
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, num_chunks, num_programs * BLOCK):
        i = start + offs
        ok = i < num_chunks
        addr = tl.load(TABLE + i, mask=ok, other=0)
        size = tl.load(TABLE + num_chunks + i, mask=ok, other=0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [addr, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
