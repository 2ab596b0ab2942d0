"""Invalid inputs raise ValueError naming the problem, in the Triton kernels and in their twins alike.

Each case starts from a small valid call, breaks one thing, and checks the message. Both
modules run every case: the Triton wrappers must reject the input before any launch.
"""

from __future__ import annotations

import re

import pytest
import torch

import tilellm.kernels as tk
from tests.conftest import DEVICE
from tests.kernels.helpers import cu_seqlens, make_paged_batch, randn
from tilellm.kernels import reference, validation
from tilellm.kernels.schedule import plan_split_kv

MODULES = [pytest.param(tk, id="triton"), pytest.param(reference, id="reference")]


@pytest.fixture(autouse=True)
def value_checks_everywhere(monkeypatch):
    """On the GPU the value checks run only with TILELLM_DEBUG=1: switch them on for these tests."""
    monkeypatch.setenv("TILELLM_DEBUG", "1")


F32, F16, I32, I64 = torch.float32, torch.float16, torch.int32, torch.int64


# ----------------------------------------------------------------------------------------------
# Valid starting points and callers
# ----------------------------------------------------------------------------------------------


def paged_args():
    b = make_paged_batch([(2, 5), (1, 20), (3, 3)], 4, 2, 16, 8, F32, DEVICE)
    return {
        "q": b.q,
        "k_cache": b.k_cache,
        "v_cache": b.v_cache,
        "block_table": b.block_table,
        "cu_seqlens_q": b.cu_seqlens_q,
        "seq_lens": b.seq_lens,
        "max_seqlen_q": b.max_seqlen_q,
        "kw": {},
    }


def call_paged(mod, a):
    keys = ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens", "max_seqlen_q")
    return mod.paged_attention(*(a[k] for k in keys), **a["kw"])


def decode_args():
    b = make_paged_batch([(1, 5), (1, 20), (1, 1)], 4, 2, 16, 8, F32, DEVICE)
    return {
        "q": b.q,
        "k_cache": b.k_cache,
        "v_cache": b.v_cache,
        "block_table": b.block_table,
        "seq_lens": b.seq_lens,
        "kw": {},
    }


def call_decode(mod, a):
    return mod.decode_attention(
        a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"], **a["kw"]
    )


def prefill_args():
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 9]
    T = sum(lengths)
    return {
        "q": randn((T, 4, 16), F32, DEVICE, gen),
        "k": randn((T, 2, 16), F32, DEVICE, gen),
        "v": randn((T, 2, 16), F32, DEVICE, gen),
        "cu_seqlens": cu_seqlens(lengths, DEVICE),
        "max_seqlen": 9,
        "kw": {},
    }


def call_prefill(mod, a):
    return mod.prefill_attention(a["q"], a["k"], a["v"], a["cu_seqlens"], a["max_seqlen"], **a["kw"])


def sparse_args():
    pairs = [(2, 5), (1, 20)]
    b = make_paged_batch(pairs, 4, 2, 16, 8, F32, DEVICE)
    topk = torch.tensor([[0, 3, -1], [4, 1, 2], [19, -1, 0]], dtype=I32, device=DEVICE)
    return {
        "q": b.q,
        "k_cache": b.k_cache,
        "v_cache": b.v_cache,
        "block_table": b.block_table,
        "cu_seqlens_q": b.cu_seqlens_q,
        "topk_indices": topk,
        "kw": {"seq_lens": b.seq_lens},
    }


def call_sparse(mod, a):
    keys = ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "topk_indices")
    return mod.sparse_attention(*(a[k] for k in keys), **a["kw"])


def store_args():
    gen = torch.Generator().manual_seed(0)
    return {
        "k": randn((4, 2, 16), F32, DEVICE, gen),
        "v": randn((4, 2, 16), F32, DEVICE, gen),
        "k_cache": randn((3, 8, 2, 16), F32, DEVICE, gen),
        "v_cache": randn((3, 8, 2, 16), F32, DEVICE, gen),
        "slot_mapping": torch.tensor([0, 9, -1, 23], dtype=I32, device=DEVICE),
    }


