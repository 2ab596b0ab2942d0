"""The order programmatic dependent launch relies on, read from the machine code (no GPU needed).

A kernel launched with PDL may run while the kernel before it still writes its outputs, so each
one must execute `griddepcontrol.wait` (SASS `ACQBULK`) before its first load or store of global
memory. The exceptions read only the weight, which no kernel writes: `skinny_linear`'s L2
prefetch of it (`UBLKPF`), and the one-row GEMVs' loads of their whole weight tile (`gemv.py`,
`fp8_gemv.py`: loads, but no store, before the wait). Every
kernel of the PDL decode path is compiled here for sm_90a with USE_PDL=True (Triton ships ptxas
and cuobjdump) and its SASS is read in program order up to the wait: no global memory access,
and no exit, may come before it. (The compiling runs in a subprocess without
TRITON_INTERPRET: under the interpreter `@triton.jit` builds no compilable kernels.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton

from tilellm.kernels import fp8_gemv, fused, gemv, merge, paged, skinny, store
from tilellm.kernels.config import paged_config

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
pytestmark = pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")
# global memory accesses in SASS (loads, stores, cp.async, atomics, TMA), and the bulk L2 prefetch
GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|LDGSTS|ATOMG?|RED|UTMALDG|UTMASTG)\b")
PREFETCH = re.compile(r"\bUBLKPF\b")
LOAD = re.compile(r"\b(LDG|LDGSTS|UTMALDG)\b")  # global loads (into registers or shared memory)


def _compile(fn, types: dict[str, str], constexprs: dict, aligned=(), **options):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True, **options})


def _before_wait(compiled) -> list[str]:
    """The SASS instructions, in program order, before the first ACQBULK (which must exist)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [
        line.split("*/", 1)[1].split(";")[0].strip()
        for line in sass.splitlines()
        if re.search(r"/\*[0-9a-f]{4}\*/", line)
    ]
    waits = [i for i, ins in enumerate(code) if "ACQBULK" in ins]
    if not waits:
        raise AssertionError("no griddepcontrol.wait (ACQBULK) in the kernel")
    return code[: waits[0]]


_REG = re.compile(r"%[a-z]+[0-9]+")


def _early_load_params(compiled, fn, constexprs: dict) -> list[str]:
    """The kernel arguments the addresses of its global loads before the wait are computed from,
    read from the PTX: each register's value is traced back (through every instruction that wrote
    it) to the kernel parameters loaded with `ld.param`; the names of those parameters, over all
    the loads that come before `griddepcontrol.wait`."""
    args = [n for n in fn.arg_names if n not in constexprs]  # the PTX's parameters, in order
    ptx = compiled.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")) : ptx.index("griddepcontrol.wait")]
    origin: dict[str, set[str]] = {}
    used: set[str] = set()
    for line in body.splitlines():
        ins = re.sub(r"^\s*@!?%p[0-9]+\s+", "", line.split("//")[0]).strip()
        if not ins or ins.startswith((".", "$", "{", "}")):
            continue
        op, _, operands = ins.partition(" ")
        if op.startswith("ld.param"):
            dst, index = re.match(r"(%[a-z]+[0-9]+),\s*\[\w+_param_([0-9]+)\]", operands.strip()).groups()
            origin[dst] = {args[int(index)]} if int(index) < len(args) else {"(scratch)"}
            continue
        regs = _REG.findall(operands)
        if op.startswith("ld.global"):  # { destinations }, [ address ]
            address = _REG.findall(operands[operands.index("[") :])
            used |= set().union(*(origin.get(r, set()) for r in address))
            continue
        if not regs or op.startswith(("st.", "setp", "bra", "prefetch")):
            if op.startswith("setp") and regs:  # a predicate: from its operands
                origin[regs[0]] = set().union(*(origin.get(r, set()) for r in regs[1:]))
            continue
        dst, srcs = regs[0], regs[1:]
        origin[dst] = origin.get(dst, set()) | set().union(*(origin.get(r, set()) for r in srcs))
    return sorted(used)


