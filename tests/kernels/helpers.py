"""Shared builders and comparisons for the attention-kernel tests.

Inputs are random normal (never zeros or tiny ranges) from seeded generators, and every cache
block a request does not use still holds random data, so a kernel that reads past a request's
end, through an unused block-table entry or into another request's blocks gets a wrong answer.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch


def tolerance(dtype: torch.dtype, device: str) -> float:
    """The kernels' contract: max abs error relative to the output scale."""
    if dtype == torch.float32:
        return 2e-3 if device == "cuda" else 1e-4
    return 2e-2


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """max |actual - expected| <= tol * max(max |expected|, 1) over finite expected values.

    Where `expected` is finite, `actual` must be finite (a NaN marks an output the kernel never
    wrote, or one it computed wrongly); where `expected` is +-inf, `actual` must equal it.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.double().cpu(), expected.double().cpu()
    finite = torch.isfinite(e)
    bad = finite & ~torch.isfinite(a)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} non-finite elements (first at index {tuple(bad.nonzero()[0].tolist())}): "
        "an output the kernel never wrote, or a NaN it produced"
    )
    bad = ~finite & ~torch.isnan(e) & (a != e)
    assert not bool(bad.any()), (
        f"{what}: expected an infinity at {tuple(bad.nonzero()[0].tolist())}, got {float(a[bad][0])}"
    )
    if not bool(finite.any()):
        return
    scale = max(float(e[finite].abs().max()), 1.0)
    err = torch.where(finite, (a - e).abs(), 0.0)
    worst = float(err.max())
    where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    assert worst <= tol * scale, (
        f"{what}: max abs error {worst:.3g} at {where} exceeds {tol:g} x output scale {scale:.3g} "
        f"(got {float(a[where]):.6g}, expected {float(e[where]):.6g})"
    )


def cu_seqlens(lengths, device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows up."""
    return torch.full_like(like, float("nan"))


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_seqlen_q: int
    pairs: list[tuple[int, int]]

    def args(self):
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.cu_seqlens_q,
            self.seq_lens,
            self.max_seqlen_q,
        )


