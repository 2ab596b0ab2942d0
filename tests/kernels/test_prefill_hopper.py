"""The Gluon Hopper prefill kernel (`tilellm.kernels.prefill_hopper`).

On any machine: it compiles for sm_90a (Triton's own ptxas runs without a GPU) into warpgroup
MMAs with register reallocation between the partitions, without spilling, in the shared memory
an H100/H200 has. On a Hopper GPU: its output against the PyTorch reference over lengths that
cross the 64-row warpgroup halves, the 128-row query tiles and the 128-key tiles, packed with
one-token and empty requests, GQA and MQA, D 64 and 128, bf16 and fp16, with and without
ping-pong; and `prefill_attention` picks it for long batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import assert_close, cu_seqlens, poisoned, randn, tolerance
from tilellm.kernels import config, prefill_hopper
from tilellm.kernels import reference as ref
from tilellm.kernels.prefill import LOG2_E, _rows_view

H100_SHARED = 227 * 1024

# Compiled in a child process: under the CPU test run's TRITON_INTERPRET=1 Gluon cannot compile.
_COMPILE_ALL = """
import json, os, subprocess, sys, tempfile, torch, triton
from tilellm.kernels.prefill_hopper import compile_for_sm90
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = {}
for d in (64, 128):
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for pp in (True, False):
            k = compile_for_sm90(d, dtype, pingpong=pp)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"]); f.flush()
                cmd = [tool, "--dump-resource-usage", f.name]
                usage = subprocess.run(cmd, capture_output=True, text=True).stdout
            ptx = k.asm["ptx"]
            out[f"{d}-{name}-{pp}"] = dict(wgmma="wgmma.mma_async" in ptx, setmaxnreg="setmaxnreg" in ptx,
                tma="cp.async.bulk.tensor" in ptx, shared=k.metadata.shared, usage=usage)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiles_for_sm90_without_spills(compiled, head_dim, dtype, pingpong):
    k = compiled[f"{head_dim}-{dtype}-{pingpong}"]
    assert k["wgmma"], "products must be warpgroup MMAs"
    assert k["setmaxnreg"], "partitions must rebalance registers (producer gives, consumers take)"
    assert k["tma"], "Q and K/V tiles must arrive by TMA"
    assert k["shared"] <= H100_SHARED, f"{k['shared']} B of shared memory"
    assert "LOCAL:0" in k["usage"], f"register spills:\n{k['usage']}"


def test_block_m_other_than_two_warpgroups_is_refused():
    x = torch.empty(4, 1, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m must be 128"):
        prefill_hopper.launch(_rows_view(x), _rows_view(x), _rows_view(x), x, cu, 4, 1, 1.0, block_m=64)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (H100/H200)")

CASES = [  # (lengths, (Hq, Hkv), D)
    ([1], (8, 2), 128),
    ([63, 64, 65, 127, 128, 129], (8, 2), 128),  # the warpgroup halves and the query tiles
    ([255, 0, 256, 257, 1, 2], (4, 4), 128),  # MHA, an empty request
    ([1000, 1, 1537], (8, 1), 128),  # MQA
    ([4099, 7], (32, 8), 128),
    ([65, 64, 63, 1, 513, 300], (8, 2), 64),
    ([2048, 131], (10, 2), 64),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}req-{c[1][0]}q{c[1][1]}kv-d{c[2]}")
def test_against_reference(case, dtype, pingpong):
    lengths, (hq, hkv), head_dim = case
    gen = torch.Generator().manual_seed(sum(lengths) + hq)
    T = sum(lengths)
    q = randn((T, hq, head_dim), dtype, "cuda", gen)
    k = randn((T, hkv, head_dim), dtype, "cuda", gen)
    v = randn((T, hkv, head_dim), dtype, "cuda", gen)
    cu = cu_seqlens(lengths, "cuda")
    out = poisoned(q)
    prefill_hopper.launch(
        _rows_view(q), _rows_view(k), _rows_view(v), out, cu, max(lengths), hq // hkv,
        head_dim**-0.5 * LOG2_E, pingpong=pingpong,
    )  # fmt: skip
    expected = ref.prefill_attention(q, k, v, cu, max(lengths))
    assert_close(out, expected, tolerance(dtype, "cuda"), f"{lengths} {hq}q{hkv}kv D={head_dim}")


@pytest.mark.gpu
@needs_hopper
def test_prefill_attention_dispatches_long_batches_here():
    assert config.prefill_config(128, torch.bfloat16, 4096).kernel == "gluon"
    assert config.prefill_config(128, torch.bfloat16, 1024).kernel == "triton"  # short: prefill.py
    lengths = [3000, 1, 1200]
    gen = torch.Generator().manual_seed(5)
    T = sum(lengths)
    q = randn((T, 8, 128), torch.bfloat16, "cuda", gen)
    k = randn((T, 2, 128), torch.bfloat16, "cuda", gen)
    v = randn((T, 2, 128), torch.bfloat16, "cuda", gen)
    cu = cu_seqlens(lengths, "cuda")
    out = tk.prefill_attention(q, k, v, cu, max(lengths), out=poisoned(q))
    assert_close(out, ref.prefill_attention(q, k, v, cu, max(lengths)), 2e-2, "public entry point")
