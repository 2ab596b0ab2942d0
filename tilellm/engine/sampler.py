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


def seed_keys(seeds: np.ndarray) -> np.ndarray:
    """uint32 key of each 64-bit seed (uint64), computed once per sequence."""
    seeds = seeds.astype(np.uint64)
    lo = (seeds & np.uint64(_MASK32)).astype(np.uint32)
    hi = (seeds >> np.uint64(32)).astype(np.uint32)
    return _mix32_np(lo ^ _mix32_np(hi))


def row_keys(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """uint32 noise key of each row from its 64-bit seed and the index of the token it samples.

    The sampler computes the same on the device from `seed_keys(seeds)` and `steps`."""
    return _mix32_np(seed_keys(seeds) ^ _mix32_np(steps.astype(np.uint32) ^ np.uint32(_GOLDEN)))


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


def device_row_keys(seed_keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`row_keys` on the device: int64 tensors holding uint32 values."""
    return _mix32_torch(seed_keys ^ _mix32_torch((steps & _MASK32) ^ _GOLDEN))


def gumbel_argmax_torch(
    logits: torch.Tensor, inv_temp: torch.Tensor, seed_keys: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """argmax_v(logits[i, v] * inv_temp[i] + g[i, v]); [N] int64. Pure PyTorch."""
    noise = gumbel_noise(device_row_keys(seed_keys, steps), logits.shape[1])
    return (logits.float() * inv_temp[:, None] + noise).argmax(dim=-1)


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
        logits_ptr,
        stride_row,
        inv_temp_ptr,
        seed_keys_ptr,
        steps_ptr,
        part_val_ptr,
        part_idx_ptr,
        V,
        num_chunks,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program (row, chunk): the max of logits * inv_temp + gumbel noise over one vocab chunk."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        inv_t = tl.load(inv_temp_ptr + row)
        # -- row key: the same as device_row_keys() --
        step = (tl.load(steps_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
        key = _mix32_tl(tl.load(seed_keys_ptr + row).to(tl.uint32) ^ _mix32_tl(step ^ 0x9E3779B9))
        # Per-lane running best: elementwise selects in the loop, one reduction at the end.
        lane_val = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            in_vocab = idx < V
            x = tl.load(logits_ptr + row * stride_row + idx, mask=in_vocab, other=float("-inf"))
            # -- noise: the same hash as gumbel_noise() --
            h = _mix32_tl(idx.to(tl.uint32) ^ key)
            h = _mix32_tl(h + key)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            v = x.to(tl.float32) * inv_t - tl.log(-tl.log(u))
            v = tl.where(in_vocab, v, float("-inf"))
            better = v > lane_val  # strict: a lane keeps its first index on ties
            lane_idx = tl.where(better, idx, lane_idx)
            lane_val = tl.where(better, v, lane_val)
        best_val = tl.max(lane_val, axis=0)
        # The smallest index among the lanes holding the maximum: the chunk's first best.
        best_idx = tl.min(tl.where(lane_val == best_val, lane_idx, 2147483647), axis=0)
        tl.store(part_val_ptr + row * num_chunks + chunk, best_val)
        tl.store(part_idx_ptr + row * num_chunks + chunk, best_idx.to(tl.int64))

    _GUMBEL_BLOCK = 2048
    _GUMBEL_CHUNK = 4 * _GUMBEL_BLOCK  # vocab entries per program: V=151936 -> 19 programs per row

    def gumbel_argmax_triton(
        logits: torch.Tensor, inv_temp: torch.Tensor, seed_keys: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        """Same result as `gumbel_argmax_torch` (up to float rounding): (rows x vocab chunks)
        programs each find their chunk's best, then the first best chunk of each row wins."""
        n, v = logits.shape
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        chunks = triton.cdiv(v, _GUMBEL_CHUNK)
        part_val = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
        part_idx = torch.empty((n, chunks), dtype=torch.int64, device=logits.device)
        _gumbel_argmax_kernel[(n, chunks)](
            logits,
            logits.stride(0),
            inv_temp,
            seed_keys,
            steps,
            part_val,
            part_idx,
            v,
            chunks,
            CHUNK=_GUMBEL_CHUNK,
            BLOCK=_GUMBEL_BLOCK,
        )
        best_chunk = part_val.argmax(dim=1, keepdim=True)  # first maximum: ties keep the lowest index
        return part_idx.gather(1, best_chunk)[:, 0]

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


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


@dataclass
class SamplerOutput:
    """Device tensors: sampled tokens, and when asked the sampled token's logprob and rank and
    the top-k logprobs of every row."""

    token_ids: torch.Tensor  # [N] int64
    sampled_logprobs: torch.Tensor | None = None  # [N] float32
    sampled_ranks: torch.Tensor | None = None  # [N] int64
    top_logprobs: torch.Tensor | None = None  # [N, K] float32
    top_token_ids: torch.Tensor | None = None  # [N, K] int64


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

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays the sampler needs on the device, by name."""
        names = ("inv_temp", "seed_keys", "steps", "greedy", "top_k", "top_p", "min_p", "banned")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

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
        )

    def to_cpu_metadata(self) -> SamplingMetadata:
        return self.to_metadata(
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.device_arrays().items()}
        )


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
            params.stop or params.stop_token_ids or params.logprobs is not None or params.n > 1
        )

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
        if self.min_tokens_ban:
            short = np.nonzero(steps < self.min_tokens[rows])[0]
            pairs = [(i, t) for i in short.tolist() for t in self.min_tokens_ban.get(int(rows[i]), [])]
            if pairs:
                out.banned = np.asarray(pairs, dtype=np.int64).T.copy()
        return out


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

    def _gumbel_argmax(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        use_triton = self.use_triton if self.use_triton is not None else logits.is_cuda
        if use_triton and HAS_TRITON:
            return gumbel_argmax_triton(logits, md.inv_temperature, md.seed_keys, md.steps)
        return gumbel_argmax_torch(logits, md.inv_temperature, md.seed_keys, md.steps)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # Plain greedy and temperature sampling read the model's logits as they are (bf16/fp16
        # widen exactly inside argmax and the Gumbel kernel): no float32 copy of [N, V], which at
        # 256 rows of a 152k vocabulary costs more than the draw itself. Filters, bans and
        # logprobs compute in float32.
        filters = md.min_p is not None or md.top_k is not None or md.top_p is not None
        if filters or md.banned is not None or md.max_num_logprobs >= 0:
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs >= 0 else None
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
