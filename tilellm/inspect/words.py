"""Plain sentences shared by the renderers: what the idle programs and the split plan do, and why.

The kernels' own `SplitPlan.reason` is written for people who know the split rule; these say
what happens to the programs and the keys, from the plan's numbers and the rule's constants.
"""

from __future__ import annotations

from tilellm.inspect.geometry import is_empty, query_rows
from tilellm.inspect.model import Inspection
from tilellm.kernels.schedule import (
    FILL_SHARE,
    FP8_KEYS_PER_SPLIT,
    FP8_PROGRAMS_PER_SM,
    MAX_SPLITS,
    MIN_CONTEXT_TO_SPLIT,
    MIN_KEYS_PER_SPLIT,
    SMALL_BATCH_MIN_KEYS,
    programs_per_sm,
    target_programs,
)

# how hopper.py runs its tiles (`TileSchedule.persistent`)
PERSISTENT_PROGRAMS = "claimed in this order by one persistent program per SM"


def idle_programs(insp: Inspection) -> str:
    """Why some programs of the grid do nothing: their query tile or key segment is past the end."""
    past_rows = past_keys = 0
    for p in insp.schedule.programs:
        if not is_empty(p):
            continue
        req = insp.requests[p.request]
        if query_rows(insp, req, p.q_tile)[0] >= req.q_len:
            past_rows += 1
        else:
            past_keys += 1
    if past_rows + past_keys == 0:
        return "every program has key tiles to read"
    if insp.schedule.persistent:
        most = max(p.q_tile for p in insp.schedule.programs) + 1
        return (
            f"{past_rows} tiles lie past their request's end (the numbering has room for {most} query "
            "tiles per request, as many as the longest request needs): a claim that lands on one moves "
            "the counter past the run, and no program spends time on them"
        )
    parts = []
    if past_rows:
        most = max(p.q_tile for p in insp.schedule.programs) + 1
        parts.append(
            f"{past_rows} programs find their query tile past the request's end and exit immediately "
            f"(the grid has room for {most} query tiles per request, as many as the longest request needs)"
        )
    if past_keys:
        parts.append(
            f"{past_keys} programs find their key segment past the request's end and exit immediately "
            "(a shorter request needs fewer segments)"
        )
    return "; ".join(parts)


def split_plan(insp: Inspection) -> str:
    """What the split-KV plan does to each program's keys and why, in one or two sentences."""
    s = insp.schedule
    plan = s.split_plan
    if plan is None:
        return f"the {s.kernel} kernel does not split keys: each program reads every key its query tile sees"
    n, base, sms = plan.num_splits, plan.base_programs, plan.num_sms
    per_sm = programs_per_sm(s.block_m)
    target = target_programs(s.block_m, sms)
    aim = f"the split plan aims for {per_sm:g} programs per SM, {target} on this GPU's {sms} SMs"
    if plan.reason.startswith("forced"):
        return (
            f"each program's keys are cut into {n} segment(s) because --num-splits {n} asks for it: "
            f"{base} programs become {base * n}"
        )
    if plan.min_keys_per_split == SMALL_BATCH_MIN_KEYS:
        return (
            f"each program's keys are cut into {n} segments, so {base} programs become {base * n}: a "
            f"batch of fewer programs than the GPU's {sms} SMs is bound by each program's walk over its "
            f"keys, so even short requests are cut, into segments of at least {SMALL_BATCH_MIN_KEYS} "
            "keys, whose partial results are merged afterwards"
        )
    if plan.kv_fp8:
        if n == 1:
            return f"keys are not split ({plan.reason})"
        return (
            f"each program's keys are cut into {n} segments, so {base} programs become {base * n}: an "
            f"FP8 cache holds half the bytes per key, so segments are about {FP8_KEYS_PER_SPLIT} keys "
            f"of the longest request (the bytes of {MIN_KEYS_PER_SPLIT} 16-bit keys), halved while "
            f"the programs are fewer than {FILL_SHARE:.0%} of {FP8_PROGRAMS_PER_SM} per SM; the "
            "segments' partial results are merged afterwards"
        )
    if n == 1 and plan.kv_len_per_split < MIN_CONTEXT_TO_SPLIT:
        return (
            f"keys are not split: the longest request has {plan.kv_len_per_split} keys, and the split "
            f"plan only cuts requests of at least {MIN_CONTEXT_TO_SPLIT} keys "
            f"(segments of {MIN_KEYS_PER_SPLIT} keys or more)"
        )
    if n == 1 and base >= FILL_SHARE * target:
        return (
            f"keys are not split: the {base} programs already keep the GPU busy ({aim}, "
            f"and splits only below {FILL_SHARE:.0%} of that)"
        )
    if n == 1:
        return f"keys are not split ({plan.reason})"
    cap = f" (at most {MAX_SPLITS})" if n == MAX_SPLITS else ""
    return (
        f"each program's keys are cut into {n} segments{cap}, so {base} programs become {base * n}: "
        f"{base} alone would leave most of the GPU idle ({aim}); each segment has at least "
        f"{MIN_KEYS_PER_SPLIT} keys of the longest request, and the segments' partial results are "
        "merged afterwards"
    )
