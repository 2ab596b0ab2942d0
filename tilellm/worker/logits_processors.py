"""Logits processing before sampling: penalties, logit bias, allowed tokens, bad words (vLLM's
definitions), and structured outputs' token bitmasks.

    state = PenaltyState(max_rows, vocab_size, device)   # per-slot token counts, on the device
    state.reset_row(row, prompt_ids, output_ids)          # when a sequence takes a slot
    logits = apply_penalties(logits, state, md)           # every step, batched, no host sync
    state.add_tokens(rows, tokens)                        # the step's sampled tokens

Penalties need, for each sequence, how often each token has been generated and whether it is in
the prompt. Both live on the device as one row per sequence slot (`[max_num_seqs, V]`, allocated
the first time a request asks for a penalty): a slot is reset when a sequence is admitted to it
(from its prompt and the tokens it generated before, after a preemption) and counts each token
the sampler draws for it, straight from the device, so no step waits for the host.

Bad words work the same way with less: `BadWordsState` keeps each slot's last `RECENT_TOKENS`
output tokens, reset when a sequence takes the slot and shifted by the sampler, so a step's ban
of a word's last token follows the tokens of the step before even when the host has not seen them.
"""

from __future__ import annotations

import torch


class PenaltyState:
    """Generated-token counts and prompt-token presence per sequence slot (see the module docstring)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.counts: torch.Tensor | None = None  # [max_rows, V] int32
        self.in_prompt: torch.Tensor | None = None  # [max_rows, V] bool

    def _ensure(self) -> None:
        if self.counts is None:
            shape = (self.max_rows, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def reset_row(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        self._ensure()
        assert self.counts is not None and self.in_prompt is not None
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        if prompt_ids:
            self.in_prompt[row, torch.tensor(prompt_ids, dtype=torch.int64).to(self.device)] = True
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.int64).to(self.device)
            self.counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def add_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count `tokens[i]` for slot `rows[i]` ([N] int64 each, on the device)."""
        if self.counts is None:
            return
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


# Output tokens kept per slot for bad words: at least SamplingParams' MAX_BAD_WORD_PREFIX.
RECENT_TOKENS = 16
NO_TOKEN = -1  # a recent-token entry before the first output token; a prefix entry matching anything


class BadWordsState:
    """The last RECENT_TOKENS output tokens of every sequence slot, oldest first (see the module
    docstring); NO_TOKEN where the sequence has generated fewer."""

    def __init__(self, max_rows: int, device: torch.device):
        self.device = device
        self.recent = torch.full((max_rows, RECENT_TOKENS), NO_TOKEN, dtype=torch.int64, device=device)

    def reset_row(self, row: int, output_ids: list[int]) -> None:
        """A sequence took slot `row`, having generated `output_ids` before (none when new)."""
        tail = output_ids[-RECENT_TOKENS:]
        self.recent[row].fill_(NO_TOKEN)
        if tail:
            ids = torch.tensor(tail, dtype=torch.int64)
            if self.device.type == "cuda":  # pinned: the copy does not wait for the step in flight
                ids = ids.pin_memory()
            self.recent[row, RECENT_TOKENS - len(tail) :].copy_(ids, non_blocking=True)

    def add_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append `tokens[i]` to slot `rows[i]` ([N] int64 each, on the device)."""
        self.recent[rows] = torch.cat([self.recent[rows, 1:], tokens[:, None]], dim=1)


def apply_bad_words(
    logits: torch.Tensor,
    recent: torch.Tensor | None,
    pairs: tuple[torch.Tensor, torch.Tensor],
    prefixes: torch.Tensor | None,
) -> torch.Tensor:
    """logits [N, V] float32 with -inf at each banned (row, token id) of `pairs` ([K] int64 each)
    whose prefix matches: `prefixes` [K, P] int64, right-aligned, NO_TOKEN on the left of shorter
    ones, against the row's last P output tokens `recent` [N, RECENT_TOKENS]. Without `prefixes`
    (single-token words only) every pair is banned."""
    rows, ids = pairs
    ban = torch.full(ids.shape, float("-inf"), device=logits.device)
    if prefixes is not None:
        assert recent is not None, "bad-word prefixes without the rows' recent tokens"
        p = prefixes.shape[1]
        seen = recent[:, RECENT_TOKENS - p :].index_select(0, rows)
        match = ((prefixes == NO_TOKEN) | (prefixes == seen)).all(dim=1)
        ban = torch.where(match, ban, 0.0)
    return logits.index_put((rows, ids), ban, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits [N, V] float32 with the penalties applied (vLLM's order: repetition, then frequency
    and presence). counts [N, V] int32 generated-token counts, in_prompt [N, V] bool; presence,
    frequency, repetition: [N] float32 (0, 0, 1 = off)."""
    generated = counts > 0
    seen = generated | in_prompt
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * generated


def apply_bias_and_allowed(
    logits: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    allowed: tuple[torch.Tensor, torch.Tensor] | None,
    allowed_rows: torch.Tensor | None,
) -> torch.Tensor:
    """logits [N, V] float32 plus `bias` (rows, token ids, values) and, for `allowed_rows` ([N]
    bool), -inf outside the `allowed` (rows, token ids) pairs."""
    if bias is not None:
        rows, ids, values = bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if allowed is not None and allowed_rows is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[allowed] = True
        logits = logits.masked_fill(allowed_rows[:, None] & ~keep, float("-inf"))
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with -inf where `bitmask` ([N, ceil(V / 32)] int32, bit j of word w allows
    token 32 w + j: xgrammar's layout) forbids the token."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
    return logits.masked_fill(~allowed[:, : logits.shape[1]], float("-inf"))
