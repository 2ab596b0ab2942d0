"""`warmup_steps`: the made-up steps that compile the kernels before serving stay within what a
scheduled step can hold (its token budget, the model's length), and still reach every kind of
step (one request's tokens at short and long contexts, prefills, decodes, mixed steps)."""

from __future__ import annotations

import pytest

from tilellm.worker.model_runner import warmup_steps


@pytest.mark.parametrize("budget", [1, 7, 24, 137, 2048, 8192])
@pytest.mark.parametrize("max_model_len", [64, 4096, 40960])
def test_steps_fit_a_scheduled_step(budget, max_model_len):
    long_ctx = min(max_model_len, 4096)
    steps = warmup_steps(budget, max_model_len, long_ctx)
    assert steps and len({(tuple(q), tuple(s)) for q, s in steps}) == len(steps)
    for q_lens, seq_lens in steps:
        assert len(q_lens) == len(seq_lens) and sum(q_lens) <= budget, (q_lens, seq_lens)
        assert all(1 <= q <= s <= max_model_len for q, s in zip(q_lens, seq_lens)), (q_lens, seq_lens)
        prefill = len(q_lens) == 1 and q_lens == seq_lens
        assert prefill or max(seq_lens) <= long_ctx, (q_lens, seq_lens)
    cap = min(budget, max_model_len - 1)
    assert ([cap], [cap]) in steps  # the largest prefill chunk
    assert (([1] * 8, [long_ctx] * 8) in steps) == (budget >= 8)  # decodes, split over a long context
    assert any(len(q) > 1 and max(q) > 1 for q, _ in steps) == (budget > 2)  # decodes beside a chunk


def test_a_large_budget_keeps_every_variant():
    """With room for them: the query tiles past 128, the 8-decode mixed step with a 129-token chunk,
    and the chunk of the whole budget beside one decode."""
    steps = warmup_steps(8192, 40960, 4096)
    assert ([129], [4096]) in steps and ([1024], [1024]) in steps
    assert ([1] * 8 + [129], [4096] * 8 + [129]) in steps
    assert ([1, 4095], [4096, 4096]) in steps
