"""Incremental detokenization: text grows token by token, never ending in half a character.

Byte-level BPE tokenizers split multi-byte UTF-8 characters across tokens, and SentencePiece
tokenizers drop a word's leading space when it starts the decoded span. Both are handled by
decoding a short window twice: `tokens[prefix:read]` (already emitted) and `tokens[prefix:]`
(with the new tokens); the new text is the difference, released only when it does not end in
U+FFFD (an incomplete character). The window starts with a few prompt tokens as context.

A fast (Rust-backed) tokenizer that does no clean-up of tokenization spaces is asked directly
(`backend_tokenizer.decode`): what transformers' `decode` returns for it, without that method's
Python around the call (its argument conversion walks the ids), which every running request pays
twice a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Prompt tokens decoded as context before the first generated token.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, a few tokens at a time.

    `text` is everything released so far; `add(ids)` returns the newly released part.
    `flush()` releases what is held back (at the end of the sequence, even an incomplete char).
    """

    __slots__ = (
        "tokenizer",
        "skip_special_tokens",
        "tokens",
        "prefix_offset",
        "read_offset",
        "text",
        "_decode_ids",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        decode_ids: Callable[..., str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        # `decode_ids`: the tokenizer's decode as its owner chose it once (`backend_decode`)
        self._decode_ids = decode_ids or backend_decode(tokenizer) or tokenizer.decode

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        self.tokens.extend(new_token_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still incomplete: wait for more tokens
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._trim()
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release the held-back tail (called once the sequence is finished)."""
        if self.read_offset >= len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    def _trim(self) -> None:
        # Only tokens from prefix_offset on are ever decoded again.
        if self.prefix_offset > 64:
            del self.tokens[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0


def backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """`decode(ids, skip_special_tokens=...)` of a fast tokenizer's Rust backend where it returns
    what `tokenizer.decode` does: a `PreTrainedTokenizerFast` whose class keeps that class's
    `decode` and `_decode` (some models' tokenizers rewrite the text there) and cleans up no
    tokenization spaces; else None."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, PreTrainedTokenizerFast)
        or cls.decode is not PreTrainedTokenizerFast.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    return tokenizer.backend_tokenizer.decode
