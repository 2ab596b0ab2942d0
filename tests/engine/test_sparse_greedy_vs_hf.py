"""DeepSeek-V3.2 (sparse MLA with the lightning indexer): greedy tokens == transformers' (fp32,
CPU) on a tiny random checkpoint whose indexer keeps 8 keys, fewer than most prompts hold, under
the engine settings the dense models pass, chunked prefill and preemption included."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from tests.engine.conftest import hf_greedy
from tests.engine.test_greedy_vs_hf import MAX_TOKENS, _prompts, expected, run_twice
from tests.engine.test_moe_greedy_vs_hf import MOE_CONFIGS
from tilellm import LLM, SamplingParams


def test_the_selection_changes_the_output(tiny_deepseek_v32, tmp_path):
    """The same weights with a selection wider than every prompt (dense attention) continue the
    prompts differently: the test below would catch an engine that ignored the indexer. The
    one-token prompt, whose context stays under 8 keys for 7 steps, agrees at first."""
    dense = tmp_path / "dense"
    shutil.copytree(tiny_deepseek_v32, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = 4096
    (dense / "config.json").write_text(json.dumps(cfg))
    sparse_out, dense_out = expected(tiny_deepseek_v32), hf_greedy(str(dense), _prompts(), MAX_TOKENS)
    assert sparse_out != dense_out
    assert sparse_out[0][:7] == dense_out[0][:7]
    assert len({tuple(w) for w in sparse_out}) == len(sparse_out)
    assert pathlib.Path(tiny_deepseek_v32, "config.json").read_text().count('"index_topk": 8') == 1


@pytest.mark.parametrize("config", list(MOE_CONFIGS))
def test_deepseek_v32_greedy_matches_hf(tiny_deepseek_v32, config):
    llm, first, second = run_twice(tiny_deepseek_v32, **MOE_CONFIGS[config])
    want = expected(tiny_deepseek_v32)
    assert first == want
    assert second == want
    stats = llm.llm_engine.get_stats()
    if config == "tiny_pool_preempts":
        assert stats.num_preemptions > 0
    if config in ("default", "block_size_1"):
        assert stats.prefix_cache_hits > 0


def test_triton_kernels_greedy_match_hf(tiny_deepseek_v32):
    """The Triton indexer, sparse MLA and MoE kernels under the interpreter."""
    prompts = _prompts()[:4]
    want = [w[:4] for w in expected(tiny_deepseek_v32)[:4]]
    llm = LLM(tiny_deepseek_v32, num_kv_blocks=32, attention_backend="triton", max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
