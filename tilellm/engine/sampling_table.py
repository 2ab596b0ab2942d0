"""Request parameters of every running sequence, by block-table row, as numpy arrays.

Each step gathers its rows into the `HostSampling` that the device's sampler takes
(`tilellm.worker.sampler`), and the engine's vectorised stop checks read the same table.
"""

from __future__ import annotations

import numpy as np

from tilellm.engine.sampling_params import SamplingParams
from tilellm.kernels.sampling import seed_keys
from tilellm.worker.logits_processors import NO_TOKEN
from tilellm.worker.sampler import HostSampling


class SamplingTable:
    """Request parameters of every running sequence, by block-table row, as numpy arrays.

    Rows are written once when a sequence is admitted; each step gathers its rows, so building
    a step's sampling inputs costs a few vectorised gathers, not a loop over requests. The stop
    conditions the engine checks every step (length limit, EOS) live here too, for the same reason.
    """

    def __init__(self, max_rows: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.inv_temp = np.ones(max_rows, dtype=np.float32)
        self.greedy = np.ones(max_rows, dtype=bool)
        self.top_k = np.full(max_rows, vocab_size, dtype=np.int64)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.seed_key = np.zeros(max_rows, dtype=np.int64)
        self.num_prompt = np.zeros(max_rows, dtype=np.int64)
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.min_tokens = np.zeros(max_rows, dtype=np.int64)
        self.min_tokens_ban: dict[int, list[int]] = {}  # row -> token ids banned before min_tokens
        # -- stop checks --
        self.max_outputs = np.zeros(max_rows, dtype=np.int64)  # finished ("length") at this many outputs
        self.eos_stops = np.zeros(max_rows, dtype=bool)  # EOS ends it (not ignore_eos)
        self.python_checks = np.zeros(max_rows, dtype=bool)  # stop strings/ids, logprobs, n > 1
        # -- logits processing --
        self.penalized = np.zeros(max_rows, dtype=bool)
        self.presence = np.zeros(max_rows, dtype=np.float32)
        self.frequency = np.zeros(max_rows, dtype=np.float32)
        self.repetition = np.ones(max_rows, dtype=np.float32)
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> token ids, biases
        self.allowed: dict[int, np.ndarray] = {}  # row -> the only token ids it may draw
        # row -> its bad words' last tokens [K] and prefixes [K, P] (right-aligned, NO_TOKEN-padded)
        self.bad_words: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def set_row(
        self,
        row: int,
        params: SamplingParams,
        seed: int,
        num_prompt: int,
        eos_ids: list[int],
        max_model_len: int,
    ) -> None:
        greedy = params.temperature == 0
        self.greedy[row] = greedy
        self.inv_temp[row] = 1.0 if greedy else 1.0 / max(params.temperature, 1e-5)
        self.top_k[row] = params.top_k if params.top_k > 0 else self.vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed_key[row] = int(seed_keys(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0])
        self.num_prompt[row] = num_prompt
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.min_tokens[row] = params.min_tokens
        self.min_tokens_ban.pop(row, None)
        if params.min_tokens > 0:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
            self.min_tokens_ban[row] = [t for t in dict.fromkeys(banned) if 0 <= t < self.vocab_size]
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_outputs[row] = min(max_tokens, max_model_len - num_prompt)
        self.eos_stops[row] = not params.ignore_eos and bool(eos_ids)
        self.python_checks[row] = bool(
            params.stop
            or params.stop_token_ids
            or params.logprobs is not None
            or params.n > 1
            or params.structured_outputs is not None
        )
        self.penalized[row] = params.has_penalties
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.logit_bias.pop(row, None)
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            self.logit_bias[row] = (ids, np.fromiter(params.logit_bias.values(), dtype=np.float32))
        self.allowed.pop(row, None)
        if params.allowed_token_ids is not None:
            self.allowed[row] = np.unique(np.asarray(params.allowed_token_ids, dtype=np.int64))
        self.bad_words.pop(row, None)
        if params.bad_words_token_ids:
            self.bad_words[row] = _bad_word_arrays(params.bad_words_token_ids)

    def gather(self, rows: np.ndarray, num_tokens: np.ndarray) -> HostSampling:
        """Inputs for `rows` sampling their token number `num_tokens - num_prompt`."""
        steps = num_tokens - self.num_prompt[rows]
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        out = HostSampling(
            rows=rows,
            steps=steps,
            inv_temp=self.inv_temp[rows],
            seed_keys=self.seed_key[rows],
            all_greedy=all_greedy,
            greedy=greedy if not all_greedy and greedy.any() else None,
            max_num_logprobs=int(self.logprobs[rows].max()) if len(rows) else -1,
        )
        if not all_greedy:
            top_k = self.top_k[rows]
            if (top_k < self.vocab_size).any():
                out.top_k, out.max_top_k = top_k, int(top_k.max())
            top_p = self.top_p[rows]
            if (top_p < 1).any():
                out.top_p = top_p
            min_p = self.min_p[rows]
            if (min_p > 0).any():
                out.min_p = min_p
        if self.penalized[rows].any():
            out.penalty_rows = rows
            out.presence, out.frequency = self.presence[rows], self.frequency[rows]
            out.repetition = self.repetition[rows]
        if self.logit_bias:
            pairs = [(i, self.logit_bias[r]) for i, r in enumerate(rows.tolist()) if r in self.logit_bias]
            if pairs:
                out.bias_pairs = np.concatenate(
                    [np.stack([np.full(len(ids), i), ids]) for i, (ids, _) in pairs], axis=1
                )
                out.bias_values = np.concatenate([v for _, (_, v) in pairs])
        if self.allowed:
            which = [(i, self.allowed[r]) for i, r in enumerate(rows.tolist()) if r in self.allowed]
            if which:
                out.allowed_pairs = np.concatenate(
                    [np.stack([np.full(len(ids), i), ids]) for i, ids in which], axis=1
                )
                out.allowed_rows = np.zeros(len(rows), dtype=bool)
                out.allowed_rows[[i for i, _ in which]] = True
        if self.bad_words:
            which = [(i, self.bad_words[r]) for i, r in enumerate(rows.tolist()) if r in self.bad_words]
            if which:
                _gather_bad_words(out, rows, which)
        if self.min_tokens_ban:
            short = np.nonzero(steps < self.min_tokens[rows])[0]
            pairs = [(i, t) for i in short.tolist() for t in self.min_tokens_ban.get(int(rows[i]), [])]
            if pairs:
                out.banned = np.asarray(pairs, dtype=np.int64).T.copy()
        return out


def _bad_word_arrays(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """A request's bad-word token sequences as last tokens [K] and prefixes [K, P]."""
    width = max(len(t) for t in seqs) - 1
    prefixes = np.full((len(seqs), width), NO_TOKEN, dtype=np.int64)
    for k, t in enumerate(seqs):
        if len(t) > 1:
            prefixes[k, width - len(t) + 1 :] = t[:-1]
    return np.asarray([t[-1] for t in seqs], dtype=np.int64), prefixes


def _gather_bad_words(
    out: HostSampling, rows: np.ndarray, which: list[tuple[int, tuple[np.ndarray, np.ndarray]]]
) -> None:
    """The step's bad words (`which`: step row, its table entry) into `out`; the prefixes and
    the slots only when a word has more than one token."""
    out.bad_word_pairs = np.concatenate(
        [np.stack([np.full(len(ids), i), ids]) for i, (ids, _) in which], axis=1
    )
    width = max(p.shape[1] for _, (_, p) in which)
    if width:
        out.bad_word_prefixes = np.concatenate(
            [np.pad(p, ((0, 0), (width - p.shape[1], 0)), constant_values=NO_TOKEN) for _, (_, p) in which]
        )
        out.bad_word_slots = rows
