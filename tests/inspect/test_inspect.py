"""The inspector's model, text and HTML agree with the batch and with the kernels' tile schedule."""

from __future__ import annotations

import html
import re

import pytest

from tests.inspect.pagecheck import TILE_CLASSES, Elements, expected_facts
from tilellm.inspect import describe_batch, parse_batch, parse_heads, render_html, render_text, words
from tilellm.inspect.geometry import tile_runs, visible_fraction
from tilellm.inspect.html import MAX_ROW_PX, MIN_ROW_PX, matrix_scale
from tilellm.inspect.tiles import paged_schedule, prefill_schedule

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
    assert words.split_plan(insp) in text and words.idle_programs(insp) in text


README_BATCH = ("1:1328,6:300,129:463", dict(num_q_heads=32, num_kv_heads=8, head_dim=128, shared_prefix=256))


def test_plain_words_for_idle_programs_and_the_split_plan():
    """Both renderers say what happens (programs exiting, the plan's aim), not the rule's shorthand."""
    insp = describe_batch(README_BATCH[0], **README_BATCH[1])
    idle = insp.schedule.num_empty_programs
    assert idle > 0
    sentence = f"{idle} programs find their query tile past the request's end and exit immediately"
    # 33 requests x 8 KV heads: two programs per SM (the small-batch rule's bound), so only the
    # long request's keys are cut
    split = describe_batch([(1, 3000)] + [(1, 40)] * 32, num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert split.schedule.split_plan.num_splits > 1
    aim = f"the split plan aims for 16 programs per SM, {16 * split.schedule.split_plan.num_sms} on"
    for render in (render_text, render_html):
        # What a reader sees: the text, not the data-* attributes kept for scripts.
        page, split_page = (html.unescape(re.sub(r"<[^>]*>", " ", render(i))) for i in (insp, split))
        assert sentence in page
        assert aim in split_page and "cut into 2 segments" in split_page
        for jargon in ("exit at once", "exits at once", "target 16 per SM", "(target "):
            assert jargon not in page and jargon not in split_page, jargon
    # A small batch (6 programs): even short requests are cut, into short segments.
    small = words.split_plan(describe_batch("1:40,1:700,1:3000", num_q_heads=8, num_kv_heads=2, head_dim=128))
    assert "cut into 16 segments" in small and "fewer programs than the GPU's 132 SMs" in small, small
    forced = describe_batch("6:70,1:33,20:20", num_q_heads=4, num_kv_heads=4, head_dim=64, num_splits=3)
    assert "because --num-splits 3 asks for it" in words.split_plan(forced)
    prefill = describe_batch("48,100,7", num_q_heads=4, num_kv_heads=2, head_dim=64)
    assert "does not split keys" in words.split_plan(prefill)


def _boxes(page: str) -> list[tuple[float, float]]:
    """(width, height) of each request's box in the attention matrix, in document order."""
    el = Elements(page)
    return [(float(a["width"]), float(a["height"])) for a in el.with_class("req-box")]


@pytest.mark.parametrize("batch,kw", [README_BATCH] + BATCHES, ids=["readme"] + [b for b, _ in BATCHES])
def test_matrix_has_one_scale_for_all_requests(batch, kw):
    """A row is one new token and a column one key at the same size in every request's box."""
    insp = describe_batch(batch, **kw)
    row_px, key_px = matrix_scale(insp)
    assert MIN_ROW_PX <= row_px <= MAX_ROW_PX
    page = render_html(insp)
    svg = Elements(page).by_id("attention-matrix")
    assert float(svg["data-row-px"]) == pytest.approx(row_px, abs=1e-3)
    assert float(svg["data-key-px"]) == pytest.approx(key_px, abs=1e-3)
    boxes = _boxes(page)
    assert len(boxes) == len(insp.requests)
    for r, (w, h) in zip(insp.requests, boxes):
        assert w == pytest.approx(r.seq_len * key_px, abs=0.01)
        assert h == pytest.approx(r.q_len * row_px, abs=0.01)


def test_decode_is_a_row_and_long_prefill_is_not_squeezed():
    insp = describe_batch("1:1328,4096", num_q_heads=8, num_kv_heads=2, head_dim=64, kernel="paged")
    (_, decode_h), (prefill_w, prefill_h) = _boxes(render_html(insp))
    assert decode_h == pytest.approx(matrix_scale(insp)[0]) and decode_h <= MAX_ROW_PX
    assert prefill_h >= 4096 * MIN_ROW_PX  # the page scrolls instead
    assert prefill_w >= 900


def test_legend_swatches_use_the_tiles_own_classes():
    """Each tile-class swatch is drawn with the matrix's classes, over the same attended layer."""
    el = Elements(render_html(describe_batch(README_BATCH[0], **README_BATCH[1])))
    legend = el.with_class("legend-item")
    assert [a["data-legend"] for a in legend][:4] == ["visible", "full", "diagonal", "skipped"]
    swatches = {a["data-tile-class"] for a in el.with_class("swatch-tile")}
    assert swatches == set(TILE_CLASSES)


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
    bars = [a for a in el.with_class("cached-prefix") if "data-request" in a]  # not the legend's
    assert len(bars) == sum(r.num_cached_tokens > 0 for r in reqs) >= 4
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


def test_hopper_chunks_read_as_persistent_tiles(monkeypatch):
    """Chunk batches that hopper.py serves on Hopper: the report counts tiles of query heads,
    run by one persistent program per SM, and says the counter skips tiles past a request's end
    (the text and the page agree)."""
    from tilellm.kernels import config

    monkeypatch.setattr(config, "hopper", lambda *a: True)
    monkeypatch.setattr(config, "interpreting", lambda: False)
    insp = describe_batch(
        "128:2000,128:2000,128:2000,128:2000,300:301", num_q_heads=32, num_kv_heads=8, head_dim=128
    )
    s = insp.schedule
    assert s.kernel == "paged_attention (hopper.py)" and s.persistent
    assert insp.schedule_head == "query head"
    empty = sum(1 for p in s.programs if p.first_kv_tile < 0)
    assert empty == 4 * 32 * 2  # the four 128-token chunks' second and third query tiles
    text = render_text(insp)
    assert f"tiles {s.grid} = {len(s.programs)}" in text
    assert "claimed in this order by one persistent program per SM" in text
    assert f"{empty} tiles lie past their request's end" in text and "moves the counter past the run" in text
    page = html.unescape(render_html(insp))
    assert f"{len(s.programs)} tiles, claimed in this order by one persistent program per SM" in page
    assert f"{len(s.programs)} tiles, each one query tile of one request on one query head, claimed" in page
    assert f"{empty} tiles lie past their request's end" in page
    plain = describe_batch("1:1328,5:18,129:463", num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert not plain.schedule.persistent and "launch grid" in render_text(plain)