def call_store(mod, a):
    return mod.store_kvcache(a["k"], a["v"], a["k_cache"], a["v_cache"], a["slot_mapping"])


def merge_args():
    gen = torch.Generator().manual_seed(0)
    return {
        "o_parts": randn((3, 5, 2, 16), F32, DEVICE, gen),
        "lse_parts": randn((3, 5, 2), F32, DEVICE, gen),
    }


def call_merge(mod, a):
    return mod.merge_attention_states(a["o_parts"], a["lse_parts"])


KERNELS = {
    "paged": (paged_args, call_paged),
    "decode": (decode_args, call_decode),
    "prefill": (prefill_args, call_prefill),
    "sparse": (sparse_args, call_sparse),
    "store": (store_args, call_store),
    "merge": (merge_args, call_merge),
}


def strided_last_dim(t):
    """Same values, stride 2 in the last dim."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def set_item(key, value):
    def mutate(a):
        a[key] = value(a[key]) if callable(value) else value

    return mutate


def set_kw(key, value):
    def mutate(a):
        a["kw"][key] = value(a) if callable(value) else value

    return mutate


def both(keys, fn):
    def mutate(a):
        for key in keys:
            a[key] = fn(a[key])

    return mutate


def chain(*mutations):
    def mutate(a):
        for m in mutations:
            m(a)

    return mutate


def set_value(key, index, value):
    def mutate(a):
        t = a[key].clone()
        t[index] = value
        a[key] = t

    return mutate


# (kernel, case id, mutation, message regex)
CASES = [
    # -- paged: always-on checks --
    (
        "paged",
        "q_2d",
        set_item("q", lambda q: q[:, 0]),
        r"paged_attention: q must be 3-D \[T, Hq, D\], got shape \(6, 16\)",
    ),
    (
        "paged",
        "q_int",
        set_item("q", lambda q: q.to(I32)),
        r"q must be float16, bfloat16 or float32, got torch.int32",
    ),
    (
        "paged",
        "cache_dtype",
        both(("k_cache", "v_cache"), lambda c: c.to(F16)),
        r"k_cache must have q's dtype torch.float32 or float8_e4m3fn \(an FP8 cache\), got torch.float16",
    ),
    (
        "paged",
        "cache_3d",
        set_item("k_cache", lambda c: c[0]),
        r"k_cache must be 4-D \[num_blocks, block_size, Hkv, D\]",
    ),
    (
        "paged",
        "v_cache_shape",
        set_item("v_cache", lambda c: c[:-1]),
        r"v_cache shape .* must equal k_cache shape",
    ),
    (
        "paged",
        "gqa_ratio",
        set_item("q", lambda q: torch.cat([q, q[:, :1]], 1)),
        r"Hq % Hkv must be 0.*Hq = 5, Hkv = 2",
    ),
    (
        "paged",
        "head_dim_mismatch",
        set_item("q", lambda q: torch.cat([q, q], 2)),
        r"head dim of k_cache \(16\) differs from q's \(32\)",
    ),
    (
        "paged",
        "head_dim_not_pow2",
        both(("q", "k_cache", "v_cache"), lambda t: torch.cat([t, t[..., :8]], -1)),
        r"head dim D must be a power of two in 16..256, got D = 24",
    ),
    (
        "paged",
        "head_dim_too_small",
        both(("q", "k_cache", "v_cache"), lambda t: t[..., :8].contiguous()),
        r"power of two in 16..256, got D = 8",
    ),
    (
        "paged",
        "head_dim_too_big",
        both(
            ("q", "k_cache", "v_cache"),
            lambda t: t.repeat(1, 1, 32) if t.dim() == 3 else t.repeat(1, 1, 1, 32),
        ),
        r"power of two in 16..256, got D = 512",
    ),
    (
        "paged",
        "block_table_int64",
        set_item("block_table", lambda t: t.long()),
        r"block_table must be int32, got torch.int64",
    ),
    (
        "paged",
        "block_table_1d",
        set_item("block_table", lambda t: t[0]),
        r"block_table must be 2-D \[B, max_blocks_per_seq\]",
    ),
    (
        "paged",
        "cu_int64",
        set_item("cu_seqlens_q", lambda t: t.long()),
        r"cu_seqlens_q must be int32, got torch.int64",
    ),
    (
        "paged",
        "seq_lens_int64",
        set_item("seq_lens", lambda t: t.long()),
        r"seq_lens must be int32, got torch.int64",
    ),
    (
        "paged",
        "cu_len",
        set_item("cu_seqlens_q", lambda t: t[:-1]),
        r"cu_seqlens_q must have B\+1 = 4 entries \(block_table has B = 3 rows\), got 3",
    ),
    (
        "paged",
        "seq_lens_len",
        set_item("seq_lens", lambda t: t[:-1]),
        r"seq_lens must have B = 3 entries .* got 2",
    ),
    (
        "paged",
        "device",
        set_item("block_table", lambda t: t.to("meta")),
        r"block_table is on meta but q is on (cpu|cuda)",
    ),
    ("paged", "q_strided", set_item("q", strided_last_dim), r"q must have stride 1 in its last dim"),
    (
        "paged",
        "block_table_noncontig",
        set_item("block_table", lambda t: t.t().contiguous().t()),
        r"block_table must be contiguous",
    ),
    (
        "paged",
        "cache_noncontig",
        both(("k_cache", "v_cache"), lambda c: c.transpose(1, 2).contiguous().transpose(1, 2)),
        r"k_cache must be contiguous",
    ),
    (
        "paged",
        "max_seqlen_float",
        set_item("max_seqlen_q", 3.0),
        r"max_seqlen_q must be a Python int, got float",
    ),
    ("paged", "max_seqlen_negative", set_item("max_seqlen_q", -1), r"max_seqlen_q must be >= 0, got -1"),
    ("paged", "num_splits_zero", set_kw("num_splits", 0), r"num_splits must be >= 1, got 0"),
    ("paged", "scale_nan", set_kw("scale", float("nan")), r"scale must be finite"),
    (
        "paged",
        "out_shape",
        set_kw("out", lambda a: torch.empty(5, 4, 16)),
        r"paged_attention: out must have shape \(6, 4, 16\), got \(5, 4, 16\)",
    ),
    (
        "paged",
        "out_dtype",
        set_kw("out", lambda a: torch.empty(6, 4, 16, dtype=F16)),
        r"out must have dtype torch.float32, got torch.float16",
    ),
    # -- paged: value checks (CPU tensors) --
    ("paged", "cu_first", set_value("cu_seqlens_q", 0, 1), r"cu_seqlens_q\[0\] must be 0, got 1"),
    (
        "paged",
        "cu_decreasing",
        set_value("cu_seqlens_q", 1, 4),
        r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[2\] = 3 < cu_seqlens_q\[1\] = 4",
    ),
    (
        "paged",
        "cu_last",
        set_value("cu_seqlens_q", 3, 5),
        r"cu_seqlens_q\[-1\] = 5 must equal the number of query tokens T = 6",
    ),
    (
        "paged",
        "max_seqlen_small",
        set_item("max_seqlen_q", 2),
        r"max_seqlen_q = 2 is smaller than the longest request \(3 tokens, request 2\)",
    ),
    (
        "paged",
        "seq_len_lt_q_len",
        set_value("seq_lens", 2, 2),
        r"seq_lens\[2\] = 2 is smaller than request 2's 3 new tokens",
    ),
    (
        "paged",
        "table_short",
        set_value("seq_lens", 1, 41),
        r"block_table too short: request 1 needs 6 blocks for seq_len 41 with block_size 8, "
        r"table has 5 columns",
    ),
    (
        "paged",
        "table_entry_high",
        set_value("block_table", (1, 2), 1000),
        r"block_table\[1, 2\] = 1000 is out of range \[0, \d+\)",
    ),
    (
        "paged",
        "table_entry_negative",
        set_value("block_table", (0, 0), -1),
        r"block_table\[0, 0\] = -1 is out of range",
    ),
    (
        "paged",
        "max_seqlen_k_small",
        set_kw("max_seqlen_k", 7),
        r"max_seqlen_k = 7 is smaller than the longest seq_lens entry \(20\)",
    ),
    # -- decode --
    ("decode", "q_2d", set_item("q", lambda q: q[0]), r"decode_attention: q must be 3-D \[B, Hq, D\]"),
    (
        "decode",
        "table_rows",
        set_item("block_table", lambda t: t[:2]),
        r"block_table must have B = 3 rows .* got 2",
    ),
    (
        "decode",
        "seq_lens_len",
        set_item("seq_lens", lambda t: t[:2]),
        r"seq_lens must have B = 3 entries .* got 2",
    ),
    ("decode", "seq_lens_int64", set_item("seq_lens", lambda t: t.long()), r"seq_lens must be int32"),
    ("decode", "gqa_ratio", set_item("q", lambda q: q[:, :3]), r"Hq % Hkv must be 0"),
    (
        "decode",
        "empty_context",
        set_value("seq_lens", 2, 0),
        r"seq_lens\[2\] = 0 is smaller than request 2's 1 new tokens",
    ),
    (
        "decode",
        "table_short",
        set_value("seq_lens", 0, 41),
        r"block_table too short: request 0 needs 6 blocks",
    ),
    (
        "decode",
        "table_entry",
        set_value("block_table", (1, 1), -5),
        r"block_table\[1, 1\] = -5 is out of range",
    ),
    ("decode", "num_splits_zero", set_kw("num_splits", 0), r"num_splits must be >= 1"),
    (
        "decode",
        "out_shape",
        set_kw("out", lambda a: torch.empty(3, 4, 32)),
        r"decode_attention: out must have shape \(3, 4, 16\)",
    ),
    # -- prefill --
    (
        "prefill",
        "q_4d",
        set_item("q", lambda q: q[None]),
        r"prefill_attention: q must be 3-D \[T, Hq, D\], got shape \(1, 12, 4, 16\)",
    ),
    ("prefill", "k_2d", set_item("k", lambda k: k[:, 0]), r"k must be 3-D \[T, Hkv, D\]"),
    (
        "prefill",
        "v_shape",
        set_item("v", lambda v: v[:, :1]),
        r"v shape \(12, 1, 16\) must equal k shape \(12, 2, 16\)",
    ),
    (
        "prefill",
        "dtype_mix",
        set_item("k", lambda k: k.to(F16)),
        r"k dtype torch.float16 differs from q dtype torch.float32",
    ),
    ("prefill", "k_tokens", both(("k", "v"), lambda t: t[:-1]), r"k has 11 tokens but q has 12"),
    ("prefill", "gqa_ratio", set_item("q", lambda q: q[:, :3]), r"Hq % Hkv must be 0.*Hq = 3, Hkv = 2"),
    (
        "prefill",
        "head_dim",
        both(("q", "k", "v"), lambda t: torch.cat([t, t[..., :4]], -1)),
        r"head dim Dqk must be a multiple of 8 in 16..256, got Dqk = 20",
    ),
    (
        "prefill",
        "head_dim_v",
        set_item("v", lambda v: torch.cat([v, v[..., :4]], -1)),
        r"head dim Dv must be a multiple of 8 in 16..256, got Dv = 20",
    ),
    (
        "prefill",
        "head_dim_too_small",
        both(("q", "k"), lambda t: t[..., :8].contiguous()),
        r"head dim Dqk must be a multiple of 8 in 16..256, got Dqk = 8",
    ),
    (
        "prefill",
        "head_dim_v_too_big",
        set_item("v", lambda v: v.repeat(1, 1, 17)),
        r"head dim Dv must be a multiple of 8 in 16..256, got Dv = 272",
    ),
    (
        "prefill",
        "head_dim_k_vs_q",
        set_item("k", lambda k: torch.cat([k, k[..., :8]], -1)),
        r"head dim of k \(24\) differs from q's \(16\)",
    ),
    (
        "prefill",
        "out_shape_dv",
        set_kw("out", lambda a: torch.empty(12, 4, 24)),
        r"prefill_attention: out must have shape \(12, 4, 16\), got \(12, 4, 24\)",
    ),
    (
        "prefill",
        "out_shape_dqk",
        chain(
            set_item("v", lambda v: v[..., :8].repeat(1, 1, 3)),
            set_kw("out", lambda a: torch.empty(12, 4, 16)),
        ),
        r"out must have shape \(12, 4, 24\), got \(12, 4, 16\)",  # [T, Hq, Dv]
    ),
    ("prefill", "cu_int64", set_item("cu_seqlens", lambda t: t.long()), r"cu_seqlens must be int32"),
    ("prefill", "cu_2d", set_item("cu_seqlens", lambda t: t[None]), r"cu_seqlens must be 1-D \[B\+1\]"),
    (
        "prefill",
        "cu_empty",
        set_item("cu_seqlens", lambda t: t[:0]),
        r"cu_seqlens must have B\+1 >= 1 entries",
    ),
    ("prefill", "cu_first", set_value("cu_seqlens", 0, 2), r"cu_seqlens\[0\] must be 0, got 2"),
    (
        "prefill",
        "cu_decreasing",
        set_value("cu_seqlens", 2, 1),
        r"cu_seqlens must be non-decreasing, but cu_seqlens\[2\] = 1 < cu_seqlens\[1\] = 3",
    ),
    (
        "prefill",
        "cu_last",
        set_value("cu_seqlens", 3, 11),
        r"cu_seqlens\[-1\] = 11 must equal the number of query tokens T = 12",
    ),
    (
        "prefill",
        "max_seqlen_small",
        set_item("max_seqlen", 8),
        r"max_seqlen = 8 is smaller than the longest request \(9 tokens, request 2\)",
    ),
    (
        "prefill",
        "max_seqlen_tensor",
        set_item("max_seqlen", torch.tensor(9)),
        r"max_seqlen must be a Python int, got Tensor",
    ),
    ("prefill", "k_strided", both(("k", "v"), strided_last_dim), r"k must have stride 1 in its last dim"),
    (
        "prefill",
        "out_device",
        set_kw("out", lambda a: torch.empty(12, 4, 16, device="meta")),
        r"out must be on (cpu|cuda\S*), got meta",
    ),
    # -- sparse --
    (
        "sparse",
        "topk_1d",
        set_item("topk_indices", lambda t: t[0]),
        r"sparse_attention: topk_indices must be 2-D \[T, K\]",
    ),
    (
        "sparse",
        "topk_int64",
        set_item("topk_indices", lambda t: t.long()),
        r"topk_indices must be int32, got torch.int64",
    ),
    (
        "sparse",
        "topk_rows",
        set_item("topk_indices", lambda t: t[:2]),
        r"topk_indices \[T, K\] must have one row per query token \(T = 3\), got 2 rows",
    ),
    (
        "sparse",
        "topk_noncontig",
        set_item("topk_indices", lambda t: t.t().contiguous().t()),
        r"topk_indices must be contiguous",
    ),
    (
        "sparse",
        "topk_below_minus_one",
        set_value("topk_indices", (1, 2), -2),
        r"topk_indices\[1, 2\] = -2 is negative \(only -1 marks an empty entry\)",
    ),
    (
        "sparse",
        "topk_future",
        set_value("topk_indices", (0, 1), 4),
        r"topk_indices\[0, 1\] = 4 is a future position: token 0 \(request 0\) sits at position 3",
    ),
    (
        "sparse",
        "seq_lens_len",
        set_kw("seq_lens", lambda a: a["kw"]["seq_lens"][:1]),
        r"seq_lens must have B = 2 entries .* got 1",
    ),
    (
        "sparse",
        "seq_lens_int64",
        set_kw("seq_lens", lambda a: a["kw"]["seq_lens"].long()),
        r"seq_lens must be int32",
    ),
    (
        "sparse",
        "seq_len_lt_q_len",
        set_kw("seq_lens", lambda a: torch.tensor([1, 20], dtype=I32, device=DEVICE)),
        r"seq_lens\[0\] = 1 is smaller than request 0's 2 new tokens",
    ),
    (
        "sparse",
        "cu_len",
        set_item("cu_seqlens_q", lambda t: t[:-1]),
        r"cu_seqlens_q must have B\+1 = 3 entries",
    ),
    ("sparse", "cu_decreasing", set_value("cu_seqlens_q", 1, 4), r"cu_seqlens_q must be non-decreasing"),
    (
        "sparse",
        "cache_dtype",
        both(("k_cache", "v_cache"), lambda c: c.to(F16)),
        r"k_cache must have q's dtype torch.float32 or float8_e4m3fn \(an FP8 cache\), got torch.float16",
    ),
    (
        "sparse",
        "out_shape",
        set_kw("out", lambda a: torch.empty(3, 4, 8)),
        r"sparse_attention: out must have shape \(3, 4, 16\)",
    ),
    # -- store --
    (
        "store",
        "k_2d",
        set_item("k", lambda k: k[:, 0]),
        r"store_kvcache: k must be 3-D \[T, Hkv, D\], got shape \(4, 16\)",
    ),
    (
        "store",
        "v_shape",
        set_item("v", lambda v: v[:3]),
        r"v shape \(3, 2, 16\) must equal k shape \(4, 2, 16\)",
    ),
    (
        "store",
        "cache_heads",
        both(("k_cache", "v_cache"), lambda c: c[:, :, :1].contiguous()),
        r"k_cache .* has \(Hkv, D\) = \(1, 16\), but k has \(Hkv, D\) = \(2, 16\)",
    ),
    (
        "store",
        "cache_dtype",
        both(("k_cache", "v_cache"), lambda c: c.to(F16)),
        r"k_cache must have k's dtype torch.float32 or float8_e4m3fn \(an FP8 cache\), got torch.float16",
    ),
    (
        "store",
        "cache_noncontig",
        both(("k_cache", "v_cache"), lambda c: c.transpose(0, 1).contiguous().transpose(0, 1)),
        r"k_cache must be contiguous",
    ),
    (
        "store",
        "slot_float",
        set_item("slot_mapping", lambda s: s.float()),
        r"slot_mapping must be int32 or int64, got torch.float32",
    ),
    (
        "store",
        "slot_len",
        set_item("slot_mapping", lambda s: s[:3]),
        r"slot_mapping has 3 entries, but k has 4 tokens",
    ),
    (
        "store",
        "slot_high",
        set_value("slot_mapping", 1, 24),
        r"slot_mapping\[1\] = 24 is out of range \[-1, 24\)",
    ),
    (
        "store",
        "slot_below_minus_one",
        set_value("slot_mapping", 2, -2),
        r"slot_mapping\[2\] = -2 is out of range",
    ),
    ("store", "k_strided", both(("k", "v"), strided_last_dim), r"k must have stride 1 in its last dim"),
    (
        "store",
        "head_dim",
        both(("k", "v", "k_cache", "v_cache"), lambda t: t[..., :12].contiguous()),
        r"power of two in 16..256, got D = 12",
    ),
    (
        "store",
        "device",
        set_item("slot_mapping", lambda s: s.to("meta")),
        r"slot_mapping is on meta but k is on (cpu|cuda)",
    ),
    # -- merge --
    (
        "merge",
        "o_3d",
        set_item("o_parts", lambda o: o[0]),
        r"merge_attention_states: o_parts must be 4-D \[S, T, H, D\]",
    ),
    ("merge", "lse_2d", set_item("lse_parts", lambda x: x[0]), r"lse_parts must be 3-D \[S, T, H\]"),
    (
        "merge",
        "lse_dtype",
        set_item("lse_parts", lambda x: x.half()),
        r"lse_parts must be float32, got torch.float16",
    ),
    (
        "merge",
        "o_dtype",
        set_item("o_parts", lambda o: o.to(I64)),
        r"o_parts must be float16, bfloat16 or float32",
    ),
    (
        "merge",
        "shape_mismatch",
        set_item("lse_parts", lambda x: x[:, :4]),
        r"lse_parts shape \(3, 4, 2\) must equal o_parts' \[S, T, H\] = \(3, 5, 2\)",
    ),
    (
        "merge",
        "no_parts",
        both(("o_parts", "lse_parts"), lambda t: t[:0]),
        r"o_parts needs at least one part",
    ),
    (
        "merge",
        "device",
        set_item("lse_parts", lambda x: x.to("meta")),
        r"lse_parts is on meta but o_parts is on (cpu|cuda)",
    ),
]


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize(
    ("kernel", "mutate", "message"), [pytest.param(k, m, msg, id=f"{k}-{i}") for k, i, m, msg in CASES]
)
def test_invalid_input_raises(mod, kernel, mutate, message):
    make, call = KERNELS[kernel]
    args = make()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        call(mod, args)


@pytest.mark.parametrize(
    ("kernel", "mutate", "message"), [pytest.param(k, m, msg, id=f"{k}-{i}") for k, i, m, msg in CASES]
)
def test_invalid_input_raises_after_its_valid_call(kernel, mutate, message):
    """The checks remember the layouts that passed (`validation.layout_key`): a broken input
    must still be rejected right after its valid starting point passed."""
    make, call = KERNELS[kernel]
    call(tk, make())
    args = make()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        call(tk, args)


class _TensorLike:
    """Everything the remembered layouts read of a tensor, but no tensor."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype, self.device, self._strides = t.shape, t.dtype, t.device, t.stride()

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]


