"""`LLM(tensor_parallel_size=2)` on CPU: a gloo worker process holds half of every layer and of the
KV pool; the engine must give the single-process tokens, validate sizes, turn a failure on any
rank into an error on the driver, and never leave a process behind."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tilellm import LLM, SamplingParams
from tilellm.distributed import WorkerError
from tilellm.testing import make_tiny_model
from tilellm.worker.tp_worker import FAIL_ENV

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

REPO = Path(__file__).resolve().parents[2]

# A 32-token budget and 8-token blocks: the 70-token prompt is prefilled in chunks (MIXED steps
# next to other requests' decodes); prompts sharing 24 tokens share 3 cached blocks.
ENGINE = dict(
    device="cpu",
    num_kv_blocks=40,
    block_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=256,
    enable_prefix_caching=True,
)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=7, logprobs=0)


def _batches() -> list[list[list[int]]]:
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(384) for _ in range(n)]

    prefix, long = tokens(24), tokens(70)
    first = [long, prefix + tokens(10), prefix + [1, 2, 3, 4, 5], tokens(9)]
    second = [long[:64] + tokens(6), prefix + tokens(3), tokens(40)]  # cached prefixes of the first
    return [first, second]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], float]]:
    params = [SAMPLED if i == 1 else GREEDY for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie may wait for a busy init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _assert_no_workers() -> None:
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("model", ["tiny_qwen3_kv2", "tiny_llama_kv1"])
def test_two_ranks_give_the_single_rank_tokens(model, request):
    # Qwen3: 2 KV heads split over 2 ranks; Llama: 1 KV head replicated on both.
    model_dir = request.getfixturevalue(model)
    batches = _batches()
    single = LLM(model_dir, tensor_parallel_size=1, **ENGINE)
    want = [_generate(single, b) for b in batches]

    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE)
    driver = llm.llm_engine.runner.driver
    procs = list(driver.procs)
    try:
        assert llm.llm_engine.runner.num_kv_blocks == single.llm_engine.runner.num_kv_blocks
        got = [_generate(llm, batches[0])]
        # Asynchronous scheduling: rank 0 patches the previous step's tokens into the payload.
        llm.llm_engine.async_scheduling = True
        got.append(_generate(llm, batches[1]))
        stats = llm.llm_engine.get_stats()
        assert stats.prefix_cache_hits > 0
        for b, (g_batch, w_batch) in enumerate(zip(got, want)):
            for i, ((g_ids, g_lp), (w_ids, w_lp)) in enumerate(zip(g_batch, w_batch)):
                assert g_ids == w_ids, f"batch {b}, prompt {i}"
                assert abs(g_lp - w_lp) < 1e-3, f"batch {b}, prompt {i}: logprob {g_lp} vs {w_lp}"
        assert [p.is_alive() for p in procs] == [True]
    finally:
        llm.shutdown()
    assert [p.exitcode for p in procs] == [0]  # stopped by the driver's order, not killed
    _assert_no_workers()
    llm.shutdown()  # idempotent


def test_invalid_sizes_raise_before_any_process_starts(tmp_path, monkeypatch):
    qwen = str(make_tiny_model(tmp_path / "q", "Qwen3ForCausalLM", num_heads=4, num_kv_heads=2))
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a positive integer, got 0"):
        LLM(qwen, tensor_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a positive integer, got -2"):
        LLM(qwen, tensor_parallel_size=-2, device="cpu")
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size"
    ):
        LLM(qwen, tensor_parallel_size=3, device="cpu")
    odd_kv = str(
        make_tiny_model(tmp_path / "kv3", "LlamaForCausalLM", hidden_size=96, num_heads=6, num_kv_heads=3)
    )
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(3\) is not divisible by tensor_parallel_size"
    ):
        LLM(odd_kv, tensor_parallel_size=2, device="cpu")
    kv4 = str(
        make_tiny_model(tmp_path / "kv4", "LlamaForCausalLM", hidden_size=192, num_heads=12, num_kv_heads=4)
    )
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(6\) is not a multiple of num_key_value_heads \(4"
    ):
        LLM(kv4, tensor_parallel_size=6, device="cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) is larger than the number of GPUs"):
        LLM(qwen, tensor_parallel_size=2, device="cuda")
    _assert_no_workers()


def test_worker_failure_at_start_is_raised_on_the_driver(tiny_qwen3_kv2, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "1:init")  # rank 1 raises after joining the group
    with pytest.raises(WorkerError, match=r"rank 1 failed(.|\n)*injected failure on rank 1 at init"):
        LLM(tiny_qwen3_kv2, tensor_parallel_size=2, **ENGINE)
    _assert_no_workers()


def test_worker_failure_in_a_step_stops_every_rank(tiny_qwen3_kv2, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "1:step:3")
    llm = LLM(tiny_qwen3_kv2, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(WorkerError, match=r"Traceback(.|\n)*injected failure on rank 1 at step:3"):
        llm.generate(_batches()[0], GREEDY, use_tqdm=False)
    _assert_no_workers()
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="tensor-parallel workers have shut down.*injected failure"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.shutdown()


def test_driver_failure_in_a_step_stops_every_rank(tiny_qwen3_kv2):
    llm = LLM(tiny_qwen3_kv2, tensor_parallel_size=2, **ENGINE)
    runner = llm.llm_engine.runner
    forward = runner._forward
    calls = []

    def failing_forward(inputs, *args):
        calls.append(1)
        if len(calls) == 2:  # the workers are already inside this step's collectives
            raise RuntimeError("rank 0 failed on purpose")
        return forward(inputs, *args)

    runner._forward = failing_forward
    with pytest.raises(RuntimeError, match="rank 0 failed on purpose"):
        llm.generate(_batches()[0], GREEDY, use_tqdm=False)
    _assert_no_workers()
    llm.shutdown()


_SCRIPT = """
import sys, time
import torch
torch.set_num_threads(1)
from tilellm import LLM, SamplingParams
llm = LLM({model!r}, tensor_parallel_size=2, **{engine!r})
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
print("WORKERS", *llm.llm_engine.runner.driver.worker_pids, flush=True)
if sys.argv[1] == "hang":
    time.sleep(300)
