"""`tilellm bench throughput` end to end on a tiny model (CPU: reference attention), E1 scaled down."""

from __future__ import annotations

import json

from tilellm.bench.throughput import e1


def test_e1_repeats_and_unfused_variant(tmp_path):
    from tilellm.cli import main
    from tilellm.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "e1.json"
    argv = ["bench", "throughput", "--workloads", "E1", "--scale", "0.02", "--model", str(model)]
    argv += ["--dtype", "float32", "--device", "cpu", "--repeat", "2", "--compare-fused", "--json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    want = sum(e1(0.02).max_tokens)
    assert [r["variant"] for r in results] == ["run 1/2", "run 2/2", "unfused RMSNorm/SiLU/rotary"]
    assert results[2]["extra"]["fused_speedup"] > 0
    for r in results:  # ignore_eos: every run produces exactly E1's output tokens
        assert r["workload"] == "E1" and r["output_tokens"] == want and r["output_tok_s"] > 0
    # The second run's prompts are shifted: nothing of the first run is found in the prefix cache.
    assert results[1]["extra"]["prefix_cache_hit_rate"] == 0.0
