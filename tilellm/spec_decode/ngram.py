"""N-gram prompt lookup: draft the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`, longest first).

The lookup is an index per sequence, kept up to date as tokens are appended: for every n, a dict
from each n-gram to the position just after its latest occurrence. A proposal then costs one dict
lookup per n, whatever the sequence's length; indexing costs O(n range) per new token.
"""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a token list last occurred.

    `ends[n - min_n][gram]` is the position right after the latest occurrence of `gram` among
    the n-grams that end before the list's last token (the last n-gram itself is what a proposal
    looks up, so it must not find itself).
    """

    __slots__ = ("min_n", "max_n", "ends", "num_indexed")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self.num_indexed = 0  # n-grams ending at positions < num_indexed are in `ends`

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams of `tokens` that end at positions < `upto` (tokens only grow)."""
        min_n, ends = self.min_n, self.ends
        for end in range(self.num_indexed, upto):  # the n-grams tokens[end - n + 1 : end + 1]
            for i, table in enumerate(ends):
                n = min_n + i
                if end + 1 < n:
                    break
                table[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, upto)

    def lookup(self, tokens: list[int], max_drafts: int) -> list[int]:
        """The tokens after the latest earlier occurrence of the longest matching suffix."""
        last = len(tokens) - 1
        self.extend(tokens, last)
        for i in range(len(self.ends) - 1, -1, -1):
            n = self.min_n + i
            if n > len(tokens):
                continue
            start = self.ends[i].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                # What followed the occurrence; past the end of the list the match overlaps the
                # draft itself and the copy goes on from it (the sequence repeats with period
                # len(tokens) - start), as an LZ77 copy does.
                draft = tokens[start : start + max_drafts]
                while len(draft) < max_drafts:
                    draft.append(draft[start + len(draft) - len(tokens)])
                return draft
        return []


class NgramProposer:
    """Prompt-lookup drafts for each sequence (see the module docstring).

    Indexes are kept per sequence id and dropped with `forget`, when the sequence finishes.
    """

    method = "ngram"
    needs_device = False

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` (<= num_speculative_tokens) draft tokens following `token_ids`."""
        if max_drafts <= 0:
            return []
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        return index.lookup(token_ids, min(max_drafts, self.num_speculative_tokens))

    def forget(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)
