"""Split-KV calls that merge in the paged kernel itself (eager calls by default; every call with
`TILELLM_SPLIT_MERGE=kernel`).

The last program of each tile to finish combines the tile's partials (`merge.merge_if_last`):
one launch per call. Checked against the PyTorch twins with the separate merge made to fail (so
a pass cannot come from it), on decode, verification and prompt-chunk batches with empty
segments and early-returning tiles; the arrival counters are zero again after every call, and
the machine code orders the partial stores, the arrival and the merge's loads as the merge
relies on (compiled for sm_90a, no GPU needed). On a GPU: real shapes in bf16, and a captured
graph replayed several times.
"""

from __future__ import annotations

import re

import pytest
import torch

import tilellm.kernels as tk
from tests.kernels.helpers import assert_close, make_paged_batch, poisoned, run_outside_interpreter, tolerance
from tilellm.kernels import merge, paged, split_scratch
from tilellm.kernels import reference as ref
from tilellm.kernels.config import split_merge_mode
from tilellm.kernels.schedule import plan_split_kv


def _set_mode(monkeypatch, mode: str | None) -> None:
    if mode is None:
        monkeypatch.delenv("TILELLM_SPLIT_MERGE", raising=False)
    else:
        monkeypatch.setenv("TILELLM_SPLIT_MERGE", mode)
    split_merge_mode.cache_clear()


@pytest.fixture
def in_kernel(monkeypatch):
    """The in-kernel merge on, and the separate merge's launch made to fail."""
    _set_mode(monkeypatch, "kernel")

    def no_separate_merge(*args, **kwargs):
        raise AssertionError("the separate merge kernel was launched")

    monkeypatch.setattr(paged, "run_merge", no_separate_merge)
    yield
    split_merge_mode.cache_clear()


def _counters_zero(like: torch.Tensor) -> None:
    """The arrival counters of `like`'s device are all zero."""
    counters = split_scratch.stream_workspace(like.device).counters
    assert counters is not None, "no arrival counters were allocated"
    assert int(counters.count_nonzero()) == 0, "arrival counters left non-zero after the call"


DTYPES_CPU = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


@pytest.mark.parametrize("dtype", DTYPES_CPU)
@pytest.mark.parametrize("num_splits", [2, 3, 7, 11, 64])
def test_decode_matches_the_twin(in_kernel, num_splits, dtype, device):
    """Contexts of 1 key (every segment but one empty), one page, and long ones, GQA 4."""
    b = make_paged_batch([(1, 300), (1, 1), (1, 95), (1, 16)], 8, 2, 32, 16, dtype, device, seed=3)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    for _ in range(2):  # the second call finds the counters the first left
        out = poisoned(b.q)
        tk.decode_attention(*args, num_splits=num_splits, out=out)
        assert_close(out, ref.decode_attention(*args), tolerance(dtype, device), f"splits={num_splits}")
        _counters_zero(b.q)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_verification_and_chunks_match_the_twin(in_kernel, num_splits, device):
    """Several query tiles per request (a chunk of 40 tokens), requests with fewer tokens than
    the longest (their extra tiles return early and never arrive), and a 1-token request."""
    pairs = [(40, 150), (4, 37), (1, 9), (9, 9)]
    b = make_paged_batch(pairs, 8, 2, 32, 16, torch.float32, device, seed=7)
    out = poisoned(b.q)
    tk.paged_attention(*b.args(), num_splits=num_splits, out=out)
    assert_close(out, ref.paged_attention(*b.args()), tolerance(torch.float32, device), "paged")
    _counters_zero(b.q)


def test_more_splits_than_it_serves_take_the_separate_merge(monkeypatch, device):
    """Beyond MERGE_LAST_MAX_SPLITS segments the call merges in a second launch, as by default."""
    _set_mode(monkeypatch, "kernel")
    launched = []
    real = paged.run_merge
    monkeypatch.setattr(paged, "run_merge", lambda *a, **k: launched.append(1) or real(*a, **k))
    splits = merge.MERGE_LAST_MAX_SPLITS + 1
    b = make_paged_batch([(1, 16 * splits + 5), (1, 40)], 4, 2, 32, 16, torch.float32, device, seed=2)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    out = tk.decode_attention(*args, num_splits=splits)
    assert launched == [1]
    assert_close(out, ref.decode_attention(*args), tolerance(torch.float32, device), f"splits={splits}")
    launched.clear()
    tk.decode_attention(*args, num_splits=merge.MERGE_LAST_MAX_SPLITS)
    assert launched == []
    split_merge_mode.cache_clear()


