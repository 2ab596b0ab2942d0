"""Rejection sampling of drafts: the emitted tokens are distributed as the target distribution.

Goodness-of-fit tests on a tiny vocabulary: every call draws many independent rows (distinct seed
keys and/or steps), and the emitted counts are compared with the expected distribution through a
chi-square test at a fixed seed (deterministic). Each test also runs a deliberately wrong
procedure through the same check where that shows that the check has the power to fail.

p-values: the chi-square survival function is the regularised upper incomplete gamma function,
sf(x; df) = Q(df / 2, x / 2) (`torch.special.gammaincc`), so no scipy is needed;
`test_chi2_sf_helper` checks it against closed forms and a tabulated quantile.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tilellm.kernels.sampling import device_row_keys, gumbel_noise, seed_keys, uniform_noise
from tilellm.worker.rejection import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    DraftVerification,
    rejection_sample,
)
from tilellm.worker.sampler import Sampler, SamplingMetadata

N = 200_000  # rows per call: the draws of one test
ALPHA = 1e-4  # a correct procedure passes above this p-value
POWER_ALPHA = 1e-8  # a wrong procedure must fall below this one


# -- statistics ---------------------------------------------------------------------------------


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def gof_pvalue(samples: torch.Tensor, probs, num_categories: int | None = None) -> float:
    """Chi-square goodness-of-fit p-value of integer `samples` against `probs`.

    Categories of zero probability must hold no sample at all (asserted), and are left out of
    the statistic and the degrees of freedom."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    k = num_categories or len(probs)
    counts = np.bincount(samples.numpy().ravel(), minlength=k).astype(np.float64)
    assert len(counts) == len(probs), "a sample outside the categories"
    zero = probs == 0
    assert counts[zero].sum() == 0, f"samples in zero-probability categories: {np.flatnonzero(counts * zero)}"
    n = counts.sum()
    expected = n * probs[~zero]
    assert expected.min() >= 5, "too few expected counts for a chi-square test"
    stat = float(((counts[~zero] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int((~zero).sum()) - 1)


def test_chi2_sf_helper():
    # df = 2: sf(x) = exp(-x / 2) exactly.
    for x in (0.5, 3.0, 18.42):
        assert chi2_sf(x, 2) == pytest.approx(np.exp(-x / 2), rel=1e-10)
    # df = 1: sf(x) = erfc(sqrt(x / 2)).
    assert chi2_sf(10.0, 1) == pytest.approx(float(torch.special.erfc(torch.tensor(np.sqrt(5.0)))), rel=1e-6)
    # The 0.9999 quantile of chi-square(5) is 25.745 (standard chi-square tables).
    assert chi2_sf(25.745, 5) == pytest.approx(1e-4, rel=1e-3)
    # And a fair die passes, a loaded one fails.
    g = torch.Generator().manual_seed(0)
    fair = torch.multinomial(torch.full((6,), 1 / 6), 60_000, replacement=True, generator=g)
    assert gof_pvalue(fair, [1] * 6) > ALPHA
    assert gof_pvalue(fair, [1.1, 1, 1, 1, 1, 0.9]) < POWER_ALPHA


# -- inputs -------------------------------------------------------------------------------------


def row_keys_of(n: int, offset: int = 0) -> torch.Tensor:
    """[n] int64 seed keys of n distinct 64-bit seeds (as the sampling table computes them)."""
    return torch.from_numpy(seed_keys(np.arange(offset, offset + n, dtype=np.uint64)).astype(np.int64))


@functools.cache
def keyed_rows(
    scheme: str, n: int = N, offset: int = 0, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed_keys, steps) of n rows that must be independent draws.

    "seeds": n requests at their first output token; "steps": one request, n consecutive output
    tokens; "mixed": random requests at random steps.

    `check`: the rows must not hit the known defect tested at the end of this file (an infinite
    Gumbel noise, 2**-24 per vocabulary entry), in the sampler's stream or the residual's, so
    that the distribution tests test the algorithm; the offsets of the tests are chosen so."""
    if scheme == "seeds":
        keys, steps = row_keys_of(n, offset), torch.zeros(n, dtype=torch.int64)
    elif scheme == "steps":
        keys, steps = row_keys_of(1, offset).expand(n).clone(), torch.arange(n, dtype=torch.int64)
    else:
        assert scheme == "mixed"
        g = torch.Generator().manual_seed(offset + 1)
        keys, steps = row_keys_of(n, offset + 7919), torch.randint(0, 4096, (n,), generator=g)
    if check:
        for stream in (keys, keys ^ RESIDUAL_STREAM):
            finite = torch.isfinite(gumbel_noise(device_row_keys(stream, steps), 8)).all(dim=1)
            assert finite.all(), f"rows {torch.nonzero(~finite)[:, 0].tolist()} draw an infinite noise"
    return keys, steps


def draw(q: torch.Tensor, n: int = N, seed: int = 1234) -> torch.Tensor:
    """n draft tokens drawn from q by a generator of the test's own."""
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(q, n, replacement=True, generator=g)


def probs(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).to(torch.float32)


# Target p and proposal q on a vocabulary of 6 or 8.
P6 = probs(0.30, 0.25, 0.20, 0.12, 0.08, 0.05)
PAIRS = {
    "different": (P6, probs(0.05, 0.10, 0.15, 0.20, 0.25, 0.25)),
    "close": (P6, probs(0.28, 0.27, 0.19, 0.13, 0.08, 0.05)),
    "q-zero-where-p-has-mass": (P6, probs(0.0, 0.5, 0.0, 0.3, 0.2, 0.0)),
    "p-zero-where-q-has-mass": (probs(0.4, 0.0, 0.35, 0.0, 0.25, 0.0), probs(0.1, 0.3, 0.1, 0.3, 0.1, 0.1)),
    "q-one-hot": (P6, probs(0, 0, 1, 0, 0, 0)),
    "q-equals-p": (P6, P6.clone()),
    "vocab-8": (
        probs(0.02, 0.30, 0.01, 0.22, 0.15, 0.10, 0.12, 0.08),
        probs(0.20, 0.05, 0.20, 0.05, 0.10, 0.20, 0.10, 0.10),
    ),
}


def run_rejection(p: torch.Tensor, q: torch.Tensor, scheme: str, offset: int = 0, n: int = N):
    keys, steps = keyed_rows(scheme, n, offset)
    x = draw(q, n, seed=offset + 99)
    out = rejection_sample(p.expand(n, -1), x, q.expand(n, -1), keys, steps)
    return x, out


# -- full proposals -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["seeds", "steps", "mixed"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_full_proposals_emit_the_target_distribution(pair, scheme):
    p, q = PAIRS[pair]
    x, out = run_rejection(p, q, scheme, offset=1)
    assert out.dtype == torch.int64 and out.shape == (N,)
    assert gof_pvalue(out, p.double()) > ALPHA


@pytest.mark.parametrize("pair", list(PAIRS))
def test_full_proposals_accept_and_recover_as_leviathan(pair):
    """The joint law of (draft, emitted): x accepted with probability min(1, p(x) / q(x)), and a
    rejected x replaced by a draw from max(p - q, 0) (never x itself)."""
    p, q = (t.double() for t in PAIRS[pair])
    x, out = run_rejection(*PAIRS[pair], "mixed", offset=5)
    v = len(p)
    accept = torch.minimum(p, q)  # q(x) * min(1, p(x) / q(x))
    residual = (p - q).clamp_min(0)
    beta = accept.sum()
    joint = torch.diag(accept)
    if residual.sum() > 0:
        joint = joint + (q - accept)[:, None] * (residual / residual.sum())[None, :]
    assert float(joint.sum()) == pytest.approx(1.0)
    cells = x * v + out
    assert gof_pvalue(cells, joint.flatten(), v * v) > ALPHA
    # Acceptance rate (1 - total variation distance) on its own: a two-category test.
    accepted = (out == x).long()
    if 0 < beta < 1 - 1e-9:
        assert gof_pvalue(accepted, [1 - float(beta), float(beta)]) > ALPHA
    else:
        assert bool(accepted.all())


def _wrong_procedures(p, q, x, keys, steps):
    """Emitted tokens of three broken variants of the rejection sampler, with its own uniforms."""
    n = len(x)
    u = uniform_noise(device_row_keys(keys ^ ACCEPT_STREAM, steps))
    px, qx = p[x], q[x]
    accept = u * qx < px
    g = torch.Generator().manual_seed(77)
    from_p = torch.multinomial(p, n, replacement=True, generator=g)
    from_q = torch.multinomial(q, n, replacement=True, generator=g)
    return {
        "always accept": x,
        "resample from p when rejected": torch.where(accept, x, from_p),
        "resample from q when rejected": torch.where(accept, x, from_q),
    }


@pytest.mark.parametrize("pair", ["different", "close", "vocab-8"])
def test_the_goodness_of_fit_test_rejects_wrong_procedures(pair):
    """The same check as above fails for samplers that do not emit p: it has power."""
    p, q = PAIRS[pair]
    keys, steps = keyed_rows("mixed", N, 2)
    x = draw(q, N, seed=99)
    for name, out in _wrong_procedures(p, q, x, keys, steps).items():
        assert gof_pvalue(out, p.double()) < POWER_ALPHA, name


def test_full_proposals_consecutive_tokens_are_independent():
    """One request over many steps: the pair (token at step s, token at step s + 1) is p x p."""
    p, q = PAIRS["different"]
    x, out = run_rejection(p, q, "steps", offset=3)
    v = len(p)
    pairs = out[0::2] * v + out[1::2]
    assert gof_pvalue(pairs, torch.outer(p.double(), p.double()).flatten(), v * v) > ALPHA
    # Draft decisions are keyed by the step too: the acceptance indicators of consecutive steps
    # are independent (a 2 x 2 table against the product of the marginals).
    acc = (out == x).long()
    beta = float(torch.minimum(p, q).sum())
    m = torch.tensor([1 - beta, beta], dtype=torch.float64)
    assert gof_pvalue(acc[0::2] * 2 + acc[1::2], torch.outer(m, m).flatten(), 4) > ALPHA


# -- point-mass proposals (n-gram drafts): the sampler's ordinary draw against a fixed draft ----


def plain_metadata(
    keys: torch.Tensor, steps: torch.Tensor, temperature: float, **filters
) -> SamplingMetadata:
    n = len(keys)
    return SamplingMetadata(
        inv_temperature=torch.full((n,), 1.0 / temperature),
        seed_keys=keys,
        steps=steps,
        all_greedy=False,
        **filters,
    )


LOGITS8 = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.5, 0.9, 0.0, -0.7])


