"""`tilellm bench throughput` end to end on a tiny model (CPU: reference attention), E1 scaled down."""

from __future__ import annotations

import json

import pytest

from tilellm.bench.throughput import e1


def test_e1_repeats_and_unfused_variant(tmp_path):
    from tilellm.cli import main
    from tilellm.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "e1.json"
    # scale 0.05: 13 prompts of 5-51 tokens, so most span whole 16-token blocks the cache could share
    argv = ["bench", "throughput", "--workloads", "E1", "--scale", "0.05", "--model", str(model)]
    argv += ["--dtype", "float32", "--device", "cpu", "--repeat", "2", "--compare-fused", "--json", str(out)]
    assert main(argv + ["--profile"]) == 0
    results = json.loads(out.read_text())["results"]
    want = sum(e1(0.05).max_tokens)
    assert [r["variant"] for r in results] == [
        "run 1/2",
        "run 2/2",
        "profiled",
        "unfused RMSNorm/SiLU/rotary",
    ]
    assert results[3]["extra"]["fused_speedup"] > 0
    # --profile: a rerun's time by kernel class (on the CPU, operators' self time), within its wall time
    b = results[2]["extra"]["breakdown"]
    assert b["steps"] == results[2]["steps"] > 0 and b["wall_s"] == pytest.approx(
        results[2]["seconds"], abs=1e-3
    )
    assert b["device_s_by_class"]["GEMM (linear layers, LM head)"] > 0
    assert 0 < b["device_busy_s"] <= b["wall_s"] and set(b["host_ms_per_step"]) == {
        "schedule",
        "prepare and launch",
        "postprocess",
    }
    assert all("breakdown" not in r["extra"] for i, r in enumerate(results) if i != 2)
    for r in results:  # ignore_eos: every run produces exactly E1's output tokens
        assert r["workload"] == "E1" and r["output_tokens"] == want and r["output_tok_s"] > 0
    # Each run's prompts are shifted away from the other runs' and the warm-ups': no cache hits.
    assert [r["extra"]["prefix_cache_hit_rate"] for r in results] == [0.0, 0.0, 0.0, 0.0]


def test_tensor_parallel_run_reports_its_size(tmp_path, capsys, monkeypatch):
    """`--tensor-parallel-size 2` (gloo on CPU): the same E1 tokens, and the size in the JSON; the
    engine build is timed on stdout and `--dump-traceback-after` reaches the workers' environment."""
    import os

    from tilellm.cli import main
    from tilellm.testing import make_tiny_model
    from tilellm.worker.tp_worker import DUMP_ENV

    monkeypatch.delenv(DUMP_ENV, raising=False)  # restored after the test
    model = make_tiny_model(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "tp2.json"
    argv = ["bench", "throughput", "--workloads", "E1", "--scale", "0.05", "--model", str(model)]
    argv += ["--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2", "--json", str(out)]
    argv += ["--dump-traceback-after", "900"]
    assert main(argv) == 0
    assert os.environ[DUMP_ENV] == "900.0"
    printed = capsys.readouterr().out
    assert "# building the engine (tensor_parallel_size=2)" in printed and "# engine ready in" in printed
    (result,) = json.loads(out.read_text())["results"]
    assert result["extra"]["tensor_parallel_size"] == 2
    assert result["output_tokens"] == sum(e1(0.05).max_tokens)


def test_qwen3_8b_shape_has_qwen3_8b_parameter_count():
    """`--model-shape qwen3-8b` is Qwen3-8B's architecture: 8.19 B parameters (counted on the meta
    device by transformers' own Qwen3 class)."""
    import torch
    import transformers

    from tilellm.testing import QWEN3_8B_CONFIG

    cfg = {k: v for k, v in QWEN3_8B_CONFIG.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    n = sum(p.numel() for p in model.parameters())
    assert 8.18e9 < n < 8.20e9, n