def test_same_result_as_the_separate_merge(monkeypatch, device):
    """The two merges add the same weighted partials (in another order): equal within rounding."""
    b = make_paged_batch([(1, 700), (3, 200)], 8, 1, 64, 16, torch.float32, device, seed=11)
    _set_mode(monkeypatch, None)
    separate = tk.paged_attention(*b.args(), num_splits=6)
    _set_mode(monkeypatch, "kernel")
    monkeypatch.setattr(paged, "run_merge", lambda *a, **k: pytest.fail("the separate merge ran"))
    fused = tk.paged_attention(*b.args(), num_splits=6)
    split_merge_mode.cache_clear()
    assert_close(fused, separate, 1e-6, "in-kernel vs separate merge")


def test_a_counter_left_off_zero_is_reported_and_reset(in_kernel, monkeypatch, device):
    """A counter left off zero (as a kernel fault would leave it) spoils the next call that uses
    it: the value checks (always on for CPU tensors, TILELLM_DEBUG=1 on a GPU) report it and set
    it back, and the call after is right again. (The stray value is past any arrival count, so
    that no program of the tile takes itself for the last, on a GPU as under the interpreter: a
    small one could be overwritten by the merging program's reset, as its peers arrive.)"""
    monkeypatch.setenv("TILELLM_DEBUG", "1")
    b = make_paged_batch([(1, 200), (1, 90)], 4, 2, 32, 16, torch.float32, device, seed=4)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    tk.decode_attention(*args, num_splits=3)
    split_scratch.stream_workspace(b.q.device).counters[0] = 100
    with pytest.raises(RuntimeError, match="left non-zero.*TILELLM_SPLIT_MERGE=separate"):
        tk.decode_attention(*args, num_splits=3)
    _counters_zero(b.q)
    out = tk.decode_attention(*args, num_splits=3)
    assert_close(out, ref.decode_attention(*args), tolerance(torch.float32, device), "after the reset")
    split_scratch.stream_workspace(b.q.device).counters[5] = 2
    split_scratch.reset_split_counters()
    _counters_zero(b.q)


def test_unknown_mode_is_refused(monkeypatch):
    _set_mode(monkeypatch, "fused")
    with pytest.raises(ValueError, match="TILELLM_SPLIT_MERGE='fused'.*'auto'.*'kernel'.*'separate'"):
        split_merge_mode()
    split_merge_mode.cache_clear()


def test_default_mode_is_auto(monkeypatch):
    _set_mode(monkeypatch, None)
    assert split_merge_mode() == "auto"
    split_merge_mode.cache_clear()


@pytest.fixture
def merges(monkeypatch):
    """Counts the separate merge's launches (`paged.run_merge`), which still run."""
    launched = []
    real = paged.run_merge
    monkeypatch.setattr(paged, "run_merge", lambda *a, **k: launched.append(1) or real(*a, **k))
    return launched


@pytest.mark.parametrize("value_checks", [True, False], ids=["checked", "remembered"])
def test_eager_split_calls_merge_in_the_kernel_by_default(monkeypatch, merges, value_checks, device):
    """By default an eager split call is one launch: no separate merge, partials and counters
    from the stream's workspace, reused by the next call (new inputs, the same layout: with the
    value checks off, as on a GPU, the remembered launch) and left at zero."""
    from tilellm.kernels import validation

    _set_mode(monkeypatch, None)
    if not value_checks:
        monkeypatch.setattr(validation, "deep_checks_enabled", lambda t: False)
    paged.clear_plans()
    workspace = split_scratch.stream_workspace(torch.device(device))
    workspace.clear()
    buffers = None
    for seed in (1, 2, 3):
        b = make_paged_batch([(1, 300), (1, 1), (1, 95)], 8, 2, 32, 16, torch.float32, device, seed=seed)
        args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
        out = tk.decode_attention(*args, num_splits=4, max_seqlen_k=300)
        assert_close(out, ref.decode_attention(*args), tolerance(torch.float32, device), f"seed {seed}")
        _counters_zero(b.q)
        now = (workspace.o_parts.data_ptr(), workspace.lse_parts.data_ptr())
        assert buffers in (None, now), "the partials were not reused"
        buffers = now
    assert merges == []
    paged.clear_plans()
    split_merge_mode.cache_clear()


def test_separate_mode_merges_in_a_second_launch(monkeypatch, merges, device):
    _set_mode(monkeypatch, "separate")
    b = make_paged_batch([(1, 300), (1, 95)], 8, 2, 32, 16, torch.float32, device, seed=8)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    for _ in range(2):
        out = tk.decode_attention(*args, num_splits=4, max_seqlen_k=300)
        assert_close(out, ref.decode_attention(*args), tolerance(torch.float32, device), "separate")
    assert merges == [1, 1]
    split_merge_mode.cache_clear()