@pytest.mark.parametrize("kernel", ["paged", "decode"])
def test_a_tensor_like_argument_is_rejected_after_a_tensor_passed(kernel):
    make, call = KERNELS[kernel]
    call(tk, make())
    args = make()
    args["block_table"] = _TensorLike(args["block_table"])
    with pytest.raises(ValueError, match=r"block_table must be a torch.Tensor"):
        call(tk, args)


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_starting_points_are_valid(mod, kernel):
    """Each case above breaks exactly one thing of these valid calls."""
    make, call = KERNELS[kernel]
    call(mod, make())


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_inputs_are_not_modified_on_error(mod, kernel):
    """A rejected call leaves every input (caches included) as it was."""
    make, call = KERNELS[kernel]
    args = make()
    first = next(k for k, v in args.items() if isinstance(v, torch.Tensor) and v.dim() >= 3)
    args[first] = args[first][..., :12]  # breaks the head dim of one tensor
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError):
        call(mod, args)
    for k, v in before.items():
        assert torch.equal(args[k], v), f"{k} changed"


@pytest.mark.parametrize("mod", MODULES)
def test_sparse_without_seq_lens_checks_addressability(mod):
    a = sparse_args()
    del a["kw"]["seq_lens"]
    call_sparse(mod, a)  # future positions are not checked without seq_lens
    capacity = a["block_table"].shape[1] * 8
    a["topk_indices"] = a["topk_indices"].clone()
    a["topk_indices"][2, 1] = capacity
    with pytest.raises(ValueError, match=rf"topk_indices\[2, 1\] = {capacity} lies past the block table"):
        call_sparse(mod, a)
    a = sparse_args()
    del a["kw"]["seq_lens"]
    a["block_table"] = a["block_table"].clone()
    a["block_table"][0, 0] = 10_000
    with pytest.raises(
        ValueError, match=r"topk_indices\[0, 0\] = 0 maps to block_table\[0, 0\] = 10000, outside \[0, \d+\)"
    ):
        call_sparse(mod, a)


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize("kernel", ["paged", "decode"])
def test_host_split_plan_is_accepted(mod, kernel):
    """The engine plans the split on the host and passes the SplitPlan as num_splits."""
    make, call = KERNELS[kernel]
    a = make()
    a["kw"]["num_splits"] = plan_split_kv(list(range(4)), [5, 20, 1], 4, 2, head_dim=16, num_splits=2)
    call(mod, a)


