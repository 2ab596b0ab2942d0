"""`tilellm.bench.breakdown`: kernels grouped by class, their time set against the wall time."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import tilellm.kernels
from tilellm.bench.breakdown import OTHER, breakdown_from_events, kernel_class

# Kernel names as torch.profiler reports them on an H200 (an E1 decode step and a batch-1 step).
NAMES = [
    ("_paged_kernel", "attention"),
    ("_attention_kernel", "attention"),
    ("_prefill_kernel", "attention"),
    ("_merge_kernel", "attention"),
    ("_score_kernel", "attention"),
    ("_store_kernel", "KV store"),
    ("_mla_rows_kernel", "KV store"),  # MLA's latent rows, not MLA's attention
    ("_store_index_fp8_kernel", "KV store"),
    ("_decode_fp8_kernel", "attention"),
    ("_split_k_sum_kernel", "GEMM (linear layers, LM head)"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "GEMM (linear layers, LM head)"),
    (
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>",
        "GEMM (linear layers, LM head)",
    ),
    ("_w8a8_block_fp8_matmul_kernel", "GEMM (linear layers, LM head)"),
    ("_per_token_group_quant_kernel", "FP8 quantization"),
    ("_fused_moe_kernel", "MoE experts"),
    ("_rms_norm_kernel", "RMSNorm"),
    ("_silu_and_mul_kernel", "SiLU-and-mul"),
    ("_rms_norm_quant_kernel", "RMSNorm"),  # with the FP8 quantization of its output
    ("_silu_and_mul_quant_kernel", "SiLU-and-mul"),
    ("_rotary_kernel", "rotary"),
    ("_gumbel_argmax_kernel", "sampling"),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<f",
        "sampling",
    ),
    ("Memcpy HtoD (Pinned -> Device)", "copies and fills"),
    ("void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long>", OTHER),
]


@pytest.mark.parametrize("name,cls", NAMES)
def test_kernel_class(name, cls):
    assert kernel_class(name) == cls


def _package_kernels() -> list[str]:
    """The names of the package's launched kernels: `*_kernel` functions under a `jit` decorator."""
    names = []
    for path in sorted(Path(tilellm.kernels.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef)
                and node.name.endswith("_kernel")
                and any("jit" in ast.unparse(d) for d in node.decorator_list)
            ):
                names.append(node.name)
    return names


def test_every_kernel_of_the_package_has_a_class():
    names = _package_kernels()
    assert len(names) >= 20, names  # the scan found the kernels
    assert {n: kernel_class(n) for n in names if kernel_class(n) == OTHER} == {}


def test_breakdown_sums_by_class_and_leaves_idle_time():
    ev = lambda key, us, count: SimpleNamespace(key=key, self_device_time_total=us, count=count)  # noqa: E731
    events = [
        ev("_paged_kernel", 3e6, 28),
        ev("_merge_kernel", 0.5e6, 28),
        ev("nvjet_sm90_tst_64x8", 1e6, 56),
        ev("aten::empty", 0.0, 9),  # host-only: no device time, not counted
    ]
    b = breakdown_from_events(events, wall_s=5.0, steps=10)
    assert b.device_s_by_class == {"attention": 3.5, "GEMM (linear layers, LM head)": 1.0}
    assert b.launches_by_class == {"attention": 56, "GEMM (linear layers, LM head)": 56}
    assert b.busy_s == pytest.approx(4.5) and b.idle_s == pytest.approx(0.5)
    text = b.format("E1")
    assert "attention" in text.splitlines()[2] and "350.000" in text  # the largest first; ms per step
    assert b.as_dict()["device_idle_s"] == 0.5


def test_kernel_gaps_split_idle_time_within_and_between_steps():
    """Kernels as (start, duration) us, unsorted: gaps up to the threshold are a step's own,
    longer ones lie between steps; the busy time is the kernels' durations."""
    from tilellm.bench.breakdown import kernel_gaps

    # two steps of three kernels: 1 us gaps inside a step, 50 us between the steps
    spans = [(0.0, 4.0), (5.0, 2.0), (8.0, 3.0), (61.0, 4.0), (66.0, 2.0), (69.0, 3.0)]
    gaps = kernel_gaps(list(reversed(spans)), steps=2)
    assert (gaps.kernels, gaps.busy_us, gaps.idle_within_us, gaps.idle_between_us) == (6, 18.0, 4.0, 50.0)
    assert "3 kernels a step, 9.0 us a step in them" in gaps.format()
    assert "idles 2.0 us a step between a step's kernels and 25.0 us between steps" in gaps.format()
    # a smaller threshold counts the 1 us gaps as between steps too; overlapping kernels add none
    assert kernel_gaps(spans, steps=2, step_gap_us=0.5).idle_between_us == 54.0
    assert kernel_gaps([(0.0, 5.0), (3.0, 5.0)], steps=1).idle_within_us == 0.0
    assert kernel_gaps([], steps=1).kernels == 0


def test_kernel_spans_from_a_chrome_trace(tmp_path):
    """Only the trace's "kernel" events, as (ts, dur)."""
    import json

    from tilellm.bench.breakdown import kernel_spans_from_trace

    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "_paged_kernel", "ts": 10.5, "dur": 4.0},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1.0, "dur": 2.0},
            {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 9.0},
            {"cat": "kernel", "name": "nvjet_sm90", "ts": 15, "dur": 5},
            {"ph": "M", "name": "process_name"},
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert kernel_spans_from_trace(str(path)) == [(10.5, 4.0), (15.0, 5.0)]
