"""SamplingParams checks and the sampler: greedy, seeds, filters, logprobs, min_tokens bans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilellm.engine.sampling_params import SamplingParams
from tilellm.engine.sampling_table import SamplingTable
from tilellm.kernels.sampling import gumbel_argmax_torch, row_keys, seed_keys
from tilellm.worker.sampler import Sampler

# -- SamplingParams -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop", 3),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "yes"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("skip_special_tokens", None),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams(bogus=1)


def test_normalisation():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, stop="x")
    assert p.is_greedy and p.top_k == -1 and p.top_p == 1.0 and p.stop == ["x"] and p.stop_token_ids == []
    assert SamplingParams(top_k=0).top_k == -1


# -- sampler --------------------------------------------------------------------------------------

V = 50


def run_sampler(logits, params: list[SamplingParams], steps=None, seeds=None, eos=(), use_triton=None):
    n = len(params)
    table = SamplingTable(n, logits.shape[1])
    for i, p in enumerate(params):
        table.set_row(i, p, seeds[i] if seeds else (p.seed or 0), 10, list(eos), 10**6)
    steps = np.zeros(n, dtype=np.int64) if steps is None else np.asarray(steps)
    host = table.gather(np.arange(n), steps + 10)
    return Sampler(use_triton=use_triton)(logits, host.to_cpu_metadata())


def test_greedy_is_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    out = run_sampler(logits, [SamplingParams(temperature=0)] * 4)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_seed_reproducible_regardless_of_batch():
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, V, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [run_sampler(row, [seeded], steps=[s]).token_ids.item() for s in range(20)]
    for s in range(20):
        others = torch.randn(5, V, generator=g)
        batch = torch.cat([others[:2], row, others[2:]])
        params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), seeded] + [
            SamplingParams(temperature=1.3, seed=s)
        ] * 3
        out = run_sampler(batch, params, steps=[3, 1, s, 4, 5, 6], seeds=[9, 0, 1234, s, s + 1, s + 2])
        assert out.token_ids[2].item() == alone[s]
    assert len(set(alone)) > 3  # the draws do depend on the step


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(4000, 4).contiguous()
    params = [SamplingParams(temperature=1.0)] * 4000
    out = run_sampler(logits, params, steps=np.arange(4000), seeds=[7] * 4000)
    freq = torch.bincount(out.token_ids, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)


def _support(logits, p: SamplingParams, draws=300):
    out = run_sampler(
        logits.expand(draws, -1).contiguous(), [p] * draws, steps=np.arange(draws), seeds=[3] * draws
    )
    return set(out.token_ids.tolist())


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.linspace(3, -3, V)[None]  # token 0 most likely, then 1, ...
    probs = torch.softmax(logits[0], -1)
    assert _support(logits, SamplingParams(temperature=2.0, top_k=3)) == {0, 1, 2}
    nucleus = int((torch.cumsum(probs, 0) < 0.5).sum()) + 1
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.5)) <= set(range(nucleus))
    keep = set(torch.nonzero(probs >= 0.3 * probs[0]).flatten().tolist())
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.3)) <= keep
    both = _support(logits, SamplingParams(temperature=5.0, top_k=4, top_p=0.9))
    assert both <= {0, 1, 2, 3} and len(both) > 1


def test_filters_are_per_row():
    logits = torch.linspace(3, -3, V)[None].expand(2, V).contiguous()
    draws = []
    for s in range(60):
        out = run_sampler(
            logits, [SamplingParams(temperature=1, top_k=1), SamplingParams(temperature=5)], steps=[s, s]
        )
        draws.append(out.token_ids.tolist())
    assert {d[0] for d in draws} == {0}
    assert len({d[1] for d in draws}) > 5


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    out = run_sampler(logits, [SamplingParams(temperature=0, logprobs=5), SamplingParams(), SamplingParams()])
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(out.sampled_logprobs, lp.gather(1, out.token_ids[:, None])[:, 0])
    assert out.sampled_ranks[0].item() == 1
    assert torch.allclose(out.top_logprobs, lp.topk(5, -1).values)
    rank = (lp > lp.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert out.sampled_ranks.tolist() == rank.tolist()


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.zeros(2, V)
    logits[:, 7] = 100.0  # eos
    logits[:, 8] = 90.0  # a stop token
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[8])
    # Row 0 has sampled nothing yet: 7 and 8 are banned, the argmax of the rest is token 0.
    assert run_sampler(logits, [p, p], steps=[0, 3], eos=[7]).token_ids.tolist() == [0, 7]
    q = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    assert run_sampler(logits[:1], [q], steps=[0], eos=[7]).token_ids.tolist() == [
        7
    ]  # ignore_eos: not banned


def test_row_keys_depend_on_seed_and_step():
    seeds, steps = np.array([1, 1, 2, 2**63 + 1], dtype=np.uint64), np.array([0, 1, 0, 0])
    k = row_keys(seeds, steps)
    assert len(set(k.tolist())) == 4
    from tilellm.kernels.sampling import device_row_keys

    dev = device_row_keys(torch.from_numpy(seed_keys(seeds).astype(np.int64)), torch.from_numpy(steps))
    assert dev.tolist() == k.astype(np.int64).tolist()


def test_triton_gumbel_kernel_matches_torch():
    """The fused kernel (interpreter on CPU, compiled on GPU) draws the same tokens as the torch path."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=g)
    logits[1, 100:] = float("-inf")
    inv_temp = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0])
    keys = torch.from_numpy(seed_keys(np.arange(6, dtype=np.uint64) * 977).astype(np.int64))
    steps = torch.arange(6) * 1000
    from tilellm.kernels.sampling import gumbel_argmax_triton

    want = gumbel_argmax_torch(logits, inv_temp, keys, steps)
    got = gumbel_argmax_triton(
        logits.to(device), inv_temp.to(device), keys.to(device), steps.to(device)
    ).cpu()
    assert got.tolist() == want.tolist()
    assert got[1].item() < 100


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_triton", [False, True])
def test_half_logits_sample_as_their_float32_copy(dtype, use_triton):
    """Greedy and temperature rows read half-precision logits directly; the tokens are those of
    the same logits widened to float32 (the widening is exact), with ties kept on the first index."""
    import dataclasses

    device = "cuda" if use_triton and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, 700, generator=g) * 4).to(dtype)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: the first index wins
    params = [SamplingParams(temperature=t, seed=11 * i) for i, t in enumerate([0, 0.6, 0, 1.0, 1.7, 0.3])]
    table = SamplingTable(6, logits.shape[1])
    for i, p in enumerate(params):
        table.set_row(i, p, p.seed, 10, [], 10**6)
    md = table.gather(np.arange(6), np.array([0, 5, 9, 2, 8, 1]) + 10).to_cpu_metadata()
    on_device = {
        f.name: getattr(md, f.name).to(device)
        for f in dataclasses.fields(md)
        if isinstance(getattr(md, f.name), torch.Tensor)
    }
    md = dataclasses.replace(md, **on_device)
    sampler = Sampler(use_triton=use_triton)
    half = sampler(logits.to(device), md).token_ids.cpu()
    wide = sampler(logits.float().to(device), md).token_ids.cpu()
    assert half.tolist() == wide.tolist()
    assert half[2].item() == 10
    assert half[0].item() == logits[0].float().argmax().item()