"""


def test_workers_end_with_the_driver_process(tiny_qwen3_kv2, tmp_path):
    """No shutdown() call: workers stop at interpreter exit, and when the driver is killed. The
    script has no `if __name__ == "__main__":` guard: spawn must not re-run it in the worker."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(model=tiny_qwen3_kv2, engine=ENGINE)))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(script), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("exit", "hang")
    }
    watchdog = threading.Timer(180, lambda: [p.kill() for p in procs.values()])  # never hang the suite
    watchdog.start()
    try:
        hang = procs["hang"]
        line = hang.stdout.readline()
        assert line.startswith("WORKERS"), line + hang.stderr.read() if not line else line
        hang_workers = [int(p) for p in line.split()[1:]]
        assert hang_workers and all(_alive(p) for p in hang_workers)
        hang.send_signal(signal.SIGKILL)  # no atexit, no finalizer: the workers watch their parent
        hang.wait(30)

        out, err = procs["exit"].communicate(timeout=120)
        assert procs["exit"].returncode == 0, err
        exit_workers = [int(p) for p in out.split("WORKERS", 1)[1].split()]
        assert _wait_gone(exit_workers, timeout=2.0) == []
        assert _wait_gone(hang_workers) == []
    finally:
        watchdog.cancel()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_two_ranks_with_speculative_decoding(tiny_qwen3_kv2, method):
    """Speculative decoding under tensor parallelism: drafts (from rank 0's n-gram lookup, or its
    draft model) ride in the step's payload to every rank; the tokens are the single rank's
    without speculation."""
    motif = [5, 17, 33, 2, 91, 4]
    prompts = [motif * 5, [7] * 12 + motif, list(range(40, 60))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    single = LLM(tiny_qwen3_kv2, tensor_parallel_size=1, **ENGINE)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_min": 1} if method == "ngram" else {"model": tiny_qwen3_kv2})
    llm = LLM(tiny_qwen3_kv2, tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    finally:
        llm.shutdown()
    _assert_no_workers()


def _assert_same_generations(got: list, want: list) -> None:
    """The same tokens for every prompt, and logprobs within 1e-3 (fp32 summation order)."""
    for i, ((g_ids, g_lp), (w_ids, w_lp)) in enumerate(zip(got, want)):
        assert g_ids == w_ids, f"prompt {i}"
        assert abs(g_lp - w_lp) < 1e-3, f"prompt {i}: logprob {g_lp} vs {w_lp}"


def test_two_ranks_with_fp8_weights_and_cache_give_the_single_rank_tokens(tiny_qwen3_kv2, tmp_path):
    """An FP8 checkpoint (16 x 16 blocks: each rank's q/k/v and gate/up shards fall on blocks)
    whose layers ship their KV cache scales, over an FP8 cache: each rank holds its rows of the
    weights and their block scales, and its heads' cache, with the same scales as one rank."""
    from safetensors.torch import load_file, save_file

    from tilellm.testing import quantize_model_dir_fp8

    model_dir = quantize_model_dir_fp8(tiny_qwen3_kv2, tmp_path / "fp8", (16, 16))
    weights = load_file(model_dir / "model.safetensors")
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01)
    save_file(weights, model_dir / "model.safetensors")
    fp8 = dict(ENGINE, kv_cache_dtype="fp8")
    prompts = _batches()[0]
    want = _generate(LLM(str(model_dir), tensor_parallel_size=1, **fp8), prompts)
    llm = LLM(str(model_dir), tensor_parallel_size=2, **fp8)
    try:
        runner = llm.llm_engine.runner
        assert runner.kv_cache.dtype == torch.float8_e4m3fn and not runner.kv_scales_pending
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight.shape[0] == (4 + 2 * 2) * 16 // 2
        _assert_same_generations(_generate(llm, prompts), want)
    finally:
        llm.shutdown()
    _assert_no_workers()


def test_two_ranks_with_static_activation_scales_give_the_single_rank_tokens(tiny_qwen3_kv2, tmp_path):
    """A per-tensor FP8 checkpoint with calibrated static input scales: every rank loads every
    scale and quantizes its part of a layer's input by it, which is elementwise, so a row-parallel
    layer's partial sums are those of one rank's quantized input (the tokens and logprobs of one
    rank)."""
    from tilellm.testing import quantize_model_dir_fp8

    model_dir = quantize_model_dir_fp8(tiny_qwen3_kv2, tmp_path / "fp8", per_tensor=True)
    prompts = _batches()[0]
    want = _generate(LLM(str(model_dir), tensor_parallel_size=1, **ENGINE), prompts)
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    try:
        o_proj = llm.llm_engine.runner.model.model.layers[0].self_attn.o_proj
        assert o_proj.quant_method.static_activations and o_proj.input_scale.numel() == 1
        _assert_same_generations(_generate(llm, prompts), want)
    finally:
        llm.shutdown()
    _assert_no_workers()
