"""Sampling parameters of one request, with vLLM's names, defaults and value checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy (as in vLLM): dividing by them would overflow the logits.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 128  # samples per prompt (OpenAI's limit on `n`)
# Stop strings are matched against every new token's text: bounded so that one request cannot
# make every step slow (OpenAI allows 4; vLLM sets no bound).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # their total length
# Bad words (vLLM's limits): token sequences per request, after tokenization, and the longest
# prefix a sequence may have (the device keeps that many recent output tokens per sequence slot).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_PREFIX = 16


class RequestOutputKind(enum.Enum):
    """Which outputs `LLMEngine.step` hands out for a request (vLLM's names and values).

    CUMULATIVE: after every step, everything so far (delta outputs instead where the engine's
    `output_deltas` is on: the server's engine). DELTA: after every step, only what is new.
    FINAL_ONLY: one output, when the request finishes, with everything (a non-streamed server
    request: no per-step output to build, send or wake a handler for).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """What the output must be (vLLM's `StructuredOutputsParams`; exactly one field set).

    json: a JSON schema (dict or JSON string); json_object: any JSON object; regex: a regular
    expression; choice: one of these strings; grammar: an EBNF grammar (xgrammar's GBNF).
    JSON is compact (no whitespace between tokens) unless `whitespace` is True, so that a weak
    model cannot run away in spaces.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        chosen += ["json_object"] if self.json_object else []
        if len(chosen) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {chosen or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (a dict or a JSON string)")

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (its cache key)."""
        import json as _json

        schema = (
            self.json
            if isinstance(self.json, str) or self.json is None
            else _json.dumps(self.json, sort_keys=True)
        )
        return (schema, self.regex, tuple(self.choice or ()), self.grammar, self.json_object, self.whitespace)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request (vLLM-compatible).

    temperature 0 is greedy; `top_k` -1 or 0 and `top_p` 1 and `min_p` 0 turn those filters off.
    `seed` makes a request's tokens reproducible whatever else shares its batches. `stop` strings
    end generation and are cut from the text; `stop_token_ids` end it and stay in `token_ids`.
    `min_tokens` suppresses EOS and `stop_token_ids` until that many tokens exist. `logprobs=k`
    returns the sampled token's log-probability plus the top-k of each step (raw model distribution).

    Logits processing, before temperature and the filters (vLLM's definitions):
    `repetition_penalty` r (1 = off) divides the positive logits and multiplies the negative ones
    of every token seen in the prompt or the output; `frequency_penalty` f and `presence_penalty`
    p (0 = off, in [-2, 2]) subtract f x (times the token was generated) and p x (whether it was);
    `logit_bias` {token id: bias in [-100, 100]} adds to logits; `allowed_token_ids` keeps only
    those tokens. `bad_words`: words never generated: each word's token sequences (the word and
    " " + word, as vLLM's `update_from_tokenizer` makes them) have their last token banned (-inf)
    at every step whose last output tokens are the rest of the sequence (the prompt does not
    count). `structured_outputs` (`StructuredOutputsParams`): the output follows a JSON
    schema, a regex, a choice or a grammar (token masks from xgrammar). `prompt_logprobs=k`: each
    prompt token's log-probability given the tokens before it, with the top k (the first token
    has none); such a request skips the prefix cache, whose blocks hold no logits.
    `output_kind` (`RequestOutputKind`): which outputs `LLMEngine.step` returns for the request
    (`LLM.generate` returns each request once, finished, whatever it says).
    Invalid values raise ValueError naming the field; an unknown keyword raises TypeError naming it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The token sequences of `bad_words`, set by `update_from_tokenizer` (the engine calls it).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check()
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} if self.logit_bias else None
        self.allowed_token_ids = list(self.allowed_token_ids) if self.allowed_token_ids is not None else None
        self.bad_words = list(dict.fromkeys(self.bad_words)) if self.bad_words else None
        if self.temperature < GREEDY_EPS:
            # Greedy: the other filters cannot change an argmax.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, -1, 0.0
        if self.top_k == 0:
            self.top_k = -1
        self.longest_stop = max((len(s) for s in self.stop), default=0)

    def _check(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not _is_number(self.temperature) or not self.temperature >= 0 or self.temperature == float("inf"):
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be -1 or 0 (off) or an integer >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (
            not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops)
        ):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if stops is not None and not isinstance(stops, str):
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(
                    f"SamplingParams.stop has {len(stops)} strings; the limit is {MAX_STOP_STRINGS}"
                )
            total = sum(len(s) for s in stops)
            if total > MAX_STOP_CHARS:
                raise ValueError(
                    f"SamplingParams.stop strings total {total} characters; the limit is {MAX_STOP_CHARS}"
                )
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids)
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "must be a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        plp = self.prompt_logprobs
        if plp is not None and (not _is_int(plp) or not 0 <= plp <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise bad(name, "must be a number in [-2, 2]")
        r = self.repetition_penalty
        if not _is_number(r) or not 0 < r <= 100 or r != r:
            raise bad("repetition_penalty", "must be a number in (0, 100] (1 = off)")
        lb = self.logit_bias
        if lb is not None and (
            not isinstance(lb, dict)
            or not all(_is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in lb.items())
        ):
            raise bad("logit_bias", "must map token ids (integers >= 0) to biases in [-100, 100]")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, (list, tuple))
            or not allowed
            or not all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise bad("bad_words", "must be a list of non-empty strings")
        if words is not None and len(words) > MAX_BAD_WORDS:
            raise ValueError(f"SamplingParams.bad_words has {len(words)} words; the limit is {MAX_BAD_WORDS}")

    def check_request(self, num_prompt_tokens: int, max_model_len: int, vocab_size: int) -> int:
        """The one rule for a request of a `num_prompt_tokens`-token prompt with these settings,
        offline (`LLMEngine.add_request`) and in the server (before admission); returns how many
        tokens it may generate at most.

        The prompt must be non-empty and shorter than `max_model_len` (a prompt of exactly
        max_model_len tokens leaves no room for one output token); `max_tokens` larger than the
        room left is cut to it (generation then ends with finish_reason "length");
        `stop_token_ids` must lie in [0, vocab_size). ValueError naming the field otherwise.
        """
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= max_model_len:
            how = "longer than" if num_prompt_tokens > max_model_len else "as long as"
            raise ValueError(
                f"the prompt ({num_prompt_tokens} tokens) is {how} max_model_len ({max_model_len}); "
                "it must be shorter, to leave room for at least one output token: shorten the prompt"
            )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids or ()),
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", [t for seq in self._bad_words_token_ids or () for t in seq]),
        ):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"SamplingParams.{name}: token id {bad} is outside the vocabulary [0, {vocab_size})"
                )
        room = max_model_len - num_prompt_tokens
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` (vLLM's rule): each word, without its leading whitespace, as is
        and after a space; the spaced form is kept when it starts with another token and has as
        many tokens (the same word in the middle of a text), as vLLM's `update_from_tokenizer`.
        ValueError naming `bad_words` when a word gives no token, there are more than
        MAX_BAD_WORDS sequences, or one is longer than MAX_BAD_WORD_PREFIX + 1 tokens."""
        if not self.bad_words:
            self._bad_words_token_ids = None
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain:
                raise ValueError(f"SamplingParams.bad_words: {word!r} gives no token")
            if len(plain) > MAX_BAD_WORD_PREFIX + 1:
                raise ValueError(
                    f"SamplingParams.bad_words: {word!r} is {len(plain)} tokens; "
                    f"the limit is {MAX_BAD_WORD_PREFIX + 1}"
                )
            seqs.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        if len(seqs) > MAX_BAD_WORDS:
            raise ValueError(
                f"SamplingParams.bad_words make {len(seqs)} token sequences; the limit is {MAX_BAD_WORDS}"
            )
        self._bad_words_token_ids = seqs

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The token sequences of `bad_words` (after `update_from_tokenizer`), else None."""
        return self._bad_words_token_ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalty on (they depend on the tokens so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Anything that changes the logits before sampling besides temperature and the filters."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )
