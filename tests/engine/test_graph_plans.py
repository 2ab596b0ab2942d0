"""Which decode buckets get a second, "short" CUDA graph: the runner asks its attention backend's
split plan for max_model_len and for contexts under MIN_CONTEXT_TO_SPLIT (CPU: the plan is
computed for 132 SMs, as on an H100/H200)."""

from __future__ import annotations

from tilellm import LLM
from tilellm.kernels.schedule import MIN_CONTEXT_TO_SPLIT, SMALL_BATCH_MIN_KEYS


def test_decode_graph_split_plan_follows_max_model_len(tmp_path):
    from tilellm.testing import make_tiny_model

    model = str(make_tiny_model(tmp_path / "m", max_position_embeddings=2 * MIN_CONTEXT_TO_SPLIT))
    # The Triton backend plans split-KV (the reference backend has nothing to split).
    long_ctx = LLM(model, num_kv_blocks=600, max_num_seqs=4, attention_backend="triton").llm_engine.runner
    assert long_ctx.max_model_len >= MIN_CONTEXT_TO_SPLIT
    splits = long_ctx.decode_splits
    # A small batch (fewer programs than SMs) splits short and long contexts alike, into segments
    # as short as SMALL_BATCH_MIN_KEYS keys: the short plan is the plain one, no second graph.
    assert splits(1, long_ctx.max_model_len) == splits(1, MIN_CONTEXT_TO_SPLIT - 1) > 1
    assert splits(1, 2 * SMALL_BATCH_MIN_KEYS - 1) == 1
    # A larger batch (200 requests of 2 KV heads: past the small-batch rule's bound) splits only
    # long contexts: its short graph has no split-KV.
    assert splits(200, long_ctx.max_model_len) > 1
    assert splits(200, MIN_CONTEXT_TO_SPLIT - 1) == 1
    short_ctx = LLM(
        model,
        num_kv_blocks=600,
        max_num_seqs=4,
        max_model_len=MIN_CONTEXT_TO_SPLIT - 1,
        attention_backend="triton",
    )
    short = short_ctx.llm_engine.runner
    assert short.decode_splits(200, short.max_model_len) == 1  # never long enough to split
