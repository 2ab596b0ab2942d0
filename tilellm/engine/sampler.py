"""Token sampling on the device, without a host sync.

Greedy rows take the argmax. Random rows use the Gumbel-max trick: the token is
`argmax(logits / temperature + g)` with `g = -log(-log(u))` and `u` uniform, which samples
exactly from `softmax(logits / temperature)`. The uniforms come from a counter-based hash of
(the sequence's seed, the index of the token being sampled, the vocabulary index), so a seeded
sequence draws the same noise whatever else is in the batch, after a preemption, on any step.

Filters (applied before the draw, in vLLM's order): min-p, then top-k and top-p; each sets the
excluded logits to -inf. `min_tokens` bans EOS and the stop tokens of the rows that have not
reached it. Logprobs are of the raw model distribution (before temperature and filters).

Host-side decisions (which filters any row uses, the largest top-k, how many logprobs) arrive
as plain Python values in `SamplingMetadata`, so nothing here reads a device value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tilellm.engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


# -- counter-based hash -------------------------------------------------------------------------
# lowbias32 (a 32-bit integer finaliser): two xor-shift-multiply rounds.
_M1, _M2 = 0x7FEB352D, 0x846CA68B


def _mix32_np(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(_M1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_M2)
    x ^= x >> np.uint32(16)
    return x


def row_keys(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """uint32 key of each row from its 64-bit seed (uint64) and the index of the token it samples."""
    seeds = seeds.astype(np.uint64)
    lo = (seeds & np.uint64(_MASK32)).astype(np.uint32)
    hi = (seeds >> np.uint64(32)).astype(np.uint32)
    s = _mix32_np(steps.astype(np.uint32) ^ np.uint32(_GOLDEN))
    return _mix32_np(lo ^ _mix32_np(hi ^ s))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x < 2**32 held in int64, without overflowing int64.
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] float32 Gumbel(0, 1) noise; row i depends only on keys[i] (int64 holding a uint32)."""
    idx = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    k = keys.to(torch.int64)[:, None]
    h = _mix32_torch(idx[None, :] ^ k)
    h = _mix32_torch((h + k) & _MASK32)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def gumbel_argmax_torch(logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax_v(logits[i, v] * inv_temp[i] + g[i, v]); [N] int64. Pure PyTorch."""
    return (logits.float() * inv_temp[:, None] + gumbel_noise(keys, logits.shape[1])).argmax(dim=-1)


try:  # The Triton kernel fuses noise, scaling and the argmax into one read of the logits.
    import triton
    import triton.language as tl

    @triton.jit
    def _mix32_tl(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _gumbel_argmax_kernel(
        logits_ptr, stride_row, inv_temp_ptr, keys_ptr, out_ptr, V, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        inv_t = tl.load(inv_temp_ptr + row)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            in_vocab = idx < V
            x = tl.load(logits_ptr + row * stride_row + idx, mask=in_vocab, other=float("-inf")).to(
                tl.float32
            )
            # -- noise: the same hash as gumbel_noise() --
            h = _mix32_tl(idx.to(tl.uint32) ^ key)
            h = _mix32_tl(h + key)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            v = x * inv_t - tl.log(-tl.log(u))
            v = tl.where(in_vocab, v, float("-inf"))
            # -- running argmax; strict > keeps the first index on ties --
            blk_max = tl.max(v, axis=0)
            blk_idx = tl.argmax(v, axis=0)
            better = blk_max > best_val
            best_idx = tl.where(better, start + blk_idx, best_idx)
            best_val = tl.where(better, blk_max, best_val)
        tl.store(out_ptr + row, best_idx.to(tl.int64))

    def gumbel_argmax_triton(
        logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """Same result as `gumbel_argmax_torch` (up to float rounding), one kernel launch."""
        n, v = logits.shape
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
        if n:
            logits = logits if logits.stride(1) == 1 else logits.contiguous()
            _gumbel_argmax_kernel[(n,)](logits, logits.stride(0), inv_temp, keys, out, v, BLOCK=2048)
        return out

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


# -- per-step inputs ----------------------------------------------------------------------------


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step (device tensors) and host-known switches.

    inv_temperature: [N] float32 (1 for greedy rows); keys: [N] int64 (uint32 noise key per row);
    greedy: [N] bool, only when the batch mixes greedy and random rows (else `all_greedy` says);
    top_k: [N] int64 (V = off) or None when no row filters; top_p / min_p: [N] float32 or None;
    banned: (rows, token ids) int64 pairs set to -inf (min_tokens), or None.
    """

    inv_temperature: torch.Tensor
    keys: torch.Tensor
    all_greedy: bool
    greedy: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int = -1  # -1: no row wants logprobs


@dataclass
class SamplerOutput:
    """Device tensors: sampled tokens, and when asked the sampled token's logprob and rank and
    the top-k logprobs of every row."""

    token_ids: torch.Tensor  # [N] int64
    sampled_logprobs: torch.Tensor | None = None  # [N] float32
    sampled_ranks: torch.Tensor | None = None  # [N] int64
    top_logprobs: torch.Tensor | None = None  # [N, K] float32
    top_token_ids: torch.Tensor | None = None  # [N, K] int64


class SamplingTable:
    """Sampling parameters of every running sequence, by block-table row, as numpy arrays.

    Rows are written once when a sequence is admitted; each step gathers its rows, so building
    a step's `SamplingMetadata` costs a few vectorised gathers, not a loop over requests.
    """

    def __init__(self, max_rows: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.temperature = np.zeros(max_rows, dtype=np.float32)
        self.top_k = np.full(max_rows, vocab_size, dtype=np.int64)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.seed = np.zeros(max_rows, dtype=np.uint64)
        self.num_prompt = np.zeros(max_rows, dtype=np.int64)
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.min_tokens = np.zeros(max_rows, dtype=np.int64)
        self.min_tokens_ban: dict[int, list[int]] = {}  # row -> token ids banned before min_tokens

    def set_row(
        self, row: int, params: SamplingParams, seed: int, num_prompt: int, eos_ids: list[int]
    ) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else self.vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed[row] = seed & 0xFFFFFFFFFFFFFFFF
        self.num_prompt[row] = num_prompt
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.min_tokens[row] = params.min_tokens
        if params.min_tokens > 0:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
            self.min_tokens_ban[row] = [t for t in dict.fromkeys(banned) if 0 <= t < self.vocab_size]

    def gather(self, rows: np.ndarray, num_tokens: np.ndarray) -> dict:
        """Host arrays and switches for rows sampling their token number `num_tokens - num_prompt`."""
        temp = self.temperature[rows]
        steps = num_tokens - self.num_prompt[rows]
        greedy = temp == 0
        top_k = self.top_k[rows]
        top_p = self.top_p[rows]
        min_p = self.min_p[rows]
        use_k = bool((top_k < self.vocab_size).any())
        out = dict(
            inv_temp=np.where(greedy, 1.0, 1.0 / np.maximum(temp, 1e-5)).astype(np.float32),
            greedy=greedy,
            keys=row_keys(self.seed[rows], steps).astype(np.int64),
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            top_k=top_k if use_k else None,
            max_top_k=int(top_k.max()) if use_k else 0,
            top_p=top_p if bool((top_p < 1).any()) else None,
            min_p=min_p if bool((min_p > 0).any()) else None,
            max_num_logprobs=int(self.logprobs[rows].max()) if len(rows) else -1,
            banned=None,
        )
        short = np.nonzero(steps < self.min_tokens[rows])[0]
        if len(short):
            pairs = [(i, t) for i in short.tolist() for t in self.min_tokens_ban.get(int(rows[i]), [])]
            if pairs:
                out["banned"] = np.asarray(pairs, dtype=np.int64).T
        return out


def metadata_from_host(host: dict, to_device: Callable[[np.ndarray], torch.Tensor]) -> SamplingMetadata:
    """`SamplingTable.gather` output moved to the device by `to_device` (the runner's staging)."""

    def dev(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else to_device(a)

    banned = host["banned"]
    greedy = host["greedy"] if host["any_greedy"] and not host["all_greedy"] else None
    return SamplingMetadata(
        inv_temperature=dev(host["inv_temp"]),
        keys=dev(host["keys"]),
        all_greedy=host["all_greedy"],
        greedy=dev(greedy),
        top_k=dev(host["top_k"]),
        max_top_k=host["max_top_k"],
        top_p=dev(host["top_p"]),
        min_p=dev(host["min_p"]),
        banned=None if banned is None else (dev(banned[0]), dev(banned[1])),
        max_num_logprobs=host["max_num_logprobs"],
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

    def __init__(self, use_triton: bool | None = None):
        self.use_triton = use_triton

    def _gumbel_argmax(
        self, logits: torch.Tensor, inv_temp: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        use_triton = self.use_triton if self.use_triton is not None else logits.is_cuda
        if use_triton and HAS_TRITON:
            return gumbel_argmax_triton(logits, inv_temp, keys)
        return gumbel_argmax_torch(logits, inv_temp, keys)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs >= 0 else None
        if md.banned is not None:
            logits = logits.index_put(md.banned, torch.tensor(float("-inf"), device=logits.device))
        if md.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            inv_temp = md.inv_temperature
            if md.min_p is not None or md.top_k is not None or md.top_p is not None:
                mask = _filter_mask(logits * inv_temp[:, None], md)
                if mask is not None:
                    logits = logits.masked_fill(mask, float("-inf"))
            tokens = self._gumbel_argmax(logits, inv_temp, md.keys)
            if md.greedy is not None:
                tokens = torch.where(md.greedy, logits.argmax(dim=-1), tokens)
        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None:
            sampled = raw_logprobs.gather(1, tokens[:, None])
            out.sampled_logprobs = sampled[:, 0]
            out.sampled_ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
            if md.max_num_logprobs > 0:
                out.top_logprobs, out.top_token_ids = raw_logprobs.topk(md.max_num_logprobs, dim=-1)
        return out
