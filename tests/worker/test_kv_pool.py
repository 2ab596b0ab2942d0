"""KV pool sizing: on CPU from the model and max_model_len (not a fixed size), and a pool that
cannot hold one request of an explicitly asked max_model_len is refused at start-up."""

from __future__ import annotations

import pytest
import torch

from tilellm import LLM
from tilellm.worker import kv_pool

KV_SPEC = kv_pool.KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)


def test_block_bytes_count_k_and_v_of_every_layer():
    assert KV_SPEC.block_bytes == 2 * 3 * 16 * 2 * 64 * 4
    assert KV_SPEC.bytes_per_token == KV_SPEC.block_bytes // 16


def test_cpu_pool_holds_max_num_seqs_requests_of_max_model_len():
    assert kv_pool.cpu_num_blocks(KV_SPEC, max_model_len=128, max_num_seqs=4) == 4 * 8
    assert kv_pool.cpu_num_blocks(KV_SPEC, max_model_len=130, max_num_seqs=1) == 9  # a partial block
    # capped by the byte budget, but never below one full-length request
    huge = kv_pool.KVSpec(64, 64, 256, 16, torch.float32)
    per_seq = -(-(1 << 20) // 16)
    assert kv_pool.cpu_num_blocks(huge, max_model_len=1 << 20, max_num_seqs=256) == per_seq


def test_a_pool_smaller_than_an_asked_max_model_len_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len \(512\) is larger than the KV pool \(320 tokens\)"):
        kv_pool.check_fits(320, 512, explicit=True)
    assert kv_pool.check_fits(320, 512, explicit=False) == 320  # the model's default: capped, logged
    assert kv_pool.check_fits(320, 300, explicit=True) == 300


def test_the_engine_sizes_its_cpu_pool_from_the_model(caplog):
    llm = LLM(device="cpu", max_num_seqs=4)  # the embedded model: max_model_len 128, block 16
    runner = llm.llm_engine.runner
    assert runner.num_kv_blocks == 4 * 8
    assert runner.num_kv_blocks * runner.block_bytes < 8 << 20  # megabytes, not 2 GiB
    with pytest.raises(ValueError, match="larger than the KV pool"):
        LLM(device="cpu", num_kv_blocks=4, max_model_len=128)
