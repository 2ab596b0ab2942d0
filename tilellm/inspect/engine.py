"""Inspections of a live engine: its last step and its block pool, as they were at that step.

The server runs `inspect_engine` through `AsyncEngine.call` / `EngineProcess.call`, i.e. in the
engine's thread or process between two steps, and gets back plain data (it pickles). Everything
is read in that one call, under the engine's lock, by `snapshot_engine`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

from tilellm.inspect.model import Inspection, inspect_step


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's last step and its KV pool at the moment of that step (plain, picklable data).

    Row i of the step: request `request_ids[i]` computed `query_lens[i]` tokens ending at
    `seq_lens[i]`, reading `block_tables[i]`. `ref_counts[b]` / `cached[b]`: physical block b.
    """

    request_ids: tuple[str, ...]
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_cached_tokens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    block_size: int
    kind: str
    ref_counts: tuple[int, ...]
    cached: tuple[bool, ...]
    num_released: int  # step rows whose blocks were released after the step (counted back in)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_lora_rank: int = 0  # MLA: the latent's width (head_dim is then the cached row's)
    prefill_head_dim: int | None = None  # MLA: the expanded heads' qk dim that prefill runs on
    prefill_v_head_dim: int | None = None  # MLA: and their v dim
    kv_bytes_per_token: int = 0
    kv_fp8: bool = False  # the cache holds e4m3 values (its own tiles and split rule)
    # DeepSeek-V3.2: per step row, (query tokens, fewest / most keys a token selected, fewest /
    # most pages those keys fall on, pages of the row's context) in the first layer
    selection: tuple[tuple[int, int, int, int, int, int], ...] = ()


def pool_at_step(
    request_ids: list[str],
    block_tables: list[list[int]],
    ref_counts: list[int],
    live: list[tuple[str, list[int]]],
) -> tuple[list[int], int]:
    """Reference counts as they were when the step ran, from the counts and the running tables now.

    Between a step and the next call into the engine, its postprocessing may have finished a
    sequence (or an abort / preemption removed one): its blocks lost their references, and they
    are counted back here. With asynchronous scheduling the next step is already scheduled: the
    blocks it added to a step row's table are not counted. `live` holds (request id, block table)
    of every running sequence now. Returns (counts, rows counted back).
    """
    refs = list(ref_counts)
    unmatched = [(rid, list(t)) for rid, t in live]
    released = 0
    for rid, table in zip(request_ids, block_tables):
        table = list(table)
        same = (j for j, (lid, lt) in enumerate(unmatched) if lid == rid and lt[: len(table)] == table)
        j = next(same, None)
        if j is None:  # released after the step: finished, aborted or preempted
            released += 1
            for b in table:
                refs[b] += 1
        else:
            for b in unmatched.pop(j)[1][len(table) :]:
                refs[b] -= 1
    return refs, released


def snapshot_engine(engine: Any) -> EngineSnapshot:
    """Read the last step, the pool and the running sequences of an `LLMEngine` in one go.

    Call it where the engine runs (its thread or process, between steps); it also holds the
    engine's lock, so a caller on another thread never sees half a step.
    """
    with getattr(engine, "_lock", None) or contextlib.nullcontext():
        step = engine.last_step
        if step is None:
            raise ValueError("the engine has not run a step yet: nothing to inspect")
        pool = engine.block_manager.snapshot()
        live = [(str(s.request.request_id), list(s.block_table)) for s in engine.scheduler.running]
    tables = [[int(b) for b in t] for t in step.block_tables]
    ids = [str(r) for r in step.request_ids]
    refs, released = pool_at_step(ids, tables, list(pool.ref_counts), live)
    cfg = engine.model_config
    num_q_heads = int(cfg.num_attention_heads)
    num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_q_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_q_heads)
    kv_lora_rank = int(getattr(cfg, "kv_lora_rank", None) or 0)
    prefill_head_dim = prefill_v_head_dim = None
    if kv_lora_rank:  # MLA: one cached row per token; prefill expands it to qk_head_dim heads
        num_kv_heads, head_dim = 1, kv_lora_rank + int(cfg.qk_rope_head_dim)
        prefill_head_dim = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        prefill_v_head_dim = int(cfg.v_head_dim)
    selection = _selection(engine, step, tables)
    return EngineSnapshot(
        request_ids=tuple(ids),
        query_lens=tuple(int(q) for q in step.query_lens),
        seq_lens=tuple(int(n) for n in step.seq_lens),
        num_cached_tokens=tuple(int(c) for c in step.num_cached_tokens),
        block_tables=tuple(tuple(t) for t in tables),
        block_size=int(step.block_size),
        kind=step.kind or "step",
        ref_counts=tuple(refs),
        cached=tuple(bool(h) for h in pool.block_hash_set),
        num_released=released,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=str(getattr(engine.runner, "dtype", "bfloat16")).replace("torch.", ""),
        kv_lora_rank=kv_lora_rank,
        prefill_head_dim=prefill_head_dim,
        prefill_v_head_dim=prefill_v_head_dim,
        kv_bytes_per_token=int(getattr(engine.runner, "kv_bytes_per_token", 0) or 0),
        kv_fp8=str(getattr(engine.runner, "kv_dtype", "")) == "torch.float8_e4m3fn",
        selection=selection,
    )


