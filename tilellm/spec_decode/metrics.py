"""What speculative decoding did: drafts proposed, tokens accepted, by draft position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counters since the engine started (vLLM's `spec_decode_*` metrics).

    A draft is one sequence's proposal verified in one step (at least one token);
    `num_accepted_tokens_per_pos[j]` counts drafts whose token j was accepted.
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.num_accepted_tokens_per_pos) < self.num_spec_tokens:
            self.num_accepted_tokens_per_pos += [0] * (
                self.num_spec_tokens - len(self.num_accepted_tokens_per_pos)
            )

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft of `num_draft_tokens` tokens, the first `num_accepted` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for j in range(num_accepted):
            per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: accepted ones plus the target's own (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
