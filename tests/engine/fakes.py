"""An engine without a model, for scheduler / block manager / metadata property tests.

`FakeRunner` keeps a fake KV cache: one int per slot, the token id stored there. Each step it
stores the step's tokens at their `slot_mapping` and "predicts" the next token of each sampled
request from what it reads back through the block table. `reference_tokens` computes the same
prediction from the true token list, so any wrong slot, block table, shared block or
preemption bookkeeping changes the tokens the engine produces.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from tilellm.attention import BatchKind
from tilellm.engine.llm_engine import LLMEngine
from tilellm.worker.model_runner import InputPatch, StepHandle, StepResult
from tilellm.worker.step_inputs import StepInputs

VOCAB = 997


def next_token(context: list[int] | np.ndarray) -> int:
    """A deterministic 'model': a position-weighted hash of the whole context."""
    c = np.asarray(context, dtype=np.int64)
    w = (np.arange(len(c), dtype=np.int64) * 7919 + 13) % 10007
    return int(((c + 1) * w).sum() % VOCAB)


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class FakeRunner:
    def __init__(self, config, max_model_len: int = 64):
        self.config = config
        self.hf_config = types.SimpleNamespace(vocab_size=VOCAB, eos_token_id=None)
        self.vocab_size = VOCAB
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks
        self.max_model_len = min(config.max_model_len or max_model_len, self.num_kv_blocks * self.block_size)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.kv = np.full(self.num_kv_blocks * self.block_size, -1, dtype=np.int64)
        self.kinds: list[BatchKind] = []

    def launch(
        self, inputs: StepInputs, sampling, patch: InputPatch | None = None, bitmask=None
    ) -> StepHandle:
        if bitmask is not None:  # (the structured outputs' mask; the fake model ignores it)
            bitmask()
        a = inputs
        ids, pos, slots = a.input_ids.copy(), a.positions, a.slot_mapping
        if patch is not None:  # tokens sampled by the step still "in flight"
            assert (ids[patch.dst] == -1).all()
            ids[patch.dst] = patch.prev.tokens_dev.numpy()[patch.src]
        assert (ids >= 0).all(), "a placeholder token reached the model"
        cu, seq_lens, table = a.cu_seqlens_q, a.seq_lens, a.block_table
        bs = self.block_size
        q = np.diff(cu)
        # -- metadata invariants --
        assert cu[0] == 0 and (q >= 1).all() and len(ids) == len(pos) == len(slots) == cu[-1]
        assert a.max_seqlen_q == q.max() and a.max_seqlen_k == seq_lens.max()
        starts = seq_lens - q
        if not starts.any():
            assert a.kind is BatchKind.PREFILL
        elif (q == 1).all():
            assert a.kind is BatchKind.DECODE
        else:
            assert a.kind is BatchKind.MIXED
            leading = int(np.argmin(q == 1)) if not (q == 1).all() else len(q)
            assert a.num_decodes == leading, (a.num_decodes, q)
        if a.kind is not BatchKind.MIXED:
            assert a.num_decodes == 0
        self.kinds.append(a.kind)
        for i in range(len(q)):
            nb = -(-seq_lens[i] // bs)
            assert (table[i, :nb] >= 0).all() and (table[i, nb:] == -1).all()
            p = np.arange(starts[i], seq_lens[i])
            assert (pos[cu[i] : cu[i + 1]] == p).all()
            expect = table[i, p // bs].astype(np.int64) * bs + p % bs
            assert (slots[cu[i] : cu[i + 1]] == expect).all()
        assert (slots >= 0).all()
        # -- "forward": store K/V, then read every sampled request's context back --
        self.kv[slots] = ids
        tokens = []
        for row in a.logits_indices:
            i = int(np.searchsorted(cu, row, side="right") - 1)
            assert row == cu[i + 1] - 1
            p = np.arange(seq_lens[i])
            context = self.kv[table[i, p // bs].astype(np.int64) * bs + p % bs]
            assert (context >= 0).all(), "read a slot nobody wrote"
            tokens.append(next_token(context))
        arr = np.asarray(tokens, dtype=np.int64)
        return StepHandle(tokens_dev=torch.from_numpy(arr), out=None, host=StepResult(token_ids=arr))

    def wait(self, handle: StepHandle) -> StepResult:
        return handle.host

    def execute(self, inputs: StepInputs, sampling) -> StepResult:
        return self.wait(self.launch(inputs, sampling))


class FakeEngine(LLMEngine):
    """LLMEngine whose runner is a `FakeRunner` (token-id prompts only)."""

    def __init__(self, eos_token_id: int | None = None, async_scheduling: bool = False, **kwargs):
        kwargs.setdefault("skip_tokenizer_init", True)
        kwargs.setdefault("device", "cpu")
        self._eos = eos_token_id
        super().__init__("fake-model", **kwargs)
        self.async_scheduling = async_scheduling

    def _make_runner(self, config):
        runner = FakeRunner(config)
        runner.hf_config.eos_token_id = self._eos
        return runner