@pytest.mark.parametrize("mod", MODULES)
def test_unused_block_table_entries_are_not_checked(mod):
    """Columns past a request's last block may hold anything (e.g. -1 padding)."""
    a = paged_args()
    a["block_table"] = a["block_table"].clone()
    a["block_table"][2, 1:] = -1  # request 2 (seq_len 3) uses one block
    call_paged(mod, a)


@pytest.mark.parametrize("mod", MODULES)
def test_empty_requests_are_valid(mod):
    a = prefill_args()
    a["cu_seqlens"] = torch.tensor([0, 0, 3, 3, 12, 12], dtype=I32, device=DEVICE)
    call_prefill(mod, a)


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize("dims", [(24, 16), (16, 24), (192, 128), (40, 40)], ids=lambda d: f"qk{d[0]}v{d[1]}")
def test_prefill_takes_its_own_v_head_dim(mod, dims):
    """v's head dim may differ from q's and k's, and prefill head dims need only be multiples of 8:
    the output is [T, Hq, Dv], into a fresh tensor or a checked `out`."""
    dqk, dv = dims
    gen = torch.Generator().manual_seed(1)
    a = prefill_args()
    a["q"], a["k"] = randn((12, 4, dqk), F32, DEVICE, gen), randn((12, 2, dqk), F32, DEVICE, gen)
    a["v"] = randn((12, 2, dv), F32, DEVICE, gen)
    assert call_prefill(mod, a).shape == (12, 4, dv)
    a["kw"]["out"] = torch.empty(12, 4, dv, device=DEVICE)
    assert call_prefill(mod, a) is a["kw"]["out"]


