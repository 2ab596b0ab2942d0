"""Inspections of a live engine: its last step and its block pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tilellm.inspect.model import Inspection, inspect_step


def inspect_engine(engine: Any, *, title: str | None = None, num_splits: int | None = None) -> Inspection:
    """The inspection of `engine.last_step` (an `LLMEngine` that has run at least one step)."""
    snap = engine.last_step
    if snap is None:
        raise ValueError("the engine has not run a step yet: nothing to inspect")
    pool = engine.block_manager.snapshot()
    cfg = engine.model_config
    num_q_heads = int(cfg.num_attention_heads)
    num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_q_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_q_heads)
    dtype = str(getattr(engine.runner, "dtype", "bfloat16")).replace("torch.", "")
    cached = {b for b, hashed in enumerate(pool.block_hash_set) if hashed}
    return inspect_step(
        request_ids=list(snap.request_ids),
        query_lens=list(snap.query_lens),
        seq_lens=list(snap.seq_lens),
        num_cached_tokens=list(snap.num_cached_tokens),
        block_tables=[list(t) for t in snap.block_tables],
        block_size=snap.block_size,
        pool_ref_counts=list(pool.ref_counts),
        pool_cached=cached,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        title=title or f"engine step ({snap.kind or 'step'}, {len(snap.request_ids)} requests)",
        num_splits=num_splits,
    )


def demo_inspection(
    *,
    model: str | Path | None = None,
    device: str | None = None,
    attention_backend: str = "auto",
    num_kv_blocks: int | None = 64,
    block_size: int = 16,
    num_splits: int | None = None,
    first_wave: int = 2,
    second_wave: int = 6,
) -> Inspection:
    """Run the embedded model for two steps and inspect the second, a mixed step.

    Step 1 prefills `first_wave` requests (their prompt blocks enter the prefix cache); then
    `second_wave` more arrive, so step 2 decodes the first ones while the new ones prefill after
    the shared instruction, found in the cache.
    """
    from tilellm.assets import default_model_path, demo_metadata
    from tilellm.demo.task import problems_for_model
    from tilellm.engine.llm_engine import LLMEngine
    from tilellm.engine.sampling_params import SamplingParams

    model_dir = Path(model) if model is not None else default_model_path()
    problems = problems_for_model(demo_metadata(model_dir), first_wave + second_wave, seed=7)
    engine = LLMEngine(
        str(model_dir),
        device=device,
        attention_backend=attention_backend,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_num_seqs=max(8, first_wave + second_wave),
    )
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for i, p in enumerate(problems[:first_wave]):
        engine.add_request(f"q{i}", p.prompt, params)
    engine.step()
    for i, p in enumerate(problems[first_wave:], start=first_wave):
        engine.add_request(f"q{i}", p.prompt, params)
    engine.step()
    return inspect_engine(
        engine,
        title=f"{model_dir.name}: engine step 2 (mixed decode + prefix-cached prefill)",
        num_splits=num_splits,
    )
