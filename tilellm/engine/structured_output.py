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

The mask for a step needs the token drawn in the step before. The engine launches the step's
forward first and fills the mask on the host while the device runs it (after the step before
has been read back and its tokens accepted), so asynchronous scheduling goes on; only the sampler
waits for the mask. A sequence with a grammar never drafts.
"""

from __future__ import annotations

import json
import re
from typing import Any

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
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")  # fills rows in parallel
        # Compact JSON (the default) compiles against a vocabulary without the tokens that hold a
        # control byte (< 0x20): JSON never has one in a string, compact JSON none at all, and
        # xgrammar's length-bounded strings (minLength / maxLength) would admit them. Removed at
        # compile time, they cost the masks nothing.
        self._tokenizer, self._info = tokenizer, info
        self._json_compiler: Any = None
        # Two mask buffers used in turn: a step's mask is copied to the device while the next
        # step's is filled (the one before has been read back by then).
        self._buffers: list[Any] = [None, None]
        self._turn = 0

    def compile(self, so: StructuredOutputsParams) -> Any:
        key = so.key
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        compact_json = (so.json is not None or so.json_object) and not so.whitespace
        c = self._compact_json_compiler() if compact_json else self.compiler
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

    def _compact_json_compiler(self) -> Any:
        if self._json_compiler is None:
            xgr, info = self.xgr, self._info
            encoded = [""] * self.vocab_size  # "" marks a token special: never matched as text
            for token, i in self._tokenizer.get_vocab().items():
                if i < self.vocab_size:
                    encoded[i] = token
            special = set(info.special_token_ids)
            for i, token in enumerate(info.decoded_vocab[: self.vocab_size]):
                if i in special or (token and min(token) < 0x20):
                    encoded[i] = ""
            json_info = xgr.TokenizerInfo(
                encoded,
                info.vocab_type,
                vocab_size=self.vocab_size,
                stop_token_ids=info.stop_token_ids,
                add_prefix_space=info.add_prefix_space,
            )
            self._json_compiler = xgr.GrammarCompiler(json_info, max_threads=2)
        return self._json_compiler

    def bitmasks(self, matchers: list[Any], pin_memory: bool = False) -> Any:
        """[N, words] int32 CPU tensor: row i the tokens matcher i allows next (all bits set: no
        grammar, or one that has terminated and now only lets the sequence end). With
        `pin_memory` the tensor is page-locked (its copy to the device is asynchronous) and
        valid until the call after next."""
        import torch

        n = len(matchers)
        turn, self._turn = self._turn, self._turn ^ 1
        buf = self._buffers[turn]
        if buf is None or buf.shape[0] < n or buf.is_pinned() != pin_memory:
            rows = max(n, 2 * buf.shape[0] if buf is not None else 8)
            buf = torch.empty((rows, self.words), dtype=torch.int32)
            buf = self._buffers[turn] = buf.pin_memory() if pin_memory else buf
        mask = buf[:n]
        mask.fill_(-1)
        live = [(i, m) for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if live:
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], mask, [i for i, _ in live])
        return mask
