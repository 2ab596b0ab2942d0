"""Token sampling on the device, without a host sync.

Greedy rows take the argmax. Random rows use the Gumbel-max trick (`tilellm.kernels.sampling`):
the token is `argmax(logits / temperature + g)`, with noise from a counter-based hash of the
sequence's seed and the index of the token, so seeded sequences are reproducible in any batch.

Logits processing first (`tilellm.worker.logits_processors`, vLLM's order): repetition,
frequency and presence penalties, logit bias, allowed tokens, bad words. Then filters (applied
before the draw, in vLLM's order): min-p, then top-k and top-p; each sets the excluded logits to
-inf. `min_tokens` bans EOS and the stop tokens of the rows that have not reached it. Logprobs
are of the raw model distribution (before processing, temperature and filters), as vLLM's by
default.

Host-side decisions (which filters any row uses, the largest top-k, how many logprobs) arrive
as plain Python values in `SamplingMetadata`, so nothing here reads a device value. The host
builds each step's `HostSampling` from its per-row table (`tilellm.engine.sampling_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tilellm.kernels.sampling import gumbel_argmax_torch, gumbel_argmax_triton
from tilellm.worker.logits_processors import (
    BadWordsState,
    PenaltyState,
    apply_bad_words,
    apply_bias_and_allowed,
    apply_penalties,
    apply_token_bitmask,
)
from tilellm.worker.rejection import DraftVerification, rejection_sample

# -- per-step inputs ----------------------------------------------------------------------------


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step (device tensors) and host-known switches.

    inv_temperature: [N] float32 (1 for greedy rows); seed_keys: [N] int64 (uint32 key of each
    row's seed); steps: [N] int64 (index of the token each row samples: its noise counter);
    greedy: [N] bool, only when the batch mixes greedy and random rows (else `all_greedy` says);
    top_k: [N] int64 (V = off) or None when no row filters; top_p / min_p: [N] float32 or None;
    banned: (rows, token ids) int64 pairs set to -inf (min_tokens), or None.
    """

    inv_temperature: torch.Tensor
    seed_keys: torch.Tensor
    steps: torch.Tensor
    all_greedy: bool
    greedy: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int = -1  # -1: no row wants logprobs
    # Logits processing (None: no row uses it). penalty_rows: [N] int64 sequence slot of each row
    # (its token counts in the PenaltyState); presence / frequency / repetition: [N] float32.
    penalty_rows: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, values
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids: all a row may draw
    allowed_rows: torch.Tensor | None = None  # [N] bool: rows restricted to `allowed`
    # Bad words: (rows, token ids) [K] each, banned where the prefix [K, P] matches the row's last
    # P output tokens (`apply_bad_words`); bad_word_slots [N] int64 sequence slot of each row (its
    # recent tokens in the BadWordsState), with the prefixes only (single-token words need neither).
    bad_words: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_word_prefixes: torch.Tensor | None = None
    bad_word_slots: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None  # [N, ceil(V / 32)] int32: structured outputs' allowed tokens


@dataclass
class PromptLogprobs:
    """Prompt logprobs of M rows: each row's next prompt token's logprob and rank, and the top k.

    token_logprobs: [M] float32; ranks: [M] int64; top_logprobs / top_token_ids: [M, K] (K may
    be 0). Device tensors from the runner, numpy arrays on the host (`map`)."""

    token_logprobs: Any
    ranks: Any
    top_logprobs: Any
    top_token_ids: Any

    def map(self, fn: Any) -> PromptLogprobs:
        return PromptLogprobs(
            *(fn(getattr(self, f)) for f in ("token_logprobs", "ranks", "top_logprobs", "top_token_ids"))
        )

    @staticmethod
    def cat(parts: list[PromptLogprobs]) -> PromptLogprobs:
        if len(parts) == 1:
            return parts[0]
        names = ("token_logprobs", "ranks", "top_logprobs", "top_token_ids")
        return PromptLogprobs(*(torch.cat([getattr(p, n) for p in parts]) for n in names))