def test_resolve_scale():
    assert validation.resolve_scale(None, 64) == 0.125
    assert validation.resolve_scale(0.5, 64) == 0.5
    assert validation.resolve_scale(2, 64) == 2.0
    for bad, msg in [(float("inf"), "finite"), ("0.1", "real number"), (True, "real number")]:
        with pytest.raises(ValueError, match=msg):
            validation.resolve_scale(bad, 64)


def test_deep_checks_enabled(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    assert validation.deep_checks_enabled(t)
    assert not validation.deep_checks_enabled(torch.zeros(1, device="meta"))
    monkeypatch.setenv("TILELLM_DEBUG", "1")
    assert validation.deep_checks_enabled(torch.zeros(1, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("debug", [False, True])
def test_value_checks_on_gpu_follow_tilellm_debug(monkeypatch, debug):
    """On CUDA tensors the value checks (host syncs) run only with TILELLM_DEBUG=1; shape checks always."""
    monkeypatch.setenv("TILELLM_DEBUG", "1" if debug else "0")
    a = paged_args()
    a = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    bad_table = dict(a, seq_lens=a["seq_lens"].clone())
    # one key more than the table's columns x block_size can hold: block table too short
    bad_table["seq_lens"][1] = a["block_table"].shape[1] * a["k_cache"].shape[1] + 1
    if debug:
        with pytest.raises(ValueError, match="block_table too short"):
            validation.check_paged(
                "paged_attention",
                *(
                    bad_table[k]
                    for k in (
                        "q",
                        "k_cache",
                        "v_cache",
                        "block_table",
                        "cu_seqlens_q",
                        "seq_lens",
                        "max_seqlen_q",
                    )
                ),
            )
    else:
        validation.check_paged(
            "paged_attention",
            *(
                bad_table[k]
                for k in (
                    "q",
                    "k_cache",
                    "v_cache",
                    "block_table",
                    "cu_seqlens_q",
                    "seq_lens",
                    "max_seqlen_q",
                )
            ),
        )
    with pytest.raises(ValueError, match=re.escape("q must be 3-D")):
        validation.check_paged(
            "paged_attention",
            a["q"][0],
            *(
                a[k]
                for k in ("k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens", "max_seqlen_q")
            ),
        )