def make_paged_batch(
    pairs,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    *,
    seed: int = 0,
    spare_blocks: int = 3,
    extra_columns: int = 2,
    first_block: int = 0,
    num_blocks: int | None = None,
) -> PagedBatch:
    """A batch of requests given as (q_len, kv_len) pairs over a randomly permuted paged cache.

    Each request gets `extra_columns` unused block-table columns beyond what it needs, filled with
    valid ids of blocks holding unrelated random data, and `spare_blocks` blocks belong to nobody.
    With `first_block`, only blocks `first_block..` are used and filled (the rest of a huge
    `torch.empty` cache is never touched, so it costs address space only).
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(kv / block_size) for _, kv in pairs]
    columns = max(needed, default=0) + extra_columns
    used = sum(needed) + spare_blocks
    if num_blocks is None:
        num_blocks = first_block + used
    assert first_block + used <= num_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if first_block == 0:
        k_cache = randn(shape, dtype, device, gen)
        v_cache = randn(shape, dtype, device, gen)
    else:
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
        k_cache[first_block:] = randn((num_blocks - first_block, *shape[1:]), dtype, device, gen)
        v_cache[first_block:] = randn((num_blocks - first_block, *shape[1:]), dtype, device, gen)
    ids = first_block + torch.randperm(num_blocks - first_block, generator=gen)
    table = torch.empty(len(pairs), columns, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(needed):
        table[i, :n] = ids[pos : pos + n].to(torch.int32)
        pos += n
        # Unused columns point at other (random-filled) blocks: reading them gives a wrong result.
        table[i, n:] = ids[torch.randint(0, len(ids), (columns - n,), generator=gen)].to(torch.int32)
    q_lens = [ql for ql, _ in pairs]
    total = sum(q_lens)
    q = randn((total, num_q_heads, head_dim), dtype, device, gen)
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=table.to(device),
        cu_seqlens_q=cu_seqlens(q_lens, device),
        seq_lens=torch.tensor([kv for _, kv in pairs], dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens, default=0),
        pairs=list(pairs),
    )


def sparse_indices(pairs, num_k, gen, *, empty_rows=(), pad=0.3):
    """Per token: up to num_k distinct positions <= its own position, some entries -1."""
    rows = []
    for q_len, kv_len in pairs:
        for j in range(q_len):
            pos = kv_len - q_len + j
            picks = torch.randperm(pos + 1, generator=gen)[:num_k]
            row = torch.full((num_k,), -1, dtype=torch.int32)
            row[: len(picks)] = picks.to(torch.int32)
            drop = torch.rand(num_k, generator=gen) < pad
            row[drop] = -1
            row = row[torch.randperm(num_k, generator=gen)]  # -1 entries anywhere in the row
            rows.append(row)
    topk = torch.stack(rows) if rows else torch.empty(0, num_k, dtype=torch.int32)
    for t in empty_rows:
        topk[t] = -1
    return topk


# fp32 and fp16 everywhere; bf16 only on CUDA (the interpreter's bf16 tl.dot is wrong on CPU).
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]


def run_outside_interpreter(script: str, timeout: float = 600) -> dict:
    """Run `script` in a child Python without TRITON_INTERPRET (Gluon kernels cannot compile
    under the CPU test run's interpreter) and return the JSON object it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_COMPILE_FOR_SM90 = """
import json, os, subprocess, tempfile, torch, triton
import tilellm.kernels.{module} as module
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = {{}}
for key, kwargs in {calls!r}:
    k = module.compile_for_sm90(**{{n: getattr(torch, v[6:]) if str(v).startswith("torch.") else v
                                  for n, v in kwargs.items()}})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    out[key] = dict(ptx=k.asm["ptx"], shared=k.metadata.shared, usage=usage, sass=sass)
print(json.dumps(out))
"""


def compile_for_sm90(module: str, calls: dict[str, dict]) -> dict[str, dict]:
    """`tilellm.kernels.<module>.compile_for_sm90(**kwargs)` for each key's kwargs (dtypes spelled
    "torch.bfloat16"), in a child Python outside the interpreter (Triton ships its own ptxas: no
    GPU needed): per key the PTX, the shared memory in bytes, cuobjdump's resource usage (its
    LOCAL:0 says no register spilled) and the SASS (`local_memory_in_loops` reads it)."""
    return run_outside_interpreter(_COMPILE_FOR_SM90.format(module=module, calls=list(calls.items())))


def local_memory_in_loops(sass: str) -> list[str]:
    """The local-memory instructions (LDL / STL: a register kept on the stack) that lie inside a
    loop of the SASS: between a backward branch and its target. A value saved once around a loop
    costs a store and a load a program; one inside the loop costs them every iteration."""
    code = []  # (address, instruction)
    for line in sass.splitlines():
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if found:
            code.append((int(found.group(1), 16), found.group(2).strip()))
    loops = []
    for address, text in code:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            loops.append((int(branch.group(1), 16), address))
    return [
        f"{address:#x}: {text}"
        for address, text in code
        if re.search(r"\b(LDL|STL)\b", text) and any(lo <= address <= hi for lo, hi in loops)
    ]


def count_planned_launches(monkeypatch, module) -> list:
    """A list that grows by one at each call of `module._launch` (the calls that plan their
    launch rather than run a remembered one), with the value checks off, as on a GPU without
    TILELLM_DEBUG=1 (a CPU call always runs them, and so never takes a remembered launch); the
    module's remembered launches forgotten first (`module.clear_plans`)."""
    from tilellm.kernels import validation

    monkeypatch.setattr(validation, "deep_checks_enabled", lambda t: False)
    module.clear_plans()
    planned = []
    real = module._launch
    monkeypatch.setattr(module, "_launch", lambda *a, **k: planned.append(1) or real(*a, **k))
    return planned
