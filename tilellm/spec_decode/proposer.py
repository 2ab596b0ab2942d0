"""The proposer interface, and the proposer a `SpeculativeConfig` names.

Two kinds, told apart by `needs_device`:
  - host proposers (n-gram; a suffix tree would be another) draft from the token ids alone,
    before the step is scheduled: `propose(seq_id, token_ids, max_drafts) -> list[int]`;
  - model proposers (a draft model; EAGLE heads and DeepSeek's MTP layers are the same shape)
    run on the device after the step is scheduled, over the scheduled batch: the engine reserves
    `max_drafts` placeholder tokens for each sequence and the model runner fills them in
    (`ModelRunner.propose_drafts`).
"""

from __future__ import annotations

from typing import Protocol

from tilellm.config import SpeculativeConfig
from tilellm.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    method: str
    num_speculative_tokens: int
    needs_device: bool

    def propose(self, seq_id: int, token_ids: list[int], max_drafts: int) -> list[int]: ...

    def forget(self, seq_id: int) -> None: ...


class DeviceProposer:
    """A model proposer's host half: it reserves draft slots (the runner drafts into them) and
    remembers, per sequence, how many leading tokens have valid K/V in the draft model's cache.

    That count is only good while the sequence keeps its blocks: it is keyed by the sequence's
    admission (`admit_order`), so a preempted and readmitted sequence starts from 0."""

    needs_device = True

    def __init__(self, method: str, num_speculative_tokens: int):
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens
        self._computed: dict[int, tuple[int, int]] = {}  # seq id -> (admit_order, tokens)

    def propose(self, seq_id: int, token_ids: list[int], max_drafts: int) -> list[int]:
        return [-1] * min(max_drafts, self.num_speculative_tokens)

    def num_computed(self, seq_id: int, admit_order: int, num_target_computed: int) -> int:
        """Leading tokens whose draft K/V is valid: never more than the target's (a rejected
        token's K/V is as stale in the draft's cache as in the target's)."""
        order, n = self._computed.get(seq_id, (-1, 0))
        return min(n, num_target_computed) if order == admit_order else 0

    def record(self, seq_id: int, admit_order: int, num_computed: int) -> None:
        self._computed[seq_id] = (admit_order, num_computed)

    def forget(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    return DeviceProposer(config.method, config.num_speculative_tokens)
