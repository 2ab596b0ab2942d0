"""`LLM.get_metrics()`: the engine's counters as vLLM spells them, step times included."""

from __future__ import annotations

from tilellm import LLM, SamplingParams
from tilellm.engine.metrics import Counter


def _values(llm: LLM) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}


def test_metrics_count_tokens_and_step_times(tiny_qwen3):
    llm = LLM(tiny_qwen3, num_kv_blocks=32)
    before = _values(llm)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    after = _values(llm)
    assert after["tilellm:prompt_tokens"] - before["tilellm:prompt_tokens"] == 5
    assert after["tilellm:generation_tokens"] - before["tilellm:generation_tokens"] == 10
    steps = after["tilellm:engine_steps"] - before["tilellm:engine_steps"]
    assert 5 <= steps <= 10  # the two requests batched: one step a token, a few more if not
    for phase in ("schedule", "prepare", "execute", "postprocess"):
        name = f"tilellm:engine_step_{phase}_seconds"
        assert after[name] > before[name] >= 0, name
