"""`inspect_engine` (the server's GET /inspect) shows the KV pool as the inspected step read it."""

from __future__ import annotations

import pickle

import pytest

from tilellm.engine.llm_engine import LLMEngine
from tilellm.engine.sampling_params import SamplingParams
from tilellm.inspect import inspect_engine, pool_at_step, snapshot_engine
from tilellm.testing import make_tiny_model

BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM", seed=1))


def _engine(model: str, monkeypatch, *, async_scheduling: bool) -> tuple[LLMEngine, list[list[int]]]:
    """An engine that records every block's reference count at each launch (what the step reads)."""
    engine = LLMEngine(model, num_kv_blocks=32, block_size=BLOCK, max_model_len=128, max_num_seqs=4)
    engine.async_scheduling = async_scheduling
    at_launch: list[list[int]] = []
    launch = engine.runner.launch

    def recording_launch(*args, **kwargs):
        at_launch.append(list(engine.block_manager.ref_counts))
        return launch(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", recording_launch)
    # Prompts of whole blocks: the next token needs a new block, so the pool changes at once.
    engine.add_request("short", list(range(1, 2 * BLOCK + 1)), SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request(
        "long",
        list(range(3, 3 * BLOCK + 3)),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    return engine, at_launch


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_pool_is_the_one_the_step_read(model, monkeypatch, async_scheduling):
    engine, at_launch = _engine(model, monkeypatch, async_scheduling=async_scheduling)
    while engine.last_step is None:
        engine.step()
    # "short" finished when this step's tokens were read, and its blocks went back to the pool.
    assert "short" not in engine.requests
    now = engine.block_manager.snapshot().ref_counts
    step_pool = at_launch[-2] if async_scheduling else at_launch[-1]
    assert now != step_pool  # the pool has moved on since the step

    insp = inspect_engine(engine)
    assert [r.request_id for r in insp.requests] == ["short", "long"]
    assert [b.ref_count for b in insp.pool.blocks] == step_pool
    for r in insp.requests:  # every block a request of the step read is held, none looks free
        assert all(insp.pool.blocks[b].state in ("used", "shared") for b in r.block_table)
    assert any("finished" in n for n in insp.notes)
    # The server runs it in the engine's process: the function and its result cross a pipe.
    assert pickle.loads(pickle.dumps(insp)) == insp
    assert pickle.loads(pickle.dumps(inspect_engine)) is inspect_engine


def test_snapshot_before_any_step_is_a_clear_error(model):
    engine = LLMEngine(model, num_kv_blocks=8, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="has not run a step"):
        snapshot_engine(engine)


def test_pool_at_step_counts_back_released_and_drops_later_blocks():
    # Step: "a" read blocks [0, 1], "b" read [0, 3]. Since then "b" finished (its references are
    # gone) and the next step gave "a" block 2; "c" (not in the step) holds block 4 then and now.
    refs, released = pool_at_step(
        ["a", "b"],
        [[0, 1], [0, 3]],
        ref_counts=[1, 1, 1, 0, 1],
        live=[("c", [4]), ("a", [0, 1, 2])],
    )
    assert refs == [2, 1, 0, 1, 1] and released == 1


def test_mla_engine_step_shows_the_latent_cache(tmp_path):
    """A DeepSeek (MLA) engine's step: one KV "head" of the latent row's width, the latent
    kernel's schedule, and the cache's bytes per token (a third of a GQA cache of this size)."""
    from tilellm import LLM, SamplingParams
    from tilellm.inspect import inspect_engine
    from tilellm.testing import make_tiny_moe_model

    model = make_tiny_moe_model(tmp_path / "deepseek", "DeepseekV2ForCausalLM")
    llm = LLM(str(model), num_kv_blocks=16)
    engine = llm.llm_engine
    engine.add_request("a", list(range(1, 21)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # the prompt: prefill on the expanded heads (qk 32, v 24)
    prefill = inspect_engine(engine)
    assert prefill.schedule.kernel == "prefill_attention"
    engine.step()  # one decode token: the latent kernel
    insp = inspect_engine(engine)
    assert (insp.num_q_heads, insp.num_kv_heads, insp.head_dim) == (4, 1, 32 + 16)
    assert insp.schedule.kernel == "mla_decode_attention"
    assert len(insp.schedule.programs) == insp.schedule.grid[0] * insp.schedule.grid[1]
    assert insp.schedule.num_full + insp.schedule.num_diagonal >= 1
    assert any("MLA" in n for n in insp.notes)
    per_token = 3 * (32 + 16) * 4  # 3 layers x one fp32 row of 48
    assert any(f"{per_token:,} bytes per token" in n for n in insp.notes)
    assert per_token * 3 < 3 * 2 * 4 * (32 + 24) * 4  # MHA's K and V of the same heads


def test_sparse_engine_step_shows_the_selection(tmp_path):
    """DeepSeek-V3.2: the inspector reports how many keys each query token selected (at most the
    indexer's top 8) and on how many pages they lie."""
    from tilellm import LLM, SamplingParams
    from tilellm.inspect import inspect_engine
    from tilellm.testing import make_tiny_moe_model

    model = make_tiny_moe_model(tmp_path / "v32", "DeepseekV32ForCausalLM", q_lora_rank=48)
    llm = LLM(str(model), num_kv_blocks=16, block_size=4)
    engine = llm.llm_engine
    engine.add_request("a", list(range(1, 21)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # 20 prompt tokens: token j selects min(j + 1, 8) keys
    snap_note = [n for n in inspect_engine(engine).notes if n.startswith("sparse attention")]
    assert snap_note and "req 0: 20 token(s) selected 1-8 keys" in snap_note[0]
    assert "of 5 pages" in snap_note[0]  # 20 keys in blocks of 4
    engine.step()  # one decode token over 21 keys: 8 selected
    note = next(n for n in inspect_engine(engine).notes if n.startswith("sparse attention"))
    assert "req 0: 1 token(s) selected 8-8 keys" in note and "of 6 pages" in note