def test_large_partials_are_not_kept(monkeypatch, device):
    """Partials past `WORKSPACE_MAX_PARTIALS` (a long prompt chunk's) are the call's own."""
    _set_mode(monkeypatch, None)
    monkeypatch.setattr(split_scratch, "WORKSPACE_MAX_PARTIALS", 1024)
    workspace = split_scratch.stream_workspace(torch.device(device))
    workspace.clear()
    b = make_paged_batch([(40, 150), (4, 37)], 8, 2, 32, 16, torch.float32, device, seed=9)
    out = tk.paged_attention(*b.args(), num_splits=3)
    assert_close(out, ref.paged_attention(*b.args()), tolerance(torch.float32, device), "own partials")
    assert workspace.o_parts is None
    split_merge_mode.cache_clear()


# -- the memory order in the machine code (sm_90a, compiled without a GPU) --

_PTX_SCRIPT = r"""
import json, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from tilellm.kernels import merge, paged, split_scratch
from tilellm.kernels.config import paged_config

cfg, block_q = paged_config(128, torch.bfloat16, 4, 1)
fn = paged._paged_kernel
names = fn.arg_names
types = {n: "*bf16" for n in ("Q", "K_cache", "V_cache", "O")}
types |= {n: "*fp32" for n in ("O_parts", "LSE_parts")} | {"qk_scale": "fp32"}
for n in ("stats", "k_scale", "v_scale", "block_table", "cu_seqlens_q", "seq_lens", "kv_lo_ptr",
          "kv_hi_ptr", "split_counters"):
    types[n] = "*i32"
out = {}
for pdl in (False, True):
    constexprs = dict(
        GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
        SPLIT=True, IS_DECODE=True, HAS_KV_LO=False, HAS_KV_HI=False, RECORD_STATS=False,
        PRECISION="tf32", K_ROWS=cfg.k_rows, TILES_FASTEST=False, KV_FP8=False, DOT_FP16=False,
        PIPELINE_MASKED=True, USE_PDL=pdl, MERGE_LAST=True, MERGE_UNROLL=4,
    )
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = ("Q", "K_cache", "V_cache", "O", "O_parts", "LSE_parts")
    src = ASTSource(
        fn=fn, signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "launch_pdl": pdl})
    out[f"pdl={pdl}"] = k.asm["ptx"]
    out[f"ttir-pdl={pdl}"] = k.asm["ttir"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return run_outside_interpreter(_PTX_SCRIPT)


def _instructions(ptx: str) -> list[str]:
    return [
        line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith(("//", "."))
    ]


@pytest.mark.parametrize("variant", ["pdl=False", "pdl=True"])
def test_memory_order_in_the_ptx(ptx, variant):
    """One arrival, a release-acquire atomic at GPU scope on one thread; a CTA barrier between
    the partials' stores and it; and every global load after it (the merge's reads of the
    partials) bypasses L1."""
    code = _instructions(ptx[variant])
    atoms = [i for i, ins in enumerate(code) if re.search(r"\batom\.", ins)]
    assert len(atoms) == 1, [code[i] for i in atoms]
    atom = atoms[0]
    assert re.search(r"\batom\.global\.gpu\.acq_rel\.add\.u32\b", code[atom]), code[atom]
    assert code[atom].startswith("@"), f"the arrival must run on one thread: {code[atom]}"
    last_store = max(i for i, ins in enumerate(code[:atom]) if re.search(r"\bst\.global\b", ins))
    assert any("bar.sync" in ins for ins in code[last_store:atom]), (
        "no barrier between the stores and the arrival"
    )
    loads_after = [ins for ins in code[atom:] if re.search(r"\bld\.global\b", ins)]
    assert loads_after, "the merge reads no partials"
    assert all(".cg" in ins for ins in loads_after), [ins for ins in loads_after if ".cg" not in ins]
    assert not any(re.search(r"\bld\.global\.cg\b", ins) for ins in code[:atom]), (
        "a partial read before the arrival"
    )
    first_read = next(i for i, ins in enumerate(code) if i > atom and re.search(r"\bld\.global\b", ins))
    assert any("bar.sync" in ins for ins in code[atom:first_read]), (
        "no barrier between the arrival and the reads"
    )
    # the kernel's own barrier (not only the one Triton adds before an atomic): in the Triton IR,
    # between the partials' last store and the atomic
    ttir = [line.strip() for line in ptx["ttir-" + variant].splitlines()]
    rmw = next(i for i, line in enumerate(ttir) if "tt.atomic_rmw" in line)
    last_store = max(i for i, line in enumerate(ttir[:rmw]) if "tt.store" in line)
    barrier = re.compile(r"\b(gpu\.barrier|ttg\.barrier)\b")  # tl.debug_barrier, as Triton versions spell it
    assert any(barrier.search(line) for line in ttir[last_store:rmw]), "no barrier of the kernel's own"


# -- on a GPU --


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 2, 16])
def test_gpu_real_shapes(in_kernel, num_splits, device):
    """Qwen3-0.6B's heads (16 q / 8 kv, D 128) in bf16: the split plan's count and forced ones."""
    b = make_paged_batch(
        [(1, 9000), (1, 130), (1, 1), (1, 4096)], 16, 8, 128, 16, torch.bfloat16, device, seed=5
    )
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    if num_splits is None:  # a small batch: the planner's count is within what the merge serves
        plan = plan_split_kv(b.cu_seqlens_q, b.seq_lens, 16, 8, head_dim=128, dtype=torch.bfloat16)
        assert 1 < plan.num_splits <= merge.MERGE_LAST_MAX_SPLITS, plan.reason
    for _ in range(3):
        out = poisoned(b.q)
        tk.decode_attention(*args, num_splits=num_splits, out=out)
        assert_close(
            out, ref.decode_attention(*args), tolerance(torch.bfloat16, device), f"splits={num_splits}"
        )
    torch.cuda.synchronize()
    _counters_zero(b.q)


@pytest.mark.gpu
def test_gpu_graph_replays(in_kernel, device):
    """Captured once (with counters of the graph's own), replayed with new queries: each
    replay's output is the eager call's, so each replay found its counters at zero."""
    b = make_paged_batch([(1, 5000), (1, 300), (1, 2000)], 16, 8, 128, 16, torch.bfloat16, device, seed=6)
    args = (b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    q = b.q.clone()
    tk.decode_attention(q, *args, num_splits=8)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.decode_attention(q, *args, num_splits=8)
    for seed in range(4):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        graph.replay()
        expected = ref.decode_attention(q, *args)
        assert_close(out, expected, tolerance(torch.bfloat16, device), f"replay {seed}")
    torch.cuda.synchronize()
    _counters_zero(b.q)


@pytest.mark.gpu
def test_gpu_auto_mode_captures_the_separate_merge(monkeypatch, merges, device):
    """By default a captured split call merges in a second launch (no workspace in the graph),
    and eager calls of the same layout, before and after, still merge in the kernel."""
    _set_mode(monkeypatch, None)
    b = make_paged_batch([(1, 5000), (1, 300), (1, 2000)], 16, 8, 128, 16, torch.bfloat16, device, seed=6)
    args = (b.k_cache, b.v_cache, b.block_table, b.seq_lens)
    q = b.q.clone()
    tk.decode_attention(q, *args, num_splits=8)
    torch.cuda.synchronize()
    assert merges == []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.decode_attention(q, *args, num_splits=8)
    assert merges == [1]
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        graph.replay()
        expected = ref.decode_attention(q, *args)
        assert_close(out, expected, tolerance(torch.bfloat16, device), f"replay {seed}")
        eager = tk.decode_attention(q, *args, num_splits=8)
        assert_close(eager, expected, tolerance(torch.bfloat16, device), f"eager {seed}")
    assert merges == [1]
    split_merge_mode.cache_clear()


@pytest.mark.gpu
def test_gpu_two_streams_have_their_own_workspaces(monkeypatch, device):
    """Split calls issued at once on two streams: each stream's own counters and partials, each
    result the twin's."""
    _set_mode(monkeypatch, None)
    pairs = [(1, 6000), (1, 3000)]
    batches = [make_paged_batch(pairs, 16, 8, 128, 16, torch.bfloat16, device, seed=s) for s in (1, 2)]
    streams = [torch.cuda.Stream() for _ in batches]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(5):
        for i, (stream, b) in enumerate(zip(streams, batches)):
            with torch.cuda.stream(stream):
                args = (b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
                outs[i].append(tk.decode_attention(*args, num_splits=16))
    torch.cuda.synchronize()
    workspaces = []
    for i, (stream, b) in enumerate(zip(streams, batches)):
        expected = ref.decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.seq_lens)
        for out in outs[i]:
            assert_close(out, expected, tolerance(torch.bfloat16, device), f"stream {i}")
        with torch.cuda.stream(stream):
            workspace = split_scratch.stream_workspace(b.q.device)
        assert int(workspace.counters.count_nonzero()) == 0
        workspaces.append(workspace)
    assert workspaces[0] is not workspaces[1]
    assert workspaces[0].o_parts.data_ptr() != workspaces[1].o_parts.data_ptr()
    split_merge_mode.cache_clear()