def _selection(engine: Any, step: Any, tables: list[list[int]]) -> tuple:
    """How the last step's query tokens selected their keys (sparse attention's first layer):
    per step row, (tokens, min / max keys selected, min / max distinct pages, context pages)."""
    layers = engine.runner.model.attention_layers()
    chosen = getattr(layers[0], "last_topk_indices", None) if layers else None
    if chosen is None:
        return ()
    chosen = chosen.cpu()
    rows, start, block = [], 0, int(step.block_size)
    for q_len, seq_len, table in zip(step.query_lens, step.seq_lens, tables):
        picks = chosen[start : start + int(q_len)]
        start += int(q_len)
        counts, pages = [], []
        for row in picks:
            keys = row[row >= 0]
            counts.append(int(keys.numel()))
            pages.append(len({table[int(k) // block] for k in keys if int(k) // block < len(table)}))
        if counts:
            context_pages = -(-int(seq_len) // block)
            rows.append((int(q_len), min(counts), max(counts), min(pages), max(pages), context_pages))
    return tuple(rows)


def inspect_snapshot(
    snap: EngineSnapshot, *, title: str | None = None, num_splits: int | None = None
) -> Inspection:
    """The inspection of an `EngineSnapshot` (pure: no engine needed)."""
    insp = inspect_step(
        request_ids=list(snap.request_ids),
        query_lens=list(snap.query_lens),
        seq_lens=list(snap.seq_lens),
        num_cached_tokens=list(snap.num_cached_tokens),
        block_tables=[list(t) for t in snap.block_tables],
        block_size=snap.block_size,
        pool_ref_counts=list(snap.ref_counts),
        pool_cached={b for b, c in enumerate(snap.cached) if c},
        num_q_heads=snap.num_q_heads,
        num_kv_heads=snap.num_kv_heads,
        head_dim=snap.head_dim,
        dtype=snap.dtype,
        title=title or f"engine step ({snap.kind}, {len(snap.request_ids)} requests)",
        num_splits=num_splits,
        kv_lora_rank=snap.kv_lora_rank,
        prefill_head_dim=snap.prefill_head_dim,
        prefill_v_head_dim=snap.prefill_v_head_dim,
        kv_bytes_per_token=snap.kv_bytes_per_token,
        kv_fp8=snap.kv_fp8,
    )
    if snap.selection:
        lines = [
            f"req {i}: {n} token(s) selected {lo}-{hi} keys on {plo}-{phi} of {ctx} pages"
            for i, (n, lo, hi, plo, phi, ctx) in enumerate(snap.selection)
        ]
        note = (
            "sparse attention: every step ran sparse_mla_attention over each token's top-k keys "
            "(the schedule above is the dense kernel's for this batch); layer 0's selection: "
        ) + "; ".join(lines[:8])
        if len(lines) > 8:
            note += f"; ... {len(lines) - 8} more"
        insp = dataclasses.replace(insp, notes=insp.notes + (note,))
    if snap.num_released:
        note = (
            f"{snap.num_released} request(s) of this step finished (or left) after it: "
            "the page map shows their blocks as the step read them"
        )
        insp = dataclasses.replace(insp, notes=insp.notes + (note,))
    return insp


def inspect_engine(engine: Any, *, title: str | None = None, num_splits: int | None = None) -> Inspection:
    """The inspection of an `LLMEngine`'s last step and its pool at that step (`snapshot_engine`)."""
    return inspect_snapshot(snapshot_engine(engine), title=title, num_splits=num_splits)


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
