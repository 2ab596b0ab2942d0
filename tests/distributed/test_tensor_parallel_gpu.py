"""Tensor parallelism on 2 GPUs (NCCL): the same checks as the CPU tests, with CUDA graphs,
asynchronous scheduling and Triton kernels. Skipped without two CUDA devices."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.distributed.test_tensor_parallel_engine import ENGINE, GREEDY, _batches, _generate
from tilellm import LLM
from tilellm.distributed import WorkerError
from tilellm.worker.tp_worker import FAIL_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

CUDA = {**ENGINE, "device": "cuda", "dtype": "float32"}


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("model", ["tiny_qwen3_kv2", "tiny_llama_kv1"])
def test_nccl_two_ranks_give_the_single_rank_tokens(model, enforce_eager, request):
    model_dir = request.getfixturevalue(model)
    batches = _batches()
    single = LLM(model_dir, tensor_parallel_size=1, enforce_eager=enforce_eager, **CUDA)
    want = [_generate(single, b) for b in batches]
    del single

    llm = LLM(model_dir, tensor_parallel_size=2, enforce_eager=enforce_eager, **CUDA)
    runner = llm.llm_engine.runner
    try:
        assert llm.llm_engine.async_scheduling
        assert bool(runner.graphs) == (not enforce_eager), "CUDA graph capture failed (see the log)"
        got = [_generate(llm, b) for b in batches]
        for g_batch, w_batch in zip(got, want):
            assert [ids for ids, _ in g_batch] == [ids for ids, _ in w_batch]
        if not enforce_eager:
            assert runner.host_times.get("graph.steps", 0) > 0
    finally:
        llm.shutdown()
    assert multiprocessing.active_children() == []


def test_nccl_worker_failure_is_raised(tiny_qwen3_kv2, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "1:step:3")  # rank 0 is then waiting on NCCL for a dead peer
    llm = LLM(tiny_qwen3_kv2, tensor_parallel_size=2, **CUDA)
    with pytest.raises(WorkerError, match="injected failure on rank 1 at step:3"):
        llm.generate(_batches()[0], GREEDY, use_tqdm=False)
    assert multiprocessing.active_children() == []
    llm.shutdown()
