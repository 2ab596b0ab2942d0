"""Our models against `transformers` on the same tiny checkpoints, fp32 on CPU.

One scenario per checkpoint walks the paged cache the way the engine does: a packed PREFILL of
three prompts (one only partly: chunked prefill), DECODE steps, a MIXED step (the rest of the
chunked prompt over its cached prefix + a decode + a 3-token verify), and a last DECODE. Every
row's logits must match transformers' logits at the same position of the full sequence.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.paged import PagedKV
from tilellm.attention import AttentionMetadata, BatchKind, attention_context
from tilellm.models import load_model
from tilellm.testing import make_tiny_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # shorter than the test's sequences: scaling matters
}

CHECKPOINTS = {
    "qwen3-tied": dict(arch="Qwen3ForCausalLM"),
    "qwen3-untied-linear-rope": dict(
        arch="Qwen3ForCausalLM",
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "llama3-untied-mqa": dict(
        arch="LlamaForCausalLM", tie_word_embeddings=False, num_kv_heads=1, rope_scaling=LLAMA3_SCALING
    ),
    "llama-tied-mha-sharded": dict(arch="LlamaForCausalLM", num_kv_heads=4, num_shards=2, head_dim=32),
    "qwen2-sharded": dict(arch="Qwen2ForCausalLM", num_shards=3, seed=3),
}


def _hf_logits(model_dir, sequences: list[list[int]]) -> list[torch.Tensor]:
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([seq])).logits[0] for seq in sequences]


def _run_step(model, kv: PagedKV, kind: BatchKind, chunks, rows: list):
    ids, positions, meta = kv.step(kind, chunks)
    with torch.no_grad(), attention_context(meta):
        logits = model.compute_logits(model(ids, positions))
    assert logits.dtype == next(model.parameters()).dtype
    assert logits.shape == (ids.numel(), model.config.vocab_size)
    row_requests = [req for req, toks in chunks for _ in toks]
    rows += [(req, pos, logits[row]) for row, (req, pos) in enumerate(zip(row_requests, positions.tolist()))]


def run_scenario(model, seed: int = 0, prompt_lens=(11, 6, 45), chunk=20, vocab: int = 384):
    """Returns (full token sequences, [(request, position, our logits row)])."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    a, b, c = (tokens(n) for n in prompt_lens)
    seqs = [list(a), list(b), list(c[:chunk])]
    kv = PagedKV(model, num_requests=3, max_len=max(prompt_lens) + 16, seed=seed)
    rows: list = []
    _run_step(model, kv, BatchKind.PREFILL, [(0, a), (1, b), (2, c[:chunk])], rows)
    for _ in range(3):
        new = [(0, tokens(1)), (1, tokens(1))]
        _run_step(model, kv, BatchKind.DECODE, new, rows)
        seqs[0] += new[0][1]
        seqs[1] += new[1][1]
    mixed = [(2, c[chunk:]), (0, tokens(1)), (1, tokens(3))]
    _run_step(model, kv, BatchKind.MIXED, mixed, rows)
    for req, toks in mixed:
        seqs[req] += toks
    last = [(0, tokens(1)), (1, tokens(1)), (2, tokens(1))]
    _run_step(model, kv, BatchKind.DECODE, last, rows)
    for req, toks in last:
        seqs[req] += toks
    return seqs, rows


def _assert_rows_match(rows, ref: list[torch.Tensor]) -> None:
    worst = max((ours - ref[req][pos]).abs().max().item() for req, pos, ours in rows)
    scale = max(r.abs().max().item() for r in ref)
    assert worst < ATOL, f"max abs logit error {worst:.3g} (logit scale {scale:.3g})"


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    kwargs = dict(CHECKPOINTS[request.param])
    return make_tiny_model(tmp_path_factory.mktemp(request.param), kwargs.pop("arch"), **kwargs)


def test_prefill_decode_mixed_match_transformers(checkpoint):
    model, _ = load_model(checkpoint, device="cpu", attention_backend="reference")
    seqs, rows = run_scenario(model)
    assert len(rows) == sum(len(s) for s in seqs)
    _assert_rows_match(rows, _hf_logits(checkpoint, seqs))


@pytest.mark.interpreter  # a CPU model: on a GPU, the engine's tests run these kernels
def test_triton_backend_matches_transformers(tmp_path):
    """Triton attention kernels and fused ops (the interpreter on CPU) through the whole model."""
    ckpt = make_tiny_model(tmp_path, "Qwen3ForCausalLM", seed=5)
    model, _ = load_model(ckpt, device="cpu", attention_backend="triton")
    seqs, rows = run_scenario(model, seed=1, prompt_lens=(6, 3, 11), chunk=5)
    _assert_rows_match(rows, _hf_logits(ckpt, seqs))


def test_prefill_without_bound_cache(tmp_path):
    """The runner's profiling pass: PREFILL before the KV pool exists gives the same logits."""
    ckpt = make_tiny_model(tmp_path, "LlamaForCausalLM", seed=2)
    model, _ = load_model(ckpt, device="cpu", attention_backend="reference")
    lens = [7, 2]
    ids = torch.randint(0, 384, (sum(lens),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = AttentionMetadata(
        kind=BatchKind.PREFILL,
        cu_seqlens_q=torch.tensor([0, 7, 9], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_seqlen_q=7,
        max_seqlen_k=7,
        block_table=torch.zeros((2, 1), dtype=torch.int32),
        slot_mapping=torch.full((9,), -1, dtype=torch.int64),
    )
    with torch.no_grad(), attention_context(meta):
        logits = model.compute_logits(model(ids, positions))
    ref = _hf_logits(ckpt, [ids[:7].tolist(), ids[7:].tolist()])
    assert (logits - torch.cat(ref)).abs().max().item() < ATOL

    decode_meta = AttentionMetadata(
        kind=BatchKind.DECODE,
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([8], dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=8,
        block_table=torch.zeros((1, 1), dtype=torch.int32),
        slot_mapping=torch.tensor([0]),
    )
    with (
        torch.no_grad(),
        attention_context(decode_meta),
        pytest.raises(RuntimeError, match="KV cache not bound"),
    ):
        model(ids[:1], torch.tensor([7]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_close_to_fp32(tmp_path, dtype):
    ckpt = make_tiny_model(tmp_path, "Qwen3ForCausalLM", dtype=dtype)
    half, _ = load_model(ckpt, device="cpu", attention_backend="reference")  # "auto" = checkpoint dtype
    full, _ = load_model(ckpt, device="cpu", dtype="float32", attention_backend="reference")
    assert next(half.parameters()).dtype == getattr(torch, dtype)
    assert next(full.parameters()).dtype == torch.float32
    _, rows_half = run_scenario(half, prompt_lens=(6, 4, 10), chunk=5)
    _, rows_full = run_scenario(full, prompt_lens=(6, 4, 10), chunk=5)
    err = max((h - f).abs().max().item() for (_, _, h), (_, _, f) in zip(rows_half, rows_full))
    scale = max(f.abs().max().item() for _, _, f in rows_full)
    assert err < 0.05 * scale, f"{dtype} logits differ from fp32 by {err:.3g} (scale {scale:.3g})"
