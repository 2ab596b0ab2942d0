"""Bad words (vLLM's definition) against a hand-written greedy oracle on `transformers`' logits
(fp32, CPU): the last token of a word's token sequence is banned at a step whose last output
tokens are the rest of it (the prompt does not count), in batches with plain requests, under
asynchronous scheduling, preemption, n > 1 and speculative decoding of the plain requests."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import PROCESSING_SETTINGS as SETTINGS
from tilellm import LLM, SamplingParams
from tilellm.engine.sampling_params import MAX_BAD_WORD_PREFIX, MAX_BAD_WORDS
from tilellm.worker.logits_processors import NO_TOKEN, RECENT_TOKENS, BadWordsState, apply_bad_words

MAX_TOKENS = 14

_HF: dict[str, object] = {}


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir not in _HF:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _HF[model_dir] = (model, AutoTokenizer.from_pretrained(model_dir))
    return _HF[model_dir]


def word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: the word, and " " + word when that starts with another
    token and has as many tokens."""
    seqs = []
    for w in words:
        plain = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        seqs.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return seqs


def oracle(
    model_dir: str, prompt: list[int], words: list[str] | None, max_tokens: int = MAX_TOKENS
) -> list[int]:
    """Greedy decoding with vLLM's bad-words ban, one token at a time on transformers."""
    model, tokenizer = _hf(model_dir)
    seqs = word_sequences(tokenizer, words or [])
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            for seq in seqs:
                k = len(seq) - 1
                if k <= len(out) and out[len(out) - k :] == seq[:k]:
                    logits[seq[-1]] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def _pair_word(tokenizer, tokens: list[int]) -> tuple[str, list[int]] | None:
    """A word whose token sequence is two tokens of `tokens`, the first such pair that repeats
    one token (so that its prefix, the token alone, appears in the output too); None if none."""
    for i in range(len(tokens) - 1):
        pair = tokens[i : i + 2]
        text = tokenizer.decode(pair)
        if (
            pair[0] == pair[1]
            and text.strip() == text
            and tokenizer.encode(text, add_special_tokens=False) == pair
        ):
            return text, pair
    return None


@pytest.fixture(scope="module")
def case(tiny_qwen3):
    """Prompts, and bad words taken from their unconstrained greedy outputs."""
    _, tokenizer = _hf(tiny_qwen3)
    prompts = [tokenizer.encode(t) for t in ("Hello, world!", "The quick brown fox", "Once upon a time")]
    plain = [oracle(tiny_qwen3, p, None) for p in prompts]
    found = _pair_word(tokenizer, plain[0])
    assert found is not None, plain[0]
    single = tokenizer.decode(plain[1][:1])
    assert tokenizer.encode(single, add_special_tokens=False) == plain[1][:1]
    return dict(prompts=prompts, plain=plain, pair=found, single=(single, plain[1][0]))


