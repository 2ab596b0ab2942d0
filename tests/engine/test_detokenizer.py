"""Incremental detokenization never emits half a character and adds up to the full decode."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tilellm.engine.detokenizer import IncrementalDetokenizer

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
