"""`SamplingParams(prompt_logprobs=k)`: each prompt token's logprob (and the top k) against
`transformers`' log-softmax (fp32, CPU), whole or in chunks, beside cached prompts, after
preemption, with n > 1 and with delta outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tilellm import LLM, SamplingParams


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def _want(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(out, hf, k: int) -> None:
    prompt = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    lp = _want(hf, prompt)
    for i in range(1, len(prompt)):
        entry, row = plp[i], lp[i - 1]
        assert entry[prompt[i]].logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert entry[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(top) <= set(entry) and len(entry) <= k + 1


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 380, 40).tolist()
    return [shared + rng.integers(0, 380, 9).tolist(), shared[:33], rng.integers(0, 380, 70).tolist(), [5, 6]]


@pytest.mark.parametrize(
    "engine",
    [
        dict(num_kv_blocks=64),
        dict(num_kv_blocks=64, max_num_batched_tokens=16),
        dict(num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=32),
    ],
    ids=["whole", "chunked", "tiny_pool"],
)
def test_prompt_logprobs_match_transformers(tiny_qwen3, hf, engine):
    llm = LLM(tiny_qwen3, **engine)
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    llm.generate(_prompts(), plain, use_tqdm=False)  # the prompts are now in the prefix cache
    for k in (0, 3):
        params = SamplingParams(
            max_tokens=20, ignore_eos=True, prompt_logprobs=k, n=2, temperature=0.7, seed=1
        )
        outs = llm.generate(_prompts(), [params, plain, params, params], use_tqdm=False)
        for i, out in enumerate(outs):
            if i == 1:
                assert out.prompt_logprobs is None
            else:
                _check(out, hf, k)


def test_prompt_logprobs_with_delta_outputs(tiny_qwen3, hf):
    llm = LLM(tiny_qwen3, num_kv_blocks=64, max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.output_deltas = True
    engine.add_request("r", _prompts()[2], SamplingParams(max_tokens=4, prompt_logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                seen.append(out)
    assert len(seen) == 1  # once, complete
    _check(seen[0], hf, 1)


def test_bad_prompt_logprobs_names_the_field():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