def _params(words: list[str] | None, **kw: object) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "bad_words": words, **kw}
    )


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_bad_words_match_the_oracle(tiny_qwen3, case, setting):
    (pair_text, pair), (single, single_id) = case["pair"], case["single"]
    word_lists = [[pair_text], [single], [pair_text, single], None]
    pairs = [(p, w) for p in case["prompts"] for w in word_lists]
    llm = LLM(tiny_qwen3, **SETTINGS[setting])
    llm.llm_engine.async_scheduling = setting == "async"
    outs = llm.generate([p for p, _ in pairs], [_params(w) for _, w in pairs], use_tqdm=False)
    for (prompt, words), out in zip(pairs, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == oracle(tiny_qwen3, prompt, words), words
        if words and pair_text in words:
            assert not contains(tokens, pair)
        if words and single in words:
            assert single_id not in tokens
    # The bans change these outputs: the oracle test cannot pass by ignoring them.
    assert contains(case["plain"][0], pair) and case["plain"][1][0] == single_id
    if setting == "tiny_pool_preempts":
        assert llm.llm_engine.get_stats().num_preemptions > 0


def test_only_the_last_token_is_banned(tiny_qwen3, case):
    """The word's first token alone is still generated; only the pair never is."""
    (pair_text, pair), prompt = case["pair"], case["prompts"][0]
    out = LLM(tiny_qwen3, num_kv_blocks=32).generate([prompt], _params([pair_text]), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    assert pair[0] in tokens and not contains(tokens, pair)
    assert contains(case["plain"][0], pair)


def test_the_prompt_is_not_a_prefix_nor_the_slots_last_sequence(tiny_qwen3, case):
    """A prompt ending in the word's prefix does not ban the first output token (vLLM matches the
    output only), even in the slot of a sequence whose output ended in that prefix."""
    (pair_text, pair), prompt, plain = case["pair"], case["prompts"][0], case["plain"][0]
    cut = next(i for i in range(len(plain) - 1) if plain[i : i + 2] == pair) + 1
    llm = LLM(tiny_qwen3, num_kv_blocks=32, max_num_seqs=1)  # one slot: the second request takes it
    first = llm.generate([prompt], _params([pair_text], max_tokens=cut), use_tqdm=False)
    assert first[0].outputs[0].token_ids == plain[:cut]  # ends with pair[0]
    prompt = prompt + plain[:cut]  # ends with pair[0]; its greedy next token is pair[1]
    tokens = llm.generate([prompt], _params([pair_text]), use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[0] == pair[1]
    assert tokens == oracle(tiny_qwen3, prompt, [pair_text])


def test_a_preempted_sequence_keeps_its_last_tokens(tiny_qwen3, case):
    """A sequence preempted right after generating a word's prefix bans its last token when it is
    recomputed: its slot is refilled from the tokens it generated before."""
    prompt, plain = case["prompts"][0], case["plain"][0]
    _, tokenizer = _hf(tiny_qwen3)
    bs = 4
    # A prompt whose greedy continuation is a repeated token spelling a word, filling whole blocks.
    j = next(
        j
        for j in range(len(plain) - 1)
        if (len(prompt) + j) % bs == 0 and _pair_word(tokenizer, plain[j : j + 2]) is not None
    )
    word, pair = _pair_word(tokenizer, plain[j : j + 2])
    banned = prompt + plain[:j]
    other = [5, 6, 7, 8, 9, 10]  # 2 blocks, and 3 tokens that fit them
    # Both fill the pool; the banned request's second decode step needs a block, and it is the
    # latest admitted: it is preempted after its first token, then recomputed once `other` ends.
    llm = LLM(tiny_qwen3, block_size=bs, num_kv_blocks=2 + len(banned) // bs)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), _params([word], max_tokens=4)]
    outs = llm.generate([other, banned], params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    tokens = outs[1].outputs[0].token_ids
    assert tokens[0] == pair[0] and tokens[1] != pair[1]
    assert tokens == oracle(tiny_qwen3, banned, [word], max_tokens=4)


def test_n_samples_each_follow_their_own_tokens(tiny_qwen3, case):
    (pair_text, _), prompt = case["pair"], case["prompts"][0]
    llm = LLM(tiny_qwen3, num_kv_blocks=64)
    greedy = llm.generate([prompt], _params([pair_text], n=3), use_tqdm=False)[0]
    assert [c.token_ids for c in greedy.outputs] == [oracle(tiny_qwen3, prompt, [pair_text])] * 3

    def samples(words):
        params = SamplingParams(
            n=4, temperature=0.2, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=words
        )
        return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]

    # The unconstrained samples repeat tokens; ban those repeats that spell words.
    tokenizer = _hf(tiny_qwen3)[1]
    found = [_pair_word(tokenizer, s) for s in samples(None)]
    words = list(dict.fromkeys(f[0] for f in found if f is not None))
    assert len(words) >= 2
    banned = word_sequences(tokenizer, words)
    assert not any(contains(s, seq) for s in samples(words) for seq in banned)


def test_sequences_with_bad_words_do_not_draft(tiny_qwen3, case):
    """As with penalties, each position's ban needs the tokens before it: no draft to verify."""
    (pair_text, _), prompt = case["pair"], case["prompts"][0]
    llm = LLM(
        tiny_qwen3,
        num_kv_blocks=32,
        speculative_config=SETTINGS["speculative_plain_requests"]["speculative_config"],
    )
    stats = llm.llm_engine.spec_stats
    llm.generate([prompt], _params(None), use_tqdm=False)
    drafts = stats.num_drafts
    assert drafts > 0  # the plain request drafts
    out = llm.generate([prompt], _params([pair_text]), use_tqdm=False)
    assert stats.num_drafts == drafts
    assert out[0].outputs[0].token_ids == oracle(tiny_qwen3, prompt, [pair_text])


class _Tokenizer:
    """Encodes from a table: vLLM's rule keeps " in" (another first token, as many tokens), drops
    " el" (one more token) and keeps " ab" (another first token)."""

    TABLE = {"in": [1], " in": [2], "el": [3], " el": [4, 3], "ab": [5, 6], " ab": [7, 6]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.TABLE[text]


def test_tokenization_follows_vllm():
    params = SamplingParams(bad_words=["in", "  el", "ab", "in"])
    params.update_from_tokenizer(_Tokenizer())
    assert params.bad_words_token_ids == [[1], [2], [3], [5, 6], [7, 6]]


def test_the_longest_prefix_fills_the_recent_tokens():
    """A word of MAX_BAD_WORD_PREFIX + 1 tokens beside a single-token one and a two-token one: the
    long word's last token is banned only once all its prefix is the slot's last outputs."""
    state = BadWordsState(2, torch.device("cpu"))
    long_word = list(range(10, 10 + MAX_BAD_WORD_PREFIX + 1))
    prefixes = torch.full((3, MAX_BAD_WORD_PREFIX), NO_TOKEN)
    prefixes[0] = torch.tensor(long_word[:-1])
    prefixes[2, -1] = 7
    pairs = (torch.tensor([0, 0, 0]), torch.tensor([long_word[-1], 3, 4]))  # all on step row 0

    def banned(slot: int) -> list[int]:
        recent = state.recent[torch.tensor([slot])]
        logits = apply_bad_words(torch.zeros(1, 40), recent, pairs, prefixes)
        return torch.nonzero(logits[0] == float("-inf"))[:, 0].tolist()

    state.reset_row(1, [7] + long_word[:-2])  # one token short of the long prefix
    assert banned(1) == [3]
    state.add_tokens(torch.tensor([1]), torch.tensor([long_word[-2]]))
    assert banned(1) == [3, long_word[-1]]
    state.reset_row(1, [1, 2, 7])  # a recomputed sequence: its last outputs
    assert banned(1) == [3, 4]
    assert banned(0) == [3]  # the other slot has no output yet


@pytest.mark.parametrize(
    "words, match",
    [
        ("bad", "bad_words must be a list of non-empty strings"),
        ([""], "bad_words must be a list of non-empty strings"),
        (["  "], "bad_words must be a list of non-empty strings"),
        ([3], "bad_words must be a list of non-empty strings"),
        ([f"w{i}" for i in range(MAX_BAD_WORDS + 1)], "bad_words has 129 words"),
    ],
)
def test_bad_values_name_the_field(words, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(bad_words=words)


def test_words_the_engine_refuses(tiny_qwen3):
    llm = LLM(tiny_qwen3, num_kv_blocks=16)
    long_word = "".join(chr(0x4E00 + i) for i in range(MAX_BAD_WORD_PREFIX + 2))  # a token or more each
    with pytest.raises(ValueError, match=f"bad_words.*the limit is {MAX_BAD_WORD_PREFIX + 1}"):
        llm.generate([[1, 2, 3]], SamplingParams(bad_words=[long_word]), use_tqdm=False)
    assert RECENT_TOKENS >= MAX_BAD_WORD_PREFIX  # the device keeps as many output tokens as a prefix has
    no_tokenizer = LLM(tiny_qwen3, num_kv_blocks=16, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words needs the tokenizer"):
        no_tokenizer.generate([[1, 2, 3]], SamplingParams(bad_words=["el"]), use_tqdm=False)
