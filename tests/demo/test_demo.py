"""`tilellm demo` on the shipped model: accurate, prefix-cached, preempting under a small pool."""

from __future__ import annotations

import io
import json
import shutil

from tilellm.assets import default_model_path, demo_metadata
from tilellm.demo import run_demo


def test_demo_reaches_the_recorded_threshold():
    out = io.StringIO()
    res = run_demo(num_requests=24, arrivals_per_step=8, device="cpu", out=out)
    text = out.getvalue()
    assert len(res.answers) == 24
    assert res.threshold == demo_metadata()["accuracy_threshold"]
    assert res.passed, text
    # The first request fills the cache; every later one finds the shared instruction there
    # (2 full blocks of 16 tokens), at the latest from the next step on.
    assert res.steps[0].cache_hit_tokens <= 7 * 32
    assert sum(s.cache_hit_tokens for s in res.steps) == res.prefix_cache_hits
    assert res.prefix_cache_hits >= 16 * 32
    assert any(s.kind == "mixed" for s in res.steps)  # prefill joins running decodes
    assert all(s.kv_used <= s.kv_total for s in res.steps)
    assert "accuracy" in text and "PASS" in text and "output tok/s" in text
    for i, p in enumerate(res.problems[:3]):
        assert f"{p.question}={res.answers[i].strip()}" in text


def test_small_pool_preempts_and_still_answers():
    res = run_demo(num_requests=16, arrivals_per_step=16, device="cpu", num_kv_blocks=20, out=None)
    assert res.preemptions > 0
    assert len(res.answers) == 16
    assert res.passed
    assert max(s.kv_used for s in res.steps) <= 20


def test_cli_exit_codes(tmp_path, capsys):
    from tilellm.cli import main

    assert main(["demo", "--num-requests", "8", "--quiet"]) == 0
    assert "PASS" in capsys.readouterr().out

    # The same model with an unreachable threshold must fail the demo (exit 1).
    model = tmp_path / "model"
    shutil.copytree(default_model_path(), model)
    meta = json.loads((model / "tilellm_demo.json").read_text())
    meta["accuracy_threshold"] = 1.01
    (model / "tilellm_demo.json").write_text(json.dumps(meta))
    assert main(["demo", "--model", str(model), "--num-requests", "4", "--quiet"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_speculative_demo_shows_acceptance_in_its_step_lines():
    import io

    from tilellm.assets import copy_model_path
    from tilellm.demo import run_demo

    out = io.StringIO()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    result = run_demo(
        model=copy_model_path(), num_requests=8, out=out, engine_kwargs={"speculative_config": spec}
    )
    assert result.passed
    assert result.accepted_tokens > 0.5 * result.draft_tokens > 0
    text = out.getvalue()
    assert "draft  accepted" in text and "draft tokens accepted" in text
    assert sum(line.accepted_tokens for line in result.steps) == result.accepted_tokens