@pytest.mark.parametrize("scheme", ["seeds", "steps", "mixed"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("x", [3, 6])
def test_point_mass_draft_is_accepted_with_probability_p_of_x(x, temperature, scheme):
    keys, steps = keyed_rows(scheme, N, offset=12)
    md = plain_metadata(keys, steps, temperature)
    tokens = Sampler()(LOGITS8.expand(N, -1), md).token_ids
    p = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    hit = (tokens == x).long()
    px = float(p[x])
    assert gof_pvalue(hit, [1 - px, px]) > ALPHA
    # Rejected: the draw is p conditioned on not being x (the residual of a point mass).
    others = tokens[tokens != x]
    conditional = p.clone()
    conditional[x] = 0
    assert gof_pvalue(others, conditional) > ALPHA


def test_point_mass_conditional_check_has_power():
    keys, steps = keyed_rows("mixed", N, offset=12)
    tokens = Sampler()(LOGITS8.expand(N, -1), plain_metadata(keys, steps, 1.0)).token_ids
    p = torch.softmax(LOGITS8.double(), dim=-1)
    # Rejected draws re-weighted wrongly (all of p, or the draft token folded into another one).
    with pytest.raises(AssertionError, match="zero-probability"):
        gof_pvalue(tokens, torch.where(torch.arange(8) == 3, 0.0, p))
    others = tokens[tokens != 3]
    wrong = p.clone()
    wrong[3] = 0
    wrong[0] += p[3]  # as if a rejected draft's mass went to token 0
    assert gof_pvalue(others, wrong) < POWER_ALPHA
    # And a constant acceptance rate that is not p(x) fails the two-category test.
    hit = (tokens == 3).long()
    assert gof_pvalue(hit, [1 - float(p[3]) - 0.01, float(p[3]) + 0.01]) < POWER_ALPHA


def test_point_mass_consecutive_draws_are_independent():
    keys, steps = keyed_rows("steps", N, offset=21)
    tokens = Sampler()(LOGITS8.expand(N, -1), plain_metadata(keys, steps, 1.6)).token_ids
    p = torch.softmax(LOGITS8.double() / 1.6, dim=-1)
    pairs = tokens[0::2] * 8 + tokens[1::2]
    assert gof_pvalue(pairs, torch.outer(p, p).flatten(), 64) > ALPHA


@pytest.mark.parametrize("x", [0, 3, 7])
def test_rejection_sample_with_one_hot_q_matches_the_point_mass_rule(x):
    """A one-hot q through `rejection_sample`: accepted with p(x), else p without x."""
    p = torch.softmax(LOGITS8 / 0.9, dim=-1)
    q = torch.zeros(8)
    q[x] = 1
    keys, steps = keyed_rows("mixed", N, offset=31)
    out = rejection_sample(p.expand(N, -1), torch.full((N,), x), q.expand(N, -1), keys, steps)
    px = float(p[x])
    assert gof_pvalue((out == x).long(), [1 - px, px]) > ALPHA
    conditional = p.double().clone()
    conditional[x] = 0
    assert gof_pvalue(out[out != x], conditional) > ALPHA


# -- the sampler with filters and full proposals -----------------------------------------------


def filtered_target(logits: np.ndarray, temperature: float, top_k=None, top_p=None, min_p=None):
    """The distribution a step samples from, computed independently: temperature, then min-p
    (relative to the most likely token), top-k (the k most likely left) and top-p (the smallest
    set of most likely tokens, renormalised after top-k, whose mass reaches top_p)."""
    z = logits.astype(np.float64) / temperature
    full = np.exp(z - z.max())
    full /= full.sum()
    keep = np.ones(len(z), dtype=bool)
    if min_p is not None:
        keep &= full >= min_p * full.max()
    order = [int(i) for i in np.argsort(-z, kind="stable") if keep[i]]
    if top_k is not None:
        order = order[:top_k]
    if top_p is not None:
        mass = full[order] / full[order].sum()
        kept, before = [], 0.0
        for i, m in zip(order, mass):
            if before > top_p:
                break
            kept.append(i)
            before += m
        order = kept
    out = np.zeros(len(z))
    out[order] = full[order]
    return out / out.sum()


def _full_metadata(keys, steps, temperature, top_k=None, top_p=None, min_p=None):
    n = len(keys)
    filters = {}
    if top_k is not None:
        filters.update(top_k=torch.full((n,), top_k, dtype=torch.int64), max_top_k=top_k)
    if top_p is not None:
        filters["top_p"] = torch.full((n,), top_p, dtype=torch.float32)
    if min_p is not None:
        filters["min_p"] = torch.full((n,), min_p, dtype=torch.float32)
    return plain_metadata(keys, steps, temperature, **filters)


FILTERS = [
    # (temperature, top_k, top_p, min_p): expected supports are asserted below
    (1.0, 4, None, None),
    (0.7, 3, None, None),
    (1.3, None, 0.8, None),
    (0.8, None, 0.6, None),
    (1.5, 5, 0.75, None),
    (1.0, 6, 0.9, None),
    (1.2, None, None, 0.3),
    (1.0, 5, 0.85, 0.15),
]
Q8 = probs(0.10, 0.20, 0.05, 0.05, 0.25, 0.15, 0.10, 0.10)  # mass everywhere, also on filtered tokens


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", FILTERS)
def test_sampler_with_filters_and_full_proposals_emits_the_filtered_target(temperature, top_k, top_p, min_p):
    expected = filtered_target(LOGITS8.numpy(), temperature, top_k, top_p, min_p)
    assert 2 <= (expected > 0).sum() < 8, "the filter must cut something and leave a choice"
    keys, steps = keyed_rows("mixed", N, offset=14)
    md = _full_metadata(keys, steps, temperature, top_k, top_p, min_p)
    # Drafts on two thirds of the rows; the others are the ordinary draw, which must agree.
    rows = torch.arange(N)[torch.arange(N) % 3 != 2]
    x = draw(Q8, len(rows), seed=5)
    drafts = DraftVerification(rows=rows, token_ids=x, probs=Q8.expand(len(rows), -1))
    tokens = Sampler()(LOGITS8.expand(N, -1), md, drafts).token_ids
    checked = tokens[rows]
    assert gof_pvalue(checked, expected) > ALPHA
    plain = tokens[torch.arange(N) % 3 == 2]
    assert gof_pvalue(plain, expected) > ALPHA
    # Acceptance: min(p, q) summed over the filtered target p.
    beta = float(np.minimum(expected, Q8.double().numpy()).sum())
    assert gof_pvalue((checked == x).long(), [1 - beta, beta]) > ALPHA
    # Power: the unfiltered temperature-scaled target is not what the sampler emits.
    unfiltered = torch.softmax(LOGITS8.double() / temperature, dim=-1).numpy()
    counts = np.bincount(checked.numpy(), minlength=8)
    assert (counts[expected == 0] == 0).all() and (unfiltered[expected == 0] > 1e-3).any()


def test_filtered_target_reference():
    """The test's own filter arithmetic on hand-checked cases."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert np.allclose(filtered_target(logits, 1.0, top_k=2), [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(filtered_target(logits, 1.0, top_p=0.65), [4 / 7, 3 / 7, 0, 0])  # 0.4 < 0.65
    assert np.allclose(filtered_target(logits, 1.0, top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0])
    assert np.allclose(filtered_target(logits, 1.0, top_k=3, top_p=0.5), [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(filtered_target(logits, 1.0, min_p=0.5), [4 / 9, 3 / 9, 2 / 9, 0])


def test_greedy_rows_ignore_their_drafts():
    n = 64
    keys, steps = keyed_rows("seeds", n, offset=51)
    md = plain_metadata(keys, steps, 1.0)
    md.greedy = torch.arange(n) % 2 == 0
    drafts = DraftVerification(rows=torch.arange(n), token_ids=torch.full((n,), 4), probs=Q8.expand(n, -1))
    tokens = Sampler()(LOGITS8.expand(n, -1), md, drafts).token_ids
    assert (tokens[0::2] == 3).all()  # the argmax
    assert len(set(tokens[1::2].tolist())) > 1


# -- edge cases ---------------------------------------------------------------------------------


def test_q_equal_to_p_accepts_every_draft():
    for p in (P6, PAIRS["vocab-8"][0], torch.softmax(LOGITS8 / 0.3, dim=-1)):
        keys, steps = keyed_rows("mixed", N, offset=17)
        x = draw(p, N, seed=8)
        out = rejection_sample(p.expand(N, -1), x, p.expand(N, -1).clone(), keys, steps)
        assert torch.equal(out, x)


def test_p_zero_at_the_draft_never_accepts_it():
    p, q = PAIRS["p-zero-where-q-has-mass"]
    keys, steps = keyed_rows("mixed", N, offset=18)
    for x in (1, 3, 5):  # p(x) = 0 < q(x)
        out = rejection_sample(p.expand(N, -1), torch.full((N,), x), q.expand(N, -1), keys, steps)
        assert not (out == x).any()
        residual = (p - q).clamp_min(0).double()
        assert gof_pvalue(out, residual) > ALPHA


def test_q_zero_where_p_has_mass_recovers_those_tokens():
    p, q = PAIRS["q-zero-where-p-has-mass"]
    x, out = run_rejection(p, q, "mixed", offset=19)
    assert not (x == 0).any() and not (x == 2).any()  # never proposed ...
    counts = np.bincount(out.numpy(), minlength=6)
    assert counts[0] > 0 and counts[2] > 0 and counts[5] > 0  # ... still emitted, as p says
    # They only come from the residual: emitted exactly where the draft was rejected.
    assert ((out == 0) <= (out != x)).all()


def test_same_keys_give_the_same_tokens_in_any_batch():
    p, q = PAIRS["different"]
    n = 4096
    keys, steps = keyed_rows("mixed", n, offset=20)
    x = draw(q, n, seed=3)
    a = rejection_sample(p.expand(n, -1), x, q.expand(n, -1), keys, steps)
    b = rejection_sample(
        p.expand(n, -1).clone(), x.clone(), q.expand(n, -1).clone(), keys.clone(), steps.clone()
    )
    assert torch.equal(a, b)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    c = rejection_sample(p.expand(n, -1), x[perm], q.expand(n, -1), keys[perm], steps[perm])
    assert torch.equal(c, a[perm])  # each row depends on its own keys only
    half = rejection_sample(
        p.expand(n // 2, -1), x[: n // 2], q.expand(n // 2, -1), keys[: n // 2], steps[: n // 2]
    )
    assert torch.equal(half, a[: n // 2])
    # Other seeds or other steps: other decisions.
    d = rejection_sample(p.expand(n, -1), x, q.expand(n, -1), keys ^ 1, steps)
    e = rejection_sample(p.expand(n, -1), x, q.expand(n, -1), keys, steps + 1)
    assert (d != a).float().mean() > 0.1 and (e != a).float().mean() > 0.1


def test_sampler_with_drafts_is_reproducible():
    keys, steps = keyed_rows("mixed", 4096, offset=22)
    md = _full_metadata(keys, steps, 0.9, top_k=5, top_p=0.9)
    rows = torch.arange(0, 4096, 2)
    drafts = DraftVerification(
        rows=rows, token_ids=draw(Q8, len(rows), seed=4), probs=Q8.expand(len(rows), -1)
    )
    a = Sampler()(LOGITS8.expand(4096, -1), md, drafts).token_ids
    b = Sampler()(LOGITS8.expand(4096, -1).clone(), md, drafts).token_ids
    assert torch.equal(a, b)


# -- the noise is finite ---------------------------------------------------------------------

# Seed key 3092827 at step 0 once drew the largest 24-bit uniform at vocabulary index 5, which
# float32 rounds to 1.0 (Gumbel noise +inf); the hash now keeps 23 bits, whose largest uniform is
# exactly representable and below 1. These scenarios stay as regression tests.
INF_KEY, INF_TOKEN = 3092827, 5


def test_largest_uniform_is_below_one():
    from tilellm.kernels import sampling

    top = torch.tensor([(1 << 23) - 1], dtype=torch.int64)
    u = (top.to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    assert u.item() < 1.0
    noise = sampling.gumbel_noise(torch.arange(4096), 4096)  # 16M entries of the hash
    assert torch.isfinite(noise).all()


def test_gumbel_noise_is_finite():
    noise = gumbel_noise(device_row_keys(torch.tensor([INF_KEY]), torch.tensor([0])), 8)
    assert torch.isfinite(noise).all(), noise


def test_sampler_never_emits_a_filtered_token():
    md = _full_metadata(torch.tensor([INF_KEY]), torch.tensor([0]), 1.0, top_k=1)
    tokens = Sampler()(LOGITS8[None, :], md).token_ids
    assert tokens.tolist() == [3]  # top-k = 1: only the argmax can be drawn


def test_rejected_draft_is_never_emitted():
    p, q = PAIRS["p-zero-where-q-has-mass"]
    assert p[INF_TOKEN] == 0 < q[INF_TOKEN]
    keys = torch.tensor([INF_KEY ^ RESIDUAL_STREAM])  # the residual stream's key is INF_KEY's
    out = rejection_sample(p[None, :], torch.tensor([INF_TOKEN]), q[None, :], keys, torch.tensor([0]))
    assert out.tolist() != [INF_TOKEN]  # p(5) = 0: always rejected, and the residual is 0 there


def test_sampler_with_top_k_never_emits_a_filtered_token_at_scale():
    keys, steps = keyed_rows("mixed", N, offset=41, check=False)  # row 32609: +inf at token 7
    md = _full_metadata(keys, steps, 1.0, top_k=4)
    tokens = Sampler()(LOGITS8.expand(N, -1), md).token_ids
    allowed = set(np.flatnonzero(filtered_target(LOGITS8.numpy(), 1.0, top_k=4)).tolist())
    assert set(tokens.tolist()) <= allowed