def test_triton_gumbel_kernel_breaks_ties_like_torch():
    """Tied maxima (+inf logits: the noise cannot separate them) in different lanes, loop
    iterations and vocab chunks of the kernel: the first index wins, as in the torch path."""
    from tilellm.kernels.sampling import GUMBEL_BLOCK, GUMBEL_CHUNK, gumbel_argmax_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    v = 2 * GUMBEL_CHUNK + 500
    logits = torch.randn(5, v, generator=torch.Generator().manual_seed(9))
    logits[0, [3 * GUMBEL_BLOCK // 2, GUMBEL_BLOCK + 1]] = float("inf")  # other lanes, other iterations
    logits[1, [GUMBEL_CHUNK + 7, 2 * GUMBEL_CHUNK + 3, 100]] = float("inf")  # across chunks
    logits[2, [GUMBEL_BLOCK + 3, 3]] = float("inf")  # one lane, two iterations
    logits[3] = float("-inf")
    logits[3, [GUMBEL_CHUNK, GUMBEL_CHUNK - 1]] = float("inf")  # the last index of chunk 0 first
    logits[4] = float("-inf")
    logits[4, v - 1] = 0.0  # the only finite entry, in the last, partial block
    inv_temp = torch.ones(5)
    keys = torch.from_numpy(seed_keys(np.arange(5, dtype=np.uint64) * 31).astype(np.int64))
    steps = torch.arange(5)
    want = gumbel_argmax_torch(logits, inv_temp, keys, steps)
    got = gumbel_argmax_triton(
        logits.to(device), inv_temp.to(device), keys.to(device), steps.to(device)
    ).cpu()
    assert want.tolist() == [GUMBEL_BLOCK + 1, 100, 3, GUMBEL_CHUNK - 1, v - 1]
    assert got.tolist() == want.tolist()
