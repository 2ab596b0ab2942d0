"""The inspector's model, text and HTML agree with the batch and with the kernels' tile schedule."""

from __future__ import annotations

import pytest

from tests.inspect.pagecheck import TILE_CLASSES, Elements, expected_facts
from tilellm.inspect import describe_batch, parse_batch, parse_heads, render_html, render_text
from tilellm.inspect.geometry import tile_runs, visible_fraction
from tilellm.kernels.schedule import paged_schedule, prefill_schedule

# (batch, kwargs): decode + verify + chunked prefill in one launch (vLLM's mix), plain prefill,
# long decodes that split, a forced split, a shared prefix, MHA, MQA.
BATCHES = [
    ("1:1328,5:18,129:463", dict(num_q_heads=32, num_kv_heads=8, head_dim=128)),
    ("48,100,7", dict(num_q_heads=4, num_kv_heads=2, head_dim=64)),
    ("1:40,1:700,1:3000", dict(num_q_heads=8, num_kv_heads=2, head_dim=128)),
    ("6:70,1:33,20:20", dict(num_q_heads=4, num_kv_heads=4, head_dim=64, num_splits=3)),
    ("10:42,10:42,1:43,1:43", dict(num_q_heads=4, num_kv_heads=2, head_dim=64, shared_prefix=32)),
    ("17:50,3:9", dict(num_q_heads=8, num_kv_heads=1, head_dim=32, block_size=4)),
]


def _ids(batch):
    return batch[0]


@pytest.mark.parametrize("batch,kw", BATCHES, ids=[b for b, _ in BATCHES])
def test_schedule_is_the_kernels(batch, kw):
    insp = describe_batch(batch, **kw)
    pairs = parse_batch(batch)
    q_lens = [q for q, _ in pairs]
    kv = [k for _, k in pairs]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    if all(q == k for q, k in pairs):
        ref = prefill_schedule(cu, max(q_lens), kw["num_q_heads"], kw["head_dim"])
    else:
        ref = paged_schedule(
            cu,
            kv,
            kw["num_q_heads"],
            kw["num_kv_heads"],
            kw["head_dim"],
            kw.get("block_size", 16),
            num_splits=kw.get("num_splits"),
        )
    assert insp.schedule.kernel == ref.kernel
    assert insp.schedule.grid == ref.grid
    assert insp.schedule.programs == ref.programs


@pytest.mark.parametrize("batch,kw", BATCHES, ids=[b for b, _ in BATCHES])
def test_tile_runs_match_geometry(batch, kw):
    """Every drawn run is where the schedule says, and its class fits what the queries see."""
    insp = describe_batch(batch, **kw)
    for req in insp.requests:
        counts = {c: 0 for c in TILE_CLASSES}
        for run in tile_runs(insp, req, head=0):
            counts[run.tile_class] += run.count
            (r0, r1), (c0, c1) = run.rows, run.cols
            assert 0 <= r0 < r1 <= req.q_len and 0 <= c0 < c1 <= req.seq_len
            f = visible_fraction(req, r0, r1, c0, c1)
            if run.tile_class == "full":
                assert f == 1.0, (req, run)
            elif run.tile_class == "skipped":
                assert f == 0.0, (req, run)
            else:
                assert f > 0.0, (req, run)
        assert counts == insp.tile_counts(request=req.index, head=0)