def _cases() -> dict[str, tuple]:
    """name -> (kernel, argument types, constexprs, 16-divisible arguments, options, prefetch allowed)."""
    cases: dict[str, tuple] = {}
    norm_types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "y_ptr", "res_out_ptr")} | {"eps": "fp32"}
    for residual in (False, True):
        constexprs = dict(HAS_RESIDUAL=residual, BLOCK_N=4, BLOCK_H=1024, USE_PDL=True)
        cases[f"rms_norm-residual={residual}"] = (
            fused._rms_norm_kernel,
            norm_types,
            constexprs,
            (),
            {},
            False,
        )
    quant_types = norm_types | {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "quant_eps": "fp32"}
    for residual in (False, True):  # the norm with the FP8 quantization of its output
        constexprs = dict(HAS_RESIDUAL=residual, GROUP=128, BLOCK_N=4, BLOCK_H=1024, USE_PDL=True)
        cases[f"rms_norm_quant-residual={residual}"] = (
            fused._rms_norm_quant_kernel, quant_types, constexprs, (), {}, False,
        )  # fmt: skip
    cases["silu_and_mul"] = (
        fused._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"},
        dict(BLOCK_N=1, BLOCK_I=2048, USE_PDL=True), (), {}, False,
    )  # fmt: skip
    rotary_types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "qw_ptr", "kw_ptr")}
    rotary_types |= {"pos_ptr": "*i64", "cache_ptr": "*fp32", "eps": "fp32"}
    rotary_types |= {"v_ptr": "*bf16", "slot_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    for norm in (False, True):
        constexprs = dict(
            HAS_NORM=norm,
            INTERLEAVED=False,
            STORE=False,
            QUANTIZE=False,
            BLOCK_R=32,
            BLOCK_HALF=64,
            USE_PDL=True,
        )
        types = rotary_types | {"k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}
        cases[f"rotary-norm={norm}"] = (fused._rotary_kernel, types, constexprs, (), {}, False)
    constexprs = dict(  # DeepSeek's interleaved pairs
        HAS_NORM=False, INTERLEAVED=True, STORE=False, QUANTIZE=False, BLOCK_R=64, BLOCK_HALF=32, USE_PDL=True
    )
    cases["rotary-interleaved"] = (fused._rotary_kernel, types, constexprs, (), {}, False)
    for fp8 in (False, True):  # rotation and the cache store in one launch
        constexprs = dict(
            HAS_NORM=True,
            INTERLEAVED=False,
            STORE=True,
            QUANTIZE=fp8,
            BLOCK_R=32,
            BLOCK_HALF=64,
            USE_PDL=True,
        )
        cache = "*fp8e4nv" if fp8 else "*bf16"
        types = rotary_types | {"k_cache_ptr": cache, "v_cache_ptr": cache}
        cases[f"rotary_store-fp8={fp8}"] = (fused._rotary_kernel, types, constexprs, (), {}, False)
    for fp8 in (False, True):  # including the early return of padding rows (slot -1)
        cache = "*fp8e4nv" if fp8 else "*bf16"
        types = {"K": "*bf16", "V": "*bf16", "K_cache": cache, "V_cache": cache, "slot_mapping": "*i64"}
        types |= {"k_scale": "*fp32", "v_scale": "*fp32"}
        constexprs = dict(HEADS=8, HEAD_DIM=128, BLOCK=1024, HAS_V=True, QUANTIZE=fp8, USE_PDL=True)
        cases[f"store-fp8={fp8}"] = (store._store_kernel, types, constexprs, (), {"num_warps": 4}, False)
    for fp8 in (False, True):  # MLA's rows from their two parts
        types = {"KV_C": "*bf16", "K_PE": "*bf16", "Cache": "*fp8e4nv" if fp8 else "*bf16"}
        types |= {"slot_mapping": "*i64", "scale": "*fp32"}
        constexprs = dict(L=512, DR=64, BLOCK_L=512, BLOCK_R=64, QUANTIZE=fp8, USE_PDL=True)
        cases[f"mla_rows-fp8={fp8}"] = (
            store._mla_rows_kernel,
            types,
            constexprs,
            (),
            {"num_warps": 1},
            False,
        )
    merge_types = {"O_parts": "*fp32", "LSE_parts": "*fp32", "O": "*bf16", "LSE": "*fp32"}
    merge_constexprs = dict(HEAD_DIM=128, SPLITS_PAD=8, WRITE_LSE=True, USE_PDL=True)
    cases["merge"] = (merge._merge_kernel, merge_types, merge_constexprs, (), {}, False)
    cfg, block_q = paged_config(128, torch.bfloat16, 2, 1)
    paged_types = {n: "*bf16" for n in ("Q", "K_cache", "V_cache", "O")}
    paged_types |= {n: "*fp32" for n in ("O_parts", "LSE_parts")} | {"qk_scale": "fp32"}
    paged_types |= {
        n: "*i32" for n in ("stats", "k_scale", "v_scale", "block_table", "cu_seqlens_q", "seq_lens")
    }
    paged_types |= {"kv_lo_ptr": "*i32", "kv_hi_ptr": "*i32", "split_counters": "*i32"}
    for split, merge_last in ((False, False), (True, False), (True, True)):
        constexprs = dict(
            GROUP=2, HEAD_DIM=128, PAGE=16, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
            SPLIT=split, IS_DECODE=True, HAS_KV_LO=False, HAS_KV_HI=False, RECORD_STATS=False,
            PRECISION="tf32", K_ROWS=cfg.k_rows, TILES_FASTEST=False, KV_FP8=False, DOT_FP16=False,
            PIPELINE_MASKED=True, USE_PDL=True, MERGE_LAST=merge_last, MERGE_UNROLL=4,
        )  # fmt: skip
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        aligned = ("Q", "K_cache", "V_cache", "O", "O_parts", "LSE_parts")
        cases[f"paged_decode-split={split}" + ("-merge_last" if merge_last else "")] = (
            paged._paged_kernel,
            paged_types,
            constexprs,
            aligned,
            options,
            False,
        )
    skinny_types = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16"}
    skinny_aligned = ("X", "W", "B", "Y", "N", "K", "chunk_bytes", "stride_xm", "stride_wn", "stride_ym")
    skinny_types |= {"R": "*bf16", "NW": "*bf16", "RO": "*bf16", "eps": "fp32"}
    skinny_aligned += ("R", "NW", "RO", "stride_rm", "stride_om")
    variants = [(16, False, False), (32, False, False), (64, False, False), (16, True, False)]
    for block_n, gated, norm in variants + [(32, False, True), (16, True, True)]:
        constexprs = dict(
            HAS_BIAS=True, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, EVEN_K=True, PRECISION="tf32",
            PREFETCH_CHUNKS=128 // block_n, USE_PDL=True, GATED=gated, NORM=norm, HAS_RESIDUAL=norm,
        )  # fmt: skip
        options = {"num_warps": 4, "num_stages": 4}
        name = f"skinny_linear-block_n={block_n}" + ("-gated" if gated else "") + ("-norm" if norm else "")
        cases[name] = (
            skinny._skinny_linear_kernel, skinny_types, constexprs, skinny_aligned, options, True,
        )  # fmt: skip
    gemv_types = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16", "NW": "*bf16", "R": "*bf16"}
    gemv_types |= {"RO": "*bf16", "eps": "fp32"}
    # (as Qwen3's layers launch them: pointers and strides divisible by 16, vectorised loads)
    gemv_aligned = ("X", "W", "Y", "NW", "R", "RO", "N", "K", "stride_wn")
    rows_aligned = gemv_aligned + ("stride_xm", "stride_ym", "stride_rm", "stride_om")
    fp8_aligned = gemv_aligned + ("stride_xm", "stride_ym", "stride_bs_n")
    for gated, norm in ((False, False), (False, True), (True, True)):  # one row: the whole tile at once
        constexprs = dict(
            HAS_BIAS=False, BLOCK_N=4, BLOCK_K=1024, K_TILES=1, EVEN_N=True, GATED=gated, NORM=norm,
            HAS_RESIDUAL=norm, USE_PDL=True,
        )  # fmt: skip
        name = "gemv" + ("-gated" if gated else "") + ("-norm" if norm else "")
        cases[name] = (gemv._gemv_kernel, gemv_types, constexprs, gemv_aligned, {"num_warps": 8}, False)
    constexprs = dict(
        HAS_BIAS=False, BLOCK_M=8, BLOCK_N=2, BLOCK_K=1024, K_TILES=1, N_TILES=1, EVEN_N=True, GATED=True,
        NORM=True, HAS_RESIDUAL=True, USE_PDL=True,
    )  # fmt: skip
    cases["gemv_rows-gated-norm"] = (
        gemv._gemv_rows_kernel, gemv_types, constexprs, rows_aligned, {"num_warps": 8}, False,
    )  # fmt: skip
    fp8_types = {"X": "*bf16", "Xs": "*fp32", "W": "*fp8e4nv", "Bs": "*fp32", "As": "*fp32", "Y": "*bf16"}
    fp8_types |= {"eps": "fp32", "NW": "*bf16", "R": "*bf16", "RO": "*bf16", "norm_eps": "fp32"}
    for quantized_x, gated, norm in ((False, False, False), (False, True, True), (True, False, False)):
        constexprs = dict(
            GROUP_N=128, GROUP_K=128, BLOCK_M=1, BLOCK_N=8, BLOCK_G=8, G_TILES=1, STATIC_A=False, GATED=gated,
            NORM=norm, HAS_RESIDUAL=norm, QUANTIZED_X=quantized_x, USE_PDL=True,
        )  # fmt: skip
        types = fp8_types | ({"X": "*fp8e4nv"} if quantized_x else {})
        name = (
            "fp8_gemv"
            + ("-x_q" if quantized_x else "")
            + ("-gated" if gated else "")
            + ("-norm" if norm else "")
        )
        cases[name] = (fp8_gemv._fp8_gemv_kernel, types, constexprs, fp8_aligned, {"num_warps": 8}, False)
    return cases


CASES = (
    [f"rms_norm-residual={r}" for r in (False, True)]
    + [f"rms_norm_quant-residual={r}" for r in (False, True)]
    + ["silu_and_mul"]
    + [f"rotary-norm={n}" for n in (False, True)]
    + ["rotary-interleaved"]
    + [f"rotary_store-fp8={f}" for f in (False, True)]
    + [f"store-fp8={f}" for f in (False, True)]
    + [f"mla_rows-fp8={f}" for f in (False, True)]
    + ["merge"]
    + [f"paged_decode-split={s}" for s in (False, True)]
    + ["paged_decode-split=True-merge_last"]
    + [f"skinny_linear-block_n={b}" for b in (16, 32, 64)]
    + [
        "skinny_linear-block_n=16-gated",
        "skinny_linear-block_n=32-norm",
        "skinny_linear-block_n=16-gated-norm",
    ]
    + ["gemv", "gemv-norm", "gemv-gated-norm", "gemv_rows-gated-norm"]
    + ["fp8_gemv", "fp8_gemv-gated-norm", "fp8_gemv-x_q"]
)
# the kernels that load their weight tile before the wait (the one-row GEMVs: K in one tile)
WEIGHT_LOADS_FIRST = ("gemv", "gemv_rows", "fp8_gemv")
WEIGHT_ARGS = {"W", "Bs"}  # the weight and its block scales: no kernel writes them


def _analyse_all() -> dict[str, dict]:
    """Every case compiled and read: {name: {"before": [...], "waits": n} or {"error": text}}."""
    out = {}
    for name, (fn, types, constexprs, aligned, options, _) in _cases().items():
        try:
            compiled = _compile(fn, types, constexprs, aligned, **options)
            out[name] = {
                "before": _before_wait(compiled),
                "launch_pdl": bool(compiled.metadata.launch_pdl),
                "early_load_params": _early_load_params(compiled, fn, constexprs),
            }
        except Exception as e:  # reported by the test of this case
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.fixture(scope="module")
def analysis() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_pdl_order"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", CASES)
def test_waits_before_touching_memory(analysis, name):
    """No global store, atomic or exit before the wait, and no load either but the weight's: the
    L2 prefetch that skinny_linear must place there, and the GEMVs' loads of their weight tile, which
    must come there to overlap the kernel before. Nor the trigger that lets the next kernel launch
    (`griddepcontrol.launch_dependents`, PREEXIT): before its own wait it lets every later kernel
    of the chain launch and wait on the SMs."""
    result = analysis[name]
    assert "error" not in result, result.get("error")
    assert result["launch_pdl"]
    before = result["before"]
    loads = [ins for ins in before if LOAD.search(ins)]
    others = [
        ins
        for ins in before
        if (GLOBAL_ACCESS.search(ins) and not LOAD.search(ins)) or re.search(r"\bEXIT\b", ins)
    ]
    assert not others, f"{name}: a store, atomic or exit before the wait: {others}"
    if name.split("-")[0] in WEIGHT_LOADS_FIRST:
        assert loads, f"{name}: no load of the weight before the wait"
        pointers = {n for n in result["early_load_params"] if _cases()[name][1].get(n, "").startswith("*")}
        assert pointers and pointers <= WEIGHT_ARGS, (
            f"{name}: loads before the wait read from {sorted(pointers)}, not only from the weight"
        )
    else:
        assert not loads, f"{name}: a global load before the wait: {loads}"
    assert not [ins for ins in before if "PREEXIT" in ins], (
        f"{name}: the next kernel let launch before the wait"
    )
    prefetches = [ins for ins in before if PREFETCH.search(ins)]
    if name.startswith("skinny_linear"):
        assert prefetches, f"{name}: no L2 prefetch of the weight before the wait"
    else:
        assert not prefetches, f"{name}: a prefetch before the wait"


if __name__ == "__main__":
    print(json.dumps(_analyse_all()))