def prompt_logprobs_of(logits: torch.Tensor, targets: torch.Tensor, k: int) -> PromptLogprobs:
    """logits [M, V] of prompt rows, targets [M] the prompt tokens they predict; the top `k`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = lp.gather(1, targets[:, None])
    ranks = (lp > target).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], targets[:, None][:, :0])
    return PromptLogprobs(target[:, 0], ranks, top_lp, top_ids)


@dataclass
class SamplerOutput:
    """Device tensors: sampled tokens, and when asked the sampled token's logprob and rank and
    the top-k logprobs of every row."""

    token_ids: torch.Tensor  # [N] int64
    sampled_logprobs: torch.Tensor | None = None  # [N] float32
    sampled_ranks: torch.Tensor | None = None  # [N] int64
    top_logprobs: torch.Tensor | None = None  # [N, K] float32
    top_token_ids: torch.Tensor | None = None  # [N, K] int64
    prompt: PromptLogprobs | None = None  # set by the runner: the step's prompt logprobs


@dataclass
class HostSampling:
    """One step's sampling inputs on the host (numpy), from `SamplingTable.gather`.

    Arrays are None when no row needs them; `rows` and `steps` are also what the engine's
    vectorised stop checks use after the step.
    """

    rows: np.ndarray  # [N] int64 block-table rows of the sampled sequences
    steps: np.ndarray  # [N] int64 index of the token each row samples (0 = first output token)
    inv_temp: np.ndarray
    seed_keys: np.ndarray
    all_greedy: bool
    greedy: np.ndarray | None = None
    top_k: np.ndarray | None = None
    max_top_k: int = 0
    top_p: np.ndarray | None = None
    min_p: np.ndarray | None = None
    banned: np.ndarray | None = None  # [2, K]: rows, token ids
    max_num_logprobs: int = -1
    penalty_rows: np.ndarray | None = None  # [N] int64 slots, with presence / frequency / repetition
    presence: np.ndarray | None = None
    frequency: np.ndarray | None = None
    repetition: np.ndarray | None = None
    bias_pairs: np.ndarray | None = None  # [2, K] int64: rows, token ids
    bias_values: np.ndarray | None = None  # [K] float32
    allowed_pairs: np.ndarray | None = None  # [2, K] int64: rows, token ids
    allowed_rows: np.ndarray | None = None  # [N] bool
    bad_word_pairs: np.ndarray | None = None  # [2, K] int64: rows, banned token ids
    bad_word_prefixes: np.ndarray | None = None  # [K, P] int64, right-aligned, NO_TOKEN-padded
    bad_word_slots: np.ndarray | None = None  # [N] int64 slots (with the prefixes)
    max_num_prompt_logprobs: int = -1  # the top k of the step's prompt logprobs (-1: none asked)
    # (structured outputs' token bitmask is filled later, while the forward runs: `ModelRunner.launch`)

    _DEVICE = (
        "inv_temp", "seed_keys", "steps", "greedy", "top_k", "top_p", "min_p", "banned",
        "penalty_rows", "presence", "frequency", "repetition", "bias_pairs", "bias_values",
        "allowed_pairs", "allowed_rows", "bad_word_pairs", "bad_word_prefixes", "bad_word_slots",
    )  # fmt: skip

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays the sampler needs on the device, by name."""
        return {n: getattr(self, n) for n in self._DEVICE if getattr(self, n) is not None}

    def to_metadata(self, dev: dict[str, torch.Tensor]) -> SamplingMetadata:
        """Assemble the SamplingMetadata from the device copies of `device_arrays()`."""
        banned = dev.get("banned")
        return SamplingMetadata(
            inv_temperature=dev["inv_temp"],
            seed_keys=dev["seed_keys"],
            steps=dev["steps"],
            all_greedy=self.all_greedy,
            greedy=dev.get("greedy"),
            top_k=dev.get("top_k"),
            max_top_k=self.max_top_k,
            top_p=dev.get("top_p"),
            min_p=dev.get("min_p"),
            banned=None if banned is None else (banned[0], banned[1]),
            max_num_logprobs=self.max_num_logprobs,
            penalty_rows=dev.get("penalty_rows"),
            presence=dev.get("presence"),
            frequency=dev.get("frequency"),
            repetition=dev.get("repetition"),
            bias=None
            if "bias_pairs" not in dev
            else (dev["bias_pairs"][0], dev["bias_pairs"][1], dev["bias_values"]),
            allowed=None
            if "allowed_pairs" not in dev
            else (dev["allowed_pairs"][0], dev["allowed_pairs"][1]),
            allowed_rows=dev.get("allowed_rows"),
            bad_words=None
            if "bad_word_pairs" not in dev
            else (dev["bad_word_pairs"][0], dev["bad_word_pairs"][1]),
            bad_word_prefixes=dev.get("bad_word_prefixes"),
            bad_word_slots=dev.get("bad_word_slots"),
        )

    def to_cpu_metadata(self) -> SamplingMetadata:
        return self.to_metadata(
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.device_arrays().items()}
        )


# -- the sampler --------------------------------------------------------------------------------


