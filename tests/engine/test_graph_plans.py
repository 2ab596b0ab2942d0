"""Which decode buckets get a second, no-split CUDA graph: the runner asks its attention
backend's split plan (CPU: the plan is computed for 132 SMs, as on an H100/H200)."""

from __future__ import annotations

from tilellm import LLM
from tilellm.kernels.schedule import MIN_CONTEXT_TO_SPLIT


def test_decode_graph_split_plan_follows_max_model_len(tmp_path):
    from tilellm.testing import make_tiny_model

    model = str(make_tiny_model(tmp_path / "m", max_position_embeddings=2 * MIN_CONTEXT_TO_SPLIT))
    # The Triton backend plans split-KV (the reference backend has nothing to split).
    long_ctx = LLM(model, num_kv_blocks=600, max_num_seqs=4, attention_backend="triton").llm_engine.runner
    assert long_ctx.max_model_len >= MIN_CONTEXT_TO_SPLIT
    assert long_ctx.decode_splits(1, long_ctx.max_model_len) > 1  # one request of a long context: split it
    short_ctx = LLM(
        model,
        num_kv_blocks=600,
        max_num_seqs=4,
        max_model_len=MIN_CONTEXT_TO_SPLIT - 1,
        attention_backend="triton",
    )
    short = short_ctx.llm_engine.runner
    assert short.decode_splits(1, short.max_model_len) == 1  # never long enough to split
