"""Incremental detokenization never emits half a character and adds up to the full decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tilellm.engine.detokenizer import IncrementalDetokenizer, backend_decode

TEXTS = ["Zürich 東京 漢字😀 ñandú 🚀.", "plain ascii text, with words", "🙂🙂🙂 a b  c"]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.mark.parametrize("text", TEXTS)
def test_streams_multibyte_utf8(tokenizer, text):
    prompt = tokenizer.encode("Hello, world!")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    waited = 0
    for t in ids:
        delta = detok.add([t])
        assert "\ufffd" not in delta, f"partial character emitted after token {t}"
        waited += delta == ""
        pieces.append(delta)
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tokenizer.decode(ids)
    if text == TEXTS[0]:
        assert waited > 0  # some characters did span several tokens


def test_skips_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Paris") + [eos]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    for t in ids:
        detok.add([t])
    detok.flush()
    assert detok.text == "Paris"
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    keep.add(ids)
    assert keep.text.endswith(tokenizer.eos_token)


def test_flush_releases_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1])


def test_long_streams_stay_consistent(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    for t in ids:
        detok.add([t])
    detok.flush()
    assert detok.text == tokenizer.decode(ids)
    assert len(detok.tokens) < 200  # the decoded window is trimmed


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 2047), max_size=12), skip=st.booleans())
def test_backend_decode_is_the_tokenizers_decode(tokenizer, ids, skip):
    """The Rust backend's decode, which the detokenizer calls directly, gives `tokenizer.decode`'s
    text for any ids (special ones included) with and without skipping special tokens."""
    decode = backend_decode(tokenizer)
    assert decode is not None  # a fast tokenizer without clean-up: the direct path is taken
    ids = [i % len(tokenizer) for i in ids] + [tokenizer.eos_token_id] * (len(ids) % 2)
    assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_backend_decode_only_where_it_is_the_same(tokenizer):
    """No direct path where `decode` would clean up tokenization spaces, where a tokenizer's class
    rewrites the decoded text, or for a tokenizer with no Rust backend: the detokenizer then calls
    `decode` itself."""

    cleaning = type(tokenizer).from_pretrained(tokenizer.name_or_path, clean_up_tokenization_spaces=True)

    class Slow:
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=False):
            return "|".join(map(str, ids))

    class Rewriting(type(tokenizer)):  # a model's tokenizer that edits the decoded text
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).replace(" ", "_")

    rewriting = Rewriting.from_pretrained(tokenizer.name_or_path)
    assert backend_decode(cleaning) is None and backend_decode(Slow()) is None
    assert backend_decode(rewriting) is None
    ids = tokenizer.encode("two words")
    detok = IncrementalDetokenizer(rewriting, [])
    detok.add(ids)
    assert detok.text == rewriting.decode(ids) == "two_words"
    detok = IncrementalDetokenizer(Slow(), [7])
    assert detok.add([1, 2]) == "|1|2" and detok.text == "|1|2"
