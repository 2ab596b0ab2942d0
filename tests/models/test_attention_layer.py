"""The attention layer's dispatch: a mixed step's leading one-token requests go through the decode
kernel and the rest through the paged kernel; the result equals one paged call over the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tilellm.kernels.reference as reference
from tests.conftest import DEVICE
from tilellm.attention import AttentionMetadata, AttentionSpec, BatchKind, get_attention_backend
from tilellm.kernels import schedule
from tilellm.models.layers.attention import Attention
from tilellm.worker.step_inputs import build_step_inputs


def _mixed_step(q_lens, seq_lens, hq, hkv, d, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(q_lens)
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = num_reqs * max_blocks + 5
    perm = torch.randperm(num_blocks, generator=gen)[: num_reqs * max_blocks]
    block_table = perm.view(num_reqs, max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    t = sum(q_lens)
    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for p in range(sl - ql, sl):
            slots.append(int(block_table[i, p // block_size]) * block_size + p % block_size)
    cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    meta = AttentionMetadata(
        kind=BatchKind.MIXED,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return q, k, v, k_cache, v_cache, meta


STEPS = [
    ([1, 1, 1, 7, 16], [5, 17, 33, 7, 40]),  # decodes, then a first chunk and a later chunk
    ([1, 1], [9, 30]),  # decodes only, in a MIXED step (they have cached prefixes)
    ([1, 5], [1, 12]),  # a one-token prompt at position 0 counts as a decode
]
# Contexts long enough for split-KV in both launches (max_seqlen_k >= 2 x MIN_KEYS_PER_SPLIT):
# one head layout only (3 query heads on 1 KV head, the padded group). The layer's split and
# plan logic does not depend on the heads, which the short steps cover in both layouts, and the
# kernels' split-KV over several KV heads is test_paged's and test_decode's; under the
# interpreter the 2-KV-head layout doubled the cost of the suite's longest layer case.
LONG_STEP = ([1, 1, 4], [2100, 700, 2110])
CASES = [(*step, *heads) for step in STEPS for heads in [(4, 2), (3, 1)]] + [(*LONG_STEP, 3, 1)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "q_lens, seq_lens, hq, hkv", CASES, ids=[f"{c[2]}-{c[3]}-q_lens{i // 2}" for i, c in enumerate(CASES)]
)
def test_mixed_step_split_equals_one_paged_call(backend, q_lens, seq_lens, hq, hkv):
    from tilellm.attention import attention_context

    d, block_size = 16, 4
    q, k, v, k_cache, v_cache, meta = _mixed_step(q_lens, seq_lens, hq, hkv, d, block_size, torch.float32, 0)
    device = DEVICE if backend == "triton" else "cpu"  # real Triton on a GPU, the interpreter on CPU
    q, k, v, k_cache, v_cache = (x.to(device) for x in (q, k, v, k_cache, v_cache))
    meta = AttentionMetadata(
        **{n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in meta.__dict__.items()}
    )
    num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    layer = Attention(hq, hkv, d, d**-0.5, get_attention_backend(backend, device))
    layer.bind_kv_cache(k_cache, v_cache)
    with attention_context(meta):
        whole = layer(q, k, v)
    split_meta = AttentionMetadata(**{**meta.__dict__, "num_decodes": num_decodes})
    with attention_context(split_meta):
        split = layer(q, k, v)
    if max(seq_lens) >= 2 * schedule.MIN_KEYS_PER_SPLIT:  # the case meant to exercise split-KV
        plan = schedule.choose_num_splits(num_decodes, hkv, 1, None, max_seqlen_k=max(seq_lens))
        assert plan.num_splits > 1, plan.reason
    # Planned once by the backend (as the runner does) or by the layer itself: the same result.
    planned = layer.backend.plan(split_meta, layer.spec(q.dtype))
    assert planned.plan.mode == ("mixed" if num_decodes else "paged")
    assert planned.plan.num_decodes == num_decodes
    with attention_context(planned):
        torch.testing.assert_close(layer(q, k, v), split, rtol=0, atol=0)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    q, k_cache, v_cache, meta = q.cpu(), k_cache.cpu(), v_cache.cpu(), _to_cpu(meta)
    ref = reference.paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_table,
        meta.cu_seqlens_q,
        meta.seq_lens,
        meta.max_seqlen_q,
        scale=d**-0.5,
    )
    torch.testing.assert_close(split.cpu(), ref, rtol=1e-5, atol=1e-5)


def _to_cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        **{n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in meta.__dict__.items()}
    )


def test_build_step_inputs_counts_leading_decodes():
    block_size = 4
    tables = np.arange(40, dtype=np.int64).reshape(4, 10)
    tokens = [list(range(20))] * 4
    # rows 0 and 1 decode, row 2 a chunk, row 3 a decode listed after it (not counted)
    starts, q_lens = [9, 12, 0, 5], [1, 1, 8, 1]
    x = build_step_inputs(tokens, starts, q_lens, [0, 1, 2, 3], [True] * 4, tables, block_size)
    assert x.kind is BatchKind.MIXED and x.num_decodes == 2
    spec = AttentionSpec(4, 2, 16, torch.float32, block_size)
    meta = get_attention_backend("reference", "cpu").plan(x.attention_metadata(), spec)
    plan = meta.plan
    assert plan.mode == "mixed" and plan.num_decodes == 2
    assert plan.rest_cu_seqlens_q.tolist() == [0, 8, 9]
    decode = build_step_inputs(tokens, [9, 12], [1, 1], [0, 1], [True, True], tables, block_size)
    assert decode.kind is BatchKind.DECODE and decode.num_decodes == 0
