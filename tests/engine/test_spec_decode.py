"""Speculative decoding in the engine: with it on, greedy output is the `transformers` oracle's,
token for token (fp32, CPU), under every engine setting that changes how a step is cut up, for
the n-gram proposer and for draft models that agree with the target (most drafts accepted) or
not (few accepted). Seeded sampling: n-gram drafts leave the output unchanged; a draft model's
rejection sampling is reproducible. Every test also checks that drafts were verified, so that it
cannot pass with speculation silently off.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import hf_greedy
from tilellm import LLM, SamplingParams

MAX_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts(vocab: int = 380) -> list[list[int]]:
    """Prompts whose continuations repeat (random tiny models fall into loops, and repeated
    spans give the n-gram lookup matches), with shared prefixes and lengths around blocks."""
    rng = np.random.default_rng(7)
    motif = rng.integers(0, vocab, 6).tolist()
    shared = rng.integers(0, vocab, 33).tolist()
    return [
        motif * 4,
        shared[:16] + motif * 2,
        shared + motif,
        [int(rng.integers(0, vocab))],
        rng.integers(0, vocab, 19).tolist(),
        shared[:20] + [3, 3, 3, 3],
    ]


_EXPECTED: dict[str, list[list[int]]] = {}


def expected(model_dir: str) -> list[list[int]]:
    if model_dir not in _EXPECTED:
        _EXPECTED[model_dir] = hf_greedy(model_dir, _prompts(), MAX_TOKENS)
    return _EXPECTED[model_dir]


def generate(llm: LLM, params: SamplingParams, prompts=None) -> list[list[int]]:
    outs = llm.generate(prompts or _prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

SETTINGS = {
    "default": dict(num_kv_blocks=96),
    "no_prefix_cache": dict(num_kv_blocks=96, enable_prefix_caching=False),
    "tiny_pool_preempts": dict(num_kv_blocks=9, max_num_seqs=6),
    "chunked_16_tokens": dict(num_kv_blocks=96, max_num_batched_tokens=16),
    "block_size_1": dict(num_kv_blocks=1024, block_size=1),
}


def _spec(kind: str, target: str, other: str) -> dict:
    if kind == "ngram":
        return NGRAM
    draft = target if kind == "draft_self" else other
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["ngram", "draft_self", "draft_other"])
def test_qwen3_greedy_matches_hf_with_speculation(tiny_qwen3, tiny_llama, kind, setting):
    spec = _spec(kind, tiny_qwen3, tiny_llama)
    llm = LLM(tiny_qwen3, speculative_config=spec, **SETTINGS[setting])
    want = expected(tiny_qwen3)
    assert generate(llm, GREEDY) == want
    assert generate(llm, GREEDY) == want  # again: the prefix cache now holds every prompt
    engine = llm.llm_engine
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    if kind == "draft_self":  # the target drafting for itself: every draft token is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    draft = engine.runner.draft
    if draft is not None and engine.runner.is_cuda:  # its decode steps replay its CUDA graphs
        assert draft.graphs is not None and sum(draft.graphs.replays.values()) > 0
    if kind == "draft_other":  # an unrelated random model: (almost) nothing accepted
        assert stats.acceptance_rate < 0.3
    if kind == "ngram":
        assert stats.num_accepted_tokens > 0
    if setting == "tiny_pool_preempts":
        assert engine.get_stats().num_preemptions > 0
    bm = engine.block_manager  # everything finished: no block is referenced
    assert not engine.requests and not any(bm.ref_counts)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind", ["ngram", "draft_self", "draft_other"])
def test_llama_greedy_matches_hf_with_speculation(tiny_qwen3, tiny_llama, kind):
    spec = _spec(kind, tiny_llama, tiny_qwen3)
    for setting in ("default", "chunked_16_tokens"):
        llm = LLM(tiny_llama, speculative_config=spec, **SETTINGS[setting])
        assert generate(llm, GREEDY) == expected(tiny_llama)
        assert llm.llm_engine.spec_stats.num_drafts > 0


def test_triton_kernels_verify_drafts(tiny_qwen3):
    """The verification step through the Triton paged kernel (interpreter, fp32). 12 tokens a
    prompt: 6 drafts verified, some accepted and some rejected (24 only added more such steps)."""
    prompts = _prompts()[:3]
    llm = LLM(tiny_qwen3, num_kv_blocks=32, attention_backend="triton", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert generate(llm, params, prompts) == [w[:12] for w in expected(tiny_qwen3)[:3]]
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_max_tokens_is_never_exceeded(tiny_qwen3):
    """A draft reaches at most to max_tokens: outputs stop exactly there, for every limit."""
    llm = LLM(tiny_qwen3, num_kv_blocks=96, speculative_config=NGRAM)
    llm.llm_engine.async_scheduling = True  # as on CUDA: drafting tries between async steps
    want = expected(tiny_qwen3)
    for max_tokens in (1, 2, 3, 5, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        for out, w in zip(outs, want):
            assert out.outputs[0].token_ids == w[:max_tokens]
            assert out.outputs[0].finish_reason == "length"
    assert llm.llm_engine.spec_stats.num_drafts > 0


def test_n_samples_and_logprobs_match_without_speculation(tiny_qwen3):
    """n > 1 (samples share prompt blocks) and logprobs: the same as with speculation off."""
    params = SamplingParams(temperature=0.8, seed=11, n=3, max_tokens=16, ignore_eos=True, logprobs=2)
    base = LLM(tiny_qwen3, num_kv_blocks=96).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(tiny_qwen3, num_kv_blocks=96, speculative_config=NGRAM)
    spec = llm.generate(_prompts(), params, use_tqdm=False)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    for a, b in zip(base, spec):
        assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
        for sa, sb in zip(a.outputs, b.outputs):
            assert sa.cumulative_logprob == pytest.approx(sb.cumulative_logprob, abs=1e-4)
            for la, lb in zip(sa.logprobs, sb.logprobs):
                assert la.keys() == lb.keys()
                for t in la:
                    assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
                    assert la[t].rank == lb[t].rank


def test_sampled_output_with_a_draft_model_is_reproducible(tiny_qwen3, tiny_llama):
    """Rejection sampling draws from seeded streams: the same seed, the same tokens."""
    spec = {"method": "draft_model", "model": tiny_qwen3, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(tiny_qwen3, num_kv_blocks=96, speculative_config=spec)
        runs.append(generate(llm, params))
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_stop_strings_and_tokens_inside_an_accepted_run(tiny_qwen3):
    """A stop inside the tokens one verification emits ends the output there, as without it."""
    base = LLM(tiny_qwen3, num_kv_blocks=96)
    llm = LLM(tiny_qwen3, num_kv_blocks=96, speculative_config=NGRAM)
    prompts = _prompts()
    free = base.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    tok = base.get_tokenizer()
    for out in free:
        ids = out.outputs[0].token_ids
        # Stop at a token well inside the output (likely inside an accepted run) and at its text.
        stop_token = ids[len(ids) // 2]
        stop_text = tok.decode(ids[len(ids) // 2 : len(ids) // 2 + 2])
        for params in (
            SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_token]
            ),
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop_text]),
        ):
            want = base.generate([out.prompt_token_ids], params, use_tqdm=False)[0].outputs[0]
            got = llm.generate([out.prompt_token_ids], params, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
                want.stop_reason,
            )
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_streamed_deltas_add_up(tiny_qwen3):
    """Streaming (delta outputs): a step may bring several tokens; the deltas join to the whole."""
    llm = LLM(tiny_qwen3, num_kv_blocks=96, speculative_config=NGRAM)
    engine = llm.llm_engine
    engine.output_deltas = True
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    multi = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0]
            tokens.setdefault(out.request_id, []).extend(delta.token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + delta.text
            multi += len(delta.token_ids) > 1
    assert multi > 0  # some steps emitted more than one token
    want = expected(engine.config.model)
    assert [tokens[f"r{i}"] for i in range(len(want))] == want
    tok = llm.get_tokenizer()
    for i, ids in enumerate(want):
        assert texts[f"r{i}"] == tok.decode(ids)


def test_abort_mid_generation_frees_every_block(tiny_qwen3):
    llm = LLM(tiny_qwen3, num_kv_blocks=96, speculative_config=NGRAM)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, params)
    for _ in range(4):
        engine.step()
    for i in range(len(_prompts())):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    assert all(rc == 0 for rc in engine.block_manager.ref_counts)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"method": "eagle9"}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "lookahead": 3}, "unknown key"),
        ({"method": "draft_model", "model": "/nonexistent/draft"}, "speculative_config.model"),
    ],
)
def test_bad_speculative_config_is_a_value_error_naming_the_field(tiny_qwen3, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_qwen3, num_kv_blocks=16, speculative_config=spec)


def test_draft_model_with_another_vocabulary_is_refused(tiny_qwen3, tmp_path):
    from tilellm.testing import make_tiny_model

    other = make_tiny_model(tmp_path / "v", "Qwen3ForCausalLM", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_qwen3, num_kv_blocks=16, speculative_config={"model": str(other)})


@pytest.mark.parametrize("setting", ["default", "tiny_pool_preempts", "chunked_16_tokens"])
@pytest.mark.parametrize("kind", ["ngram", "draft_self"])
def test_asynchronous_scheduling_between_drafting_steps(tiny_qwen3, tiny_llama, kind, setting):
    """With asynchronous scheduling (the CUDA default) a drafting step first finishes the step in
    flight; steps between drafting tries run asynchronously. The tokens stay the oracle's."""
    llm = LLM(tiny_qwen3, speculative_config=_spec(kind, tiny_qwen3, tiny_llama), **SETTINGS[setting])
    llm.llm_engine.async_scheduling = True
    assert generate(llm, GREEDY) == expected(tiny_qwen3)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_drafting_backs_off_when_nothing_is_found(tiny_qwen3):
    """A proposer that finds nothing: after 8 tries the tries get 2, 4, ... 64 steps apart, and
    the steps between run asynchronously; the output is unchanged."""
    llm = LLM(tiny_qwen3, num_kv_blocks=96, speculative_config=NGRAM)
    engine = llm.llm_engine
    engine.async_scheduling = True
    asked: list[int] = []
    engine.proposer.propose = lambda seq_id, token_ids, max_drafts: asked.append(seq_id) or []
    tries = 0
    real = engine._propose_drafts

    def counted() -> bool:
        nonlocal tries
        tries += 1
        return real()

    engine._propose_drafts = counted
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert generate(llm, params) == expected(tiny_qwen3)
    steps = engine.timings.num_steps
    assert asked and steps >= MAX_TOKENS
    assert tries <= 8 + 5  # 8 tries in a row, then 2, 4, 8, ... steps apart


@pytest.mark.parametrize("kind", ["ngram", "draft_self"])
def test_padded_verification_steps(tiny_qwen3, tiny_llama, kind, monkeypatch):
    """Verification steps in the verification graphs' shape (every draft padded to k tokens that
    store nothing: `build_step_inputs(pad_drafts_to=k)`), run eagerly here: the same tokens."""
    from tilellm.worker.model_runner import ModelRunner

    spec = _spec(kind, tiny_qwen3, tiny_llama)
    k = spec["num_speculative_tokens"]
    monkeypatch.setattr(ModelRunner, "verify_pad", property(lambda self: (k, 64)))
    llm = LLM(tiny_qwen3, speculative_config=spec, **SETTINGS["tiny_pool_preempts"])
    padded = []
    real = llm.llm_engine.runner.launch

    def launch(inputs, *args, **kwargs):
        padded.append(inputs.verify_width)
        return real(inputs, *args, **kwargs)

    llm.llm_engine.runner.launch = launch
    assert generate(llm, GREEDY) == expected(tiny_qwen3)
    assert (k + 1) in padded  # some steps were padded verification steps