@pytest.mark.parametrize("batch,kw", BATCHES, ids=[b for b, _ in BATCHES])
def test_html_matches_batch(batch, kw):
    insp = describe_batch(batch, **kw)
    facts = expected_facts(insp)
    page = render_html(insp)
    assert (
        "<script src" not in page and "<link" not in page and "@import" not in page and "url(http" not in page
    )
    el = Elements(page)

    summary = el.by_id("summary")
    assert summary["data-kernel"] == facts["kernel"]
    assert int(summary["data-num-requests"]) == facts["num_requests"]
    assert int(summary["data-num-programs"]) == facts["num_programs"]
    for c in TILE_CLASSES:
        assert int(summary[f"data-tiles-{c}"]) == facts["all_tiles"][c]
    assert int(el.by_id("split-plan")["data-num-splits"]) == facts["num_splits"]

    rows = el.with_class("request-row")
    assert [(int(r["data-q-len"]), int(r["data-kv-len"])) for r in rows] == list(
        zip(facts["q_lens"], facts["kv_lens"])
    )
    assert len([a for t, a in el.items if t == "g" and "request" in a.get("class", "").split()]) == len(rows)

    drawn = {c: 0 for c in TILE_CLASSES}
    for t in el.with_class("tile"):
        drawn[t["data-tile-class"]] += int(t["data-tiles"])
    assert drawn == facts["head0_tiles"]
    programs = el.with_class("program")
    assert len(programs) == facts["head0_programs"]
    assert sum(int(p["data-full"]) for p in programs) == facts["head0_tiles"]["full"]

    per_req = el.with_class("tile-counts")
    assert [{c: int(r[f"data-{c}"]) for c in TILE_CLASSES} for r in per_req] == facts["per_request_tiles"]

    tables: dict[int, list[int]] = {}
    for b in el.with_class("table-block"):
        tables.setdefault(int(b["data-request"]), []).append(int(b["data-block"]))
    assert [tables.get(i, []) for i in range(len(rows))] == facts["block_tables"]
    block_size = kw.get("block_size", 16)
    assert [len(t) for t in facts["block_tables"]] == [-(-k // block_size) for k in facts["kv_lens"]]

    pool = el.with_class("pool-block")
    runs = el.with_class("pool-run")
    assert len(pool) + sum(int(r["data-count"]) for r in runs) == facts["num_blocks"]
    for b in pool:
        assert int(b["data-ref-count"]) == facts["ref_counts"][int(b["data-block"])]
    states = {k: 0 for k in facts["pool_states"]}
    for b in pool:
        states[b["data-state"]] += 1
    states["free"] += sum(int(r["data-count"]) for r in runs)
    assert states == facts["pool_states"]


def test_shared_prefix_blocks_are_reference_counted():
    insp = describe_batch(
        "10:42,10:42,1:43,1:43", num_q_heads=4, num_kv_heads=2, head_dim=64, shared_prefix=32
    )
    assert [r.block_table[:2] for r in insp.requests] == [(0, 1)] * 4
    assert [b.ref_count for b in insp.pool.blocks[:3]] == [4, 4, 1]
    assert insp.pool.count("shared") == 2
    assert all(r.num_cached_tokens == 32 for r in insp.requests)
    el = Elements(render_html(insp))
    shared = [b for b in el.with_class("pool-block") if b["data-state"] == "shared"]
    assert [int(b["data-ref-count"]) for b in shared] == [4, 4]


@pytest.mark.parametrize("batch,kw", BATCHES[:3], ids=[b for b, _ in BATCHES[:3]])
def test_text_matches_batch(batch, kw):
    insp = describe_batch(batch, **kw)
    text = render_text(insp)
    s = insp.schedule
    assert f"{len(insp.requests)} requests" in text
    assert f"full={s.num_full} diagonal={s.num_diagonal} skipped={s.num_skipped}" in text
    assert f"grid {s.grid}" in text
    for r in insp.requests:
        assert f"req {r.index} ({r.q_len}x{r.seq_len})" in text
        assert f"req {r.index:3d}: [" in text
    assert f"pool of {insp.pool.num_blocks} blocks" in text
    if s.split_plan is not None:
        assert s.split_plan.reason in text


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="q_len:kv_len"):
        parse_batch("1:2:3")
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        parse_batch("5:3")
    with pytest.raises(ValueError, match="multiple"):
        parse_heads("6/4")
    with pytest.raises(ValueError, match="shared_prefix"):
        describe_batch("5:18", shared_prefix=16)
    with pytest.raises(ValueError, match="prefill kernel"):
        describe_batch("5:18", kernel="prefill")


def test_cli_text_and_html(tmp_path, capsys):
    from tilellm.cli import main

    out = tmp_path / "page.html"
    assert (
        main(["inspect", "--batch", "1:300,4:20", "--heads", "8/2", "--head-dim", "64", "--html", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "launch grid" in printed and "page map" in printed and str(out) in printed
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert main(["inspect", "--batch", "3:1"]) == 2
    assert "q_len <= kv_len" in capsys.readouterr().err


def test_engine_step_inspection():
    """`tilellm inspect --demo`: the embedded model's second step, decodes next to cached prefills."""
    from tilellm.inspect.engine import demo_inspection

    insp = demo_inspection(device="cpu", num_kv_blocks=32, first_wave=2, second_wave=4)
    assert insp.source == "engine" and insp.schedule.kernel == "paged_attention"
    reqs = insp.requests
    assert [r.kind for r in reqs] == ["decode"] * 2 + ["extend"] * 4
    assert all(r.num_cached_tokens == 32 for r in reqs[2:])  # the instruction's two full blocks
    shared = reqs[2].block_table[:2]
    assert all(r.block_table[:2] == shared for r in reqs[2:])
    assert all(insp.pool.blocks[b].ref_count >= 4 and insp.pool.blocks[b].cached for b in shared)
    assert insp.pool.num_blocks == 32
    assert sum(b.ref_count for b in insp.pool.blocks) == sum(len(r.block_table) for r in reqs)
    el = Elements(render_html(insp))
    assert len(el.with_class("request-row")) == 6
    assert len(el.with_class("cached-prefix")) == sum(r.num_cached_tokens > 0 for r in reqs) >= 4
    text = render_text(insp)
    assert "engine" in text and "pool of 32 blocks" in text


def test_visible_fraction_closed_form():
    import random

    from tilellm.inspect.model import RequestView

    rng = random.Random(0)
    for _ in range(500):
        q = rng.randint(1, 40)
        ctx = rng.randint(0, 60)
        req = RequestView(0, "r", q, ctx + q, 0, ())
        r0 = rng.randint(0, q - 1)
        r1 = rng.randint(r0 + 1, q)
        c0 = rng.randint(0, ctx + q - 1)
        c1 = rng.randint(c0 + 1, ctx + q)
        seen = sum(min(max(ctx + r + 1 - c0, 0), c1 - c0) for r in range(r0, r1))
        assert visible_fraction(req, r0, r1, c0, c1) == pytest.approx(seen / ((r1 - r0) * (c1 - c0)))
