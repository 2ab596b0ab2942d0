"""Structured outputs: token masks that keep a sequence inside a grammar (xgrammar).

    backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids)
    matcher = backend.matcher(params.structured_outputs)   # compiled once per key, then cached
    masks = backend.bitmasks([matcher_or_None, ...])        # [N, ceil(V / 32)] int32, -1: free row
    matcher.accept_token(token)                             # after each emitted token

xgrammar (vLLM's default backend) compiles JSON schemas, regexes, choices and EBNF grammars
against the tokenizer's vocabulary once; a matcher per sequence then says, at each step, which
tokens can continue the text (a bitmask, 32 tokens per int32 word) and advances on the token
drawn. llguidance (Guidance's engine, also on PyPI) covers the same forms; xgrammar is chosen
because vLLM and SGLang default to it, its bitmask layout is the one their samplers apply, and
it compiles from a Hugging Face tokenizer in one call.

The mask for a step needs the token drawn in the step before, so a sequence with a grammar runs
in synchronous steps (as speculative decoding's do) and never drafts.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from tilellm.engine.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A grammar the backend cannot compile (the message names the problem)."""


class GrammarBackend:
    """Compiles `StructuredOutputsParams` for one tokenizer and makes per-sequence matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        try:
            import xgrammar as xgr
        except ImportError as e:  # pragma: no cover - a dependency of the package
            raise ValueError(f"structured outputs need xgrammar ({e}); pip install xgrammar") from None
        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._compiled: dict[tuple, Any] = {}
        self.words = (vocab_size + 31) // 32

    def compile(self, so: StructuredOutputsParams) -> Any:
        key = so.key
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        c = self.compiler
        try:
            if so.json is not None:
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                compiled = c.compile_json_schema(schema, any_whitespace=so.whitespace)
            elif so.json_object:
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=so.whitespace)
            elif so.regex is not None:
                compiled = c.compile_regex(so.regex)
            elif so.choice is not None:
                alternatives = " | ".join(json.dumps(choice) for choice in so.choice)
                compiled = c.compile_grammar(f"root ::= {alternatives}")
            else:
                assert so.grammar is not None
                compiled = c.compile_grammar(so.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses with its reason
            # (its messages start with a time and a C++ source location: only the reason is kept)
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
            raise GrammarError(f"structured_outputs: the grammar does not compile: {reason}") from None
        if len(self._compiled) > 256:  # bounded: the oldest compilation goes
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[key] = compiled
        return compiled

    def matcher(self, so: StructuredOutputsParams) -> Any:
        return self.xgr.GrammarMatcher(self.compile(so))

    def bitmasks(self, matchers: list[Any]) -> np.ndarray:
        """[N, words] int32: row i the tokens matcher i allows next (all bits set: no grammar, or
        one that has terminated and now only lets the sequence end)."""
        import torch

        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(mask, i)
        return mask.numpy()