def _filter_mask(scaled: torch.Tensor, md: SamplingMetadata) -> torch.Tensor | None:
    """True where min-p / top-k / top-p exclude a token; None when no filter is on."""
    mask = None
    if md.min_p is not None:
        probs = torch.softmax(scaled, dim=-1)
        mask = probs < md.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(mask, float("-inf"))
    if md.top_p is None and md.top_k is not None:
        k_max = min(md.max_top_k, scaled.shape[1])
        top_vals = scaled.topk(k_max, dim=-1).values
        kth = top_vals.gather(1, (md.top_k.clamp(max=k_max) - 1)[:, None])
        kth = torch.where(md.top_k[:, None] >= scaled.shape[1], float("-inf"), kth)
        k_mask = scaled < kth
        mask = k_mask if mask is None else mask | k_mask
    elif md.top_p is not None:
        vals, order = scaled.sort(dim=-1, descending=True)
        remove = torch.zeros_like(vals, dtype=torch.bool)
        if md.top_k is not None:
            ranks = torch.arange(vals.shape[1], device=vals.device)[None, :]
            remove = ranks >= md.top_k[:, None]
            vals = vals.masked_fill(remove, float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
        remove = remove | (before > md.top_p[:, None])
        p_mask = torch.zeros_like(remove).scatter_(1, order, remove)
        mask = p_mask if mask is None else mask | p_mask
    return mask


class Sampler:
    """logits [N, V] -> SamplerOutput, all on the logits' device; no host sync."""

    def __init__(
        self,
        use_triton: bool | None = None,
        penalties: PenaltyState | None = None,
        bad_words: BadWordsState | None = None,
    ):
        self.use_triton = use_triton
        self.penalties = penalties  # token counts of every sequence slot (penalties need them)
        self.bad_words = bad_words  # recent output tokens of every sequence slot (bad words need them)

    def _gumbel_argmax(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        use_triton = self.use_triton if self.use_triton is not None else logits.is_cuda
        if use_triton:
            return gumbel_argmax_triton(logits, md.inv_temperature, md.seed_keys, md.steps)
        return gumbel_argmax_torch(logits, md.inv_temperature, md.seed_keys, md.steps)

    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata, drafts: DraftVerification | None = None
    ) -> SamplerOutput:
        """`drafts`: draft tokens with full proposal distributions to accept or replace
        (`tilellm.worker.rejection`); point-mass drafts need nothing here."""
        # Plain greedy and temperature sampling read the model's logits as they are (bf16/fp16
        # widen exactly inside argmax and the Gumbel kernel): no float32 copy of [N, V], which at
        # 256 rows of a 152k vocabulary costs more than the draw itself. Filters, bans and
        # logprobs compute in float32.
        filters = md.min_p is not None or md.top_k is not None or md.top_p is not None
        processing = (
            md.penalty_rows is not None
            or md.bias is not None
            or md.allowed is not None
            or md.bad_words is not None
            or md.token_bitmask is not None
        )
        if filters or processing or md.banned is not None or md.max_num_logprobs >= 0:
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs >= 0 else None
        if md.penalty_rows is not None:
            st = self.penalties
            assert st is not None and st.counts is not None, "penalty rows without their token counts"
            rows = md.penalty_rows
            logits = apply_penalties(
                logits, st.counts[rows], st.in_prompt[rows], md.presence, md.frequency, md.repetition
            )
        if md.bias is not None or md.allowed is not None:
            logits = apply_bias_and_allowed(logits, md.bias, md.allowed, md.allowed_rows)
        if md.bad_words is not None:
            recent = None
            if md.bad_word_slots is not None:
                assert self.bad_words is not None, "bad-word prefixes without the slots' recent tokens"
                recent = self.bad_words.recent[md.bad_word_slots]
            logits = apply_bad_words(logits, recent, md.bad_words, md.bad_word_prefixes)
        if md.token_bitmask is not None:
            logits = apply_token_bitmask(logits, md.token_bitmask)
        if md.banned is not None:  # a fill kernel, not a host scalar copied to the device
            logits = logits.clone()
            logits[md.banned] = float("-inf")
        if md.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            inv_temp = md.inv_temperature
            if md.min_p is not None or md.top_k is not None or md.top_p is not None:
                mask = _filter_mask(logits * inv_temp[:, None], md)
                if mask is not None:
                    logits = logits.masked_fill(mask, float("-inf"))
            tokens = self._gumbel_argmax(logits, md)
            if drafts is not None:
                rows = drafts.rows
                target = torch.softmax(logits[rows].float() * inv_temp[rows, None], dim=-1)
                checked = rejection_sample(
                    target, drafts.token_ids, drafts.probs, md.seed_keys[rows], md.steps[rows]
                )
                tokens = tokens.index_copy(0, rows, checked)
            if md.greedy is not None:
                tokens = torch.where(md.greedy, logits.argmax(dim=-1), tokens)
        if md.penalty_rows is not None:  # the tokens counted for the next steps' penalties
            self.penalties.add_tokens(md.penalty_rows, tokens)
        if md.bad_word_slots is not None:  # the recent tokens the next steps' prefixes match
            self.bad_words.add_tokens(md.bad_word_slots, tokens)
        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None:
            sampled = raw_logprobs.gather(1, tokens[:, None])
            out.sampled_logprobs = sampled[:, 0]
            out.sampled_ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
            if md.max_num_logprobs > 0:
                out.top_logprobs, out.top_token_ids = raw_logprobs.topk(md.max_num_logprobs, dim=-1)
        return out
