"""Tensor parallelism on CPU: two gloo processes, each holding half of every layer, must produce
the single-process logits (all-reduce after row-parallel layers, masked vocab-parallel embedding,
all-gathered LM head, KV heads split or replicated)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.models.paged import PagedKV
from tilellm.attention import BatchKind, attention_context
from tilellm.models import load_model
from tilellm.testing import make_tiny_model, make_tiny_moe_model

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def _logits_of_steps(model_dir, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """A prefill of two prompts, then two decode steps; all rows' logits, concatenated."""
    model, _ = load_model(
        model_dir, device="cpu", attention_backend="reference", tp_rank=tp_rank, tp_size=tp_size
    )
    kv = PagedKV(model, num_requests=2, max_len=16)
    steps = [
        (BatchKind.PREFILL, [(0, [5, 17, 300, 2, 9]), (1, [44, 45, 46])]),
        (BatchKind.DECODE, [(0, [7]), (1, [382])]),
        (BatchKind.MIXED, [(0, [1, 2]), (1, [3])]),
    ]
    out = []
    for kind, chunks in steps:
        ids, positions, meta = kv.step(kind, chunks)
        with torch.no_grad(), attention_context(meta):
            out.append(model.compute_logits(model(ids, positions)))
    return torch.cat(out)


def _worker(rank: int, world_size: int, model_dirs: list[str], store_path: str, out_path: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
    )
    try:
        logits = [_logits_of_steps(d, rank, world_size) for d in model_dirs]
        torch.save(logits, f"{out_path}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_two_rank_logits_match_single_rank(tmp_path):
    # one process pair for both checkpoints: KV heads split (2 over 2 ranks) and replicated (1 over 2)
    # and MoE experts split along their intermediate dim, MLA heads split over one shared latent
    model_dirs = [
        make_tiny_model(tmp_path / "qwen3", "Qwen3ForCausalLM", num_kv_heads=2, vocab_size=383),
        make_tiny_model(
            tmp_path / "qwen2", "Qwen2ForCausalLM", num_kv_heads=1, tie_word_embeddings=False, vocab_size=383
        ),
        make_tiny_moe_model(
            tmp_path / "deepseek_v3", "DeepseekV3ForCausalLM", vocab_size=383, q_lora_rank=48
        ),
        make_tiny_moe_model(tmp_path / "qwen3_moe", "Qwen3MoeForCausalLM", vocab_size=383),
        # the indexer replicated: every rank selects the same keys
        make_tiny_moe_model(
            tmp_path / "deepseek_v32", "DeepseekV32ForCausalLM", vocab_size=383, q_lora_rank=48
        ),
    ]
    expected = [_logits_of_steps(d) for d in model_dirs]
    out = tmp_path / "logits"
    args = (2, [str(d) for d in model_dirs], str(tmp_path / "store"), str(out))
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    for rank in range(2):
        for d, got, want in zip(model_dirs, torch.load(f"{out}.{rank}"), expected):
            assert got.shape == want.shape
            err = (got - want).abs().max().item()
            assert err < 1e-4, f"{d.name}, rank {rank}: max abs logit error {err:.3g}"
