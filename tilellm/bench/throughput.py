"""Offline engine throughput on the end-to-end workloads E1, E2 and E3 (docs/workloads.md).

Model: Qwen3-0.6B's architecture with random weights (`load_format="dummy"`, bf16), unless
`--model DIR` names a real directory. Every request ignores EOS. Per workload: output tok/s,
time to first token, and where the engine's step time goes: host work (scheduler + input
preparation + postprocess) and the device span of each step (CUDA events). With asynchronous
scheduling (the CUDA default) host work overlaps the device, so the overhead that costs
throughput is the device's idle share, `1 - device time / wall time`; both are reported, over
the whole run and over the decode steps with 256 running requests. `--hf-baseline` runs
`transformers` generate on E1 (batches of 64) in
the same process. `--json FILE` writes every number.

  E1: random.seed(0); 256 prompts of randint(100, 1024) tokens (randint(0, 10000) each, the length
      drawn first), then 256 max_tokens randint(100, 1024); temperature 0.6. 133966 output tokens.
  E2: 256 x (one shared 2048-token prefix + 128 own tokens), 128 output tokens; prefix caching on
      vs off.
  E3: 8 requests x 32768-token prompts, 512 output tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tilellm.bench import breakdown
from tilellm.commands.common import UsageError, check_model_dir, flag_error, resolve_device

E1_OUTPUT_TOKENS = 133966


# random-weight architectures (tilellm.testing); the MoE ones are E5's
MODEL_SHAPES = ["qwen3-0.6b", "qwen3-8b", "deepseek-v2-lite", "qwen3-30b-a3b"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads",
        default="E1,E2,E3",
        help="comma-separated subset of E1,E2,E3,E6 (E6: sparse attention on a reduced DeepSeek-V3.2, "
        "its own model shape)",
    )
    p.add_argument("--json", default=None, help="write results to this file")
    p.add_argument(
        "--model", default=None, metavar="DIR", help="a model directory instead of the random Qwen3-0.6B"
    )
    p.add_argument(
        "--model-shape",
        default="qwen3-0.6b",
        choices=MODEL_SHAPES,
        help="the architecture of the random-weight model (without --model): E1's Qwen3-0.6B, "
        "Qwen3-8B for the tensor-parallel benchmark, or E5's DeepSeek-V2-Lite / Qwen3-30B-A3B",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="measure the card's copy and matmul ceilings and report each workload's roofline "
        "(tilellm.bench.roofline) beside its throughput",
    )
    from tilellm.engine.arg_utils import EngineArgs

    # The engine's flags, from its one definition; this benchmark runs bf16 with vLLM's offline
    # token budget for GPUs of >= 70 GiB (`LLM`'s own default is 8192: a larger budget means
    # fewer, larger mixed steps, whose eager launch costs the host about as much as a small one).
    EngineArgs.add_cli_args(
        p.add_argument_group("engine"),
        defaults={"dtype": "bfloat16", "max_num_batched_tokens": 16384},
        exclude=("max_model_len", "enable_prefix_caching"),  # set per workload
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run E1 this many times on one engine (run k > 1 adds 2(k - 1) to every prompt token id: "
        "the same work, no prefix-cache hits; warm-ups use odd shifts); each run is reported",
    )
    p.add_argument(
        "--dump-traceback-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="dump every thread's stack on every rank after SECONDS (where a run that hangs waits)",
    )
    p.add_argument(
        "--compare-fused",
        action="store_true",
        help="also run E1 with the unfused PyTorch RMSNorm / SiLU-and-mul / rotary (what fusion gains; "
        "extra.fused_speedup is that run's time over E1 run 1's). Meaningful with the Triton attention "
        "backend (the GPU default): with --attention-backend reference both runs are unfused",
    )
    p.add_argument(
        "--structured-outputs",
        action="store_true",
        help="also run E1 with every request constrained by a JSON schema (E1_JSON_SCHEMA), on the "
        "same engine; a random-weight model gets a synthetic byte-level tokenizer of its vocabulary",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each workload, run it once more under torch.profiler and print where the time goes: "
        "device time by kernel class, the device's idle time, the host's work per step",
    )
    p.add_argument("--hf-baseline", action="store_true", help="also run transformers generate on E1")
    p.add_argument(
        "--hf-requests", type=int, default=256, help="E1 requests for the HF baseline (batches of 64)"
    )
    p.add_argument(
        "--scale",
        type=float,
        default=None,
        help="shrink lengths and counts (a short run: 0.02); 1 = the workloads as defined (GPU default)",
    )


# -- workloads ------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float
    note: str = ""


def e1(scale: float = 1.0) -> Workload:
    random.seed(0)
    n = max(1, round(256 * scale))
    hi = max(2, round(1024 * scale))
    lo = max(1, round(100 * scale))
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo, hi))] for _ in range(n)]
    max_tokens = [random.randint(lo, hi) for _ in range(n)]
    return Workload("E1", prompts, max_tokens, 0.6, "nano-vllm benchmark: 256 random requests")


def e2(scale: float = 1.0) -> list[int] | Workload:
    rng = random.Random(2)
    n = max(1, round(256 * scale))
    prefix = [rng.randint(0, 10000) for _ in range(max(1, round(2048 * scale)))]
    own = max(1, round(128 * scale))
    prompts = [prefix + [rng.randint(0, 10000) for _ in range(own)] for _ in range(n)]
    return Workload("E2", prompts, [max(1, round(128 * scale))] * n, 0.6, "shared 2048-token prefix")


def e6(scale: float = 1.0) -> Workload:
    """32 requests x 32768-token prompts, 256 output tokens each (DeepSeek-V3.2's sparse decode)."""
    rng = random.Random(6)
    n = max(1, round(32 * min(1.0, scale * 4)))
    length = max(1, round(32768 * scale))
    prompts = [[rng.randint(0, 10000) for _ in range(length)] for _ in range(n)]
    return Workload("E6", prompts, [max(2, round(256 * scale))] * n, 0.6, "sparse attention at 32k context")


def e3(scale: float = 1.0) -> Workload:
    rng = random.Random(3)
    n = max(1, round(8 * min(1.0, scale * 4)))
    length = max(1, round(32768 * scale))
    prompts = [[rng.randint(0, 10000) for _ in range(length)] for _ in range(n)]
    return Workload("E3", prompts, [max(1, round(512 * scale))] * n, 0.6, "long context")


# -- running --------------------------------------------------------------------------------------


@dataclass
class Result:
    workload: str
    variant: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tok_s: float
    total_tok_s: float
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    steps: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    execute_s: float = 0.0
    device_s: float = 0.0
    postprocess_s: float = 0.0
    host_share: float | None = None  # (schedule + prepare + postprocess) / wall time
    device_idle_share: float | None = None  # 1 - (sum of device spans) / wall time: the real overhead
    host_share_256: float | None = None  # host / step wall time over decode steps with >= 250 requests
    device_idle_share_256: float | None = None  # 1 - device / step wall time over those steps
    host_us_per_step_256: float | None = None
    step_ms_256: float | None = None
    extra: dict = field(default_factory=dict)
    output_lengths: list[int] = field(default_factory=list, repr=False)  # per request, in order


def _model_dir(args: argparse.Namespace, tmp: str) -> tuple[str, str]:
    if args.model:
        return args.model, "safetensors"
    from tilellm.testing import make_random_model_dir

    return str(make_random_model_dir(tmp, shape_config(args.model_shape))), "dummy"


def shape_config(name: str) -> dict:
    from tilellm import testing

    return {
        "qwen3-0.6b": testing.QWEN3_0_6B_CONFIG,
        "qwen3-8b": testing.QWEN3_8B_CONFIG,
        "deepseek-v2-lite": testing.DEEPSEEK_V2_LITE_CONFIG,
        "qwen3-30b-a3b": testing.QWEN3_30B_A3B_CONFIG,
    }[name]


# E1 with structured outputs: every request's answer is a record of this schema. A grammar ends
# its request when the JSON is complete, so the unconstrained peer is run on the same prompts
# with each request's max_tokens set to the length its constrained answer had.
E1_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "summary": {"type": "string"},
    },
    "required": ["title", "tags", "score", "summary"],
    "additionalProperties": False,
}


def _ensure_tokenizer(model: str, load_format: str) -> None:
    """A random-weight model directory gets a synthetic tokenizer of its vocabulary size."""
    if load_format != "dummy" or os.path.exists(os.path.join(model, "tokenizer.json")):
        return
    from tilellm.testing import save_synthetic_tokenizer

    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    print(f"# writing a synthetic byte-level tokenizer of {vocab} tokens ...", flush=True)
    save_synthetic_tokenizer(model, vocab)


def _make_llm(args: argparse.Namespace, model: str, load_format: str, max_model_len: int, **over):
    from tilellm import LLM
    from tilellm.engine.arg_utils import EngineArgs

    kwargs = EngineArgs.from_cli_args(args)
    has_tokenizer = os.path.exists(os.path.join(model, "tokenizer.json"))
    kwargs.update(
        max_model_len=max_model_len,
        load_format=load_format,
        skip_tokenizer_init=load_format == "dummy" and not has_tokenizer,
    )
    kwargs.update(over)
    # Timestamps on stdout: a run cut by a time limit still shows how far the engine got.
    print(f"# building the engine (tensor_parallel_size={args.tensor_parallel_size}) ...", flush=True)
    t0 = time.perf_counter()
    try:
        llm = LLM(model, **kwargs)
    except ValueError as e:  # the engine's documented error for a model it cannot run
        raise flag_error(e) from None
    print(f"# engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return llm


def _e1_structured(llm: Any, w: Workload, shift: int) -> list[Result]:
    """E1 with every request under E1_JSON_SCHEMA, then its unconstrained peer: the same prompts,
    each request's max_tokens the length of its constrained answer (the same tokens to produce).
    Prompt ids are shifted by `shift` and `shift + 2`: no prefix-cache hits on E1's own prompts."""
    from tilellm import StructuredOutputsParams

    so = StructuredOutputsParams(json=E1_JSON_SCHEMA)
    constrained = dataclasses.replace(w, prompts=[[t + shift for t in p] for p in w.prompts])
    json_run = run_workload(llm, constrained, "every request with a JSON schema", so)
    peer = dataclasses.replace(
        w, prompts=[[t + shift + 2 for t in p] for p in w.prompts], max_tokens=json_run.output_lengths
    )
    free_run = run_workload(llm, peer, "unconstrained, the same output lengths")
    json_run.extra["seconds_over_unconstrained"] = json_run.seconds / free_run.seconds
    return [json_run, free_run]


def _fit_vocab(w: Workload, vocab: int) -> Workload:
    """A small --model: fold the token ids into its vocabulary (no change for Qwen3's)."""
    if max(max(p) for p in w.prompts) < vocab:
        return w
    return Workload(w.name, [[t % vocab for t in p] for p in w.prompts], w.max_tokens, w.temperature, w.note)


def _needed_len(w: Workload) -> int:
    """max_model_len for a workload: its longest prompt plus its largest max_tokens."""
    return max(len(p) for p in w.prompts) + max(w.max_tokens)


def _free() -> None:
    """Release the GPU memory of an engine the caller has already dropped (`llm = None`)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def compiled_kernel_variants() -> int:
    """Triton kernel variants compiled so far in this process (tilellm's kernels, every device).

    A run that compiles (a step shape the engine's warm-up did not cover) pays ~1 s per variant;
    the benchmark reports the count so that such stalls are seen, not guessed."""
    import importlib

    from triton.runtime.jit import JITFunction

    total = 0
    for name in ("paged", "merge", "store", "prefill", "sparse", "fused", "hopper"):
        module = importlib.import_module(f"tilellm.kernels.{name}")
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                total += sum(len(cache[0]) for cache in getattr(obj, "device_caches", {}).values())
    return total


def run_workload(
    llm: Any, w: Workload, variant: str = "", structured_outputs: Any = None, *, profile: bool = False
) -> Result:
    """`structured_outputs`: a `StructuredOutputsParams` every request is constrained by.
    `profile`: run under torch.profiler and add the run's breakdown (`tilellm.bench.breakdown`)
    to `extra["breakdown"]` (the profiler's own cost slows the run a little)."""
    from tilellm import SamplingParams

    engine = llm.llm_engine
    w = _fit_vocab(w, engine.vocab_size)
    params = [
        SamplingParams(
            temperature=w.temperature, max_tokens=m, ignore_eos=True, structured_outputs=structured_outputs
        )
        for m in w.max_tokens
    ]
    # Warm-up at the workload's shapes (token ids shifted: nothing for the prefix cache to find),
    # so that no JIT compile lands in the measured run.
    warm = [[(t + 1) % engine.vocab_size for t in p] for p in w.prompts[:32]]
    # (the grammar is compiled here too: its compile, once per schema, is not the run's work)
    warm_params = SamplingParams(max_tokens=3, ignore_eos=True, structured_outputs=structured_outputs)
    llm.generate(warm, warm_params, use_tqdm=False)
    engine.timings.reset()
    stats0 = engine.get_stats()
    runner_times = engine.runner.host_times
    runner_times.clear()
    replays = getattr(engine.runner, "graph_replays", {})
    for k in replays:  # count this run's replays only
        replays[k] = 0
    engine.record_steps = True
    timed_before = engine.runner.time_device  # (TILELLM_TIME_DEVICE=1 keeps it on)
    engine.runner.time_device = True
    compiled_before = compiled_kernel_variants()
    with breakdown.profiled_kernels() if profile else contextlib.nullcontext([]) as kernels:
        _sync()
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=True)
        _sync()
        seconds = time.perf_counter() - t0
    engine.runner.time_device = timed_before
    engine.record_steps = False
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    out_tokens = sum(lengths)
    prompt_tokens = sum(len(p) for p in w.prompts)
    ttft = np.array(
        [o.metrics.time_to_first_token for o in outs if o.metrics.time_to_first_token is not None]
    )
    tm = engine.timings
    r = Result(
        workload=w.name,
        variant=variant,
        requests=len(outs),
        output_lengths=lengths,
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        seconds=seconds,
        output_tok_s=out_tokens / seconds,
        total_tok_s=(out_tokens + prompt_tokens) / seconds,
        ttft_mean_s=float(ttft.mean()) if len(ttft) else None,
        ttft_p50_s=float(np.percentile(ttft, 50)) if len(ttft) else None,
        ttft_p99_s=float(np.percentile(ttft, 99)) if len(ttft) else None,
        steps=tm.num_steps,
        schedule_s=tm.schedule_s,
        prepare_s=tm.prepare_s,
        execute_s=tm.execute_s,
        device_s=tm.device_s,
        postprocess_s=tm.postprocess_s,
        host_share=tm.host_s / seconds,
        device_idle_share=1 - tm.device_s / seconds if tm.device_s else None,
    )
    # records: (kind, num_seqs, num_tokens, schedule, prepare, execute, device, post)
    full = [x for x in tm.records if x[0] == "decode" and x[1] >= 250]
    if full:
        host = np.array([x[3] + x[4] + x[7] for x in full])
        step = np.array([x[3] + x[4] + x[5] + x[7] for x in full])
        r.host_share_256 = float(host.sum() / step.sum())
        device = np.array([x[6] or 0.0 for x in full])
        if device.any():
            r.device_idle_share_256 = float(1 - device.sum() / step.sum())
        r.host_us_per_step_256 = float(np.median(host) * 1e6)
        r.step_ms_256 = float(np.median(step) * 1e3)
        r.extra["decode_steps_256"] = len(full)
    kinds: dict[str, int] = {}
    device_by_kind: dict[str, float] = {}
    for x in tm.records:
        kinds[x[0]] = kinds.get(x[0], 0) + 1
        device_by_kind[x[0]] = device_by_kind.get(x[0], 0.0) + (x[6] or 0.0)
    r.extra["steps_by_kind"] = kinds
    # Device seconds by step kind: how much of the run is prefill work vs decode.
    r.extra["device_s_by_kind"] = {k: round(v, 3) for k, v in device_by_kind.items()}
    r.extra["num_cuda_graphs"] = len(getattr(engine.runner, "graphs", {}))
    r.extra["num_cascade_graphs"] = len(getattr(engine.runner, "cascade_graphs", {}))
    r.extra["num_short_graphs"] = len(getattr(engine.runner, "short_graphs", {}))
    r.extra["graph_replays"] = dict(getattr(engine.runner, "graph_replays", {}))
    # Host microseconds per step inside the runner's launch, by path and phase.
    for path in ("graph", "piecewise", "eager"):
        n = runner_times.get(f"{path}.steps", 0)
        if n:
            r.extra[f"launch_us_{path}"] = {
                k.split(".")[1]: round(v / n * 1e6, 1)
                for k, v in runner_times.items()
                if k.startswith(path + ".") and not k.endswith(".steps")
            }
            r.extra[f"launch_us_{path}"]["steps"] = int(n)
    r.extra["async_scheduling"] = engine.async_scheduling
    r.extra["tensor_parallel_size"] = engine.config.tensor_parallel_size
    r.extra["kernel_compiles_in_run"] = compiled_kernel_variants() - compiled_before
    r.extra["num_kv_blocks"] = engine.block_manager.num_blocks
    stats = engine.get_stats()
    # This run's lookups only (the engine's counters also hold the warm-up's and earlier runs').
    hits = stats.prefix_cache_hits - stats0.prefix_cache_hits
    r.extra["prefix_cache_hit_rate"] = hits / max(stats.prefix_cache_queries - stats0.prefix_cache_queries, 1)
    r.extra["preemptions"] = stats.num_preemptions - stats0.num_preemptions
    if profile:
        b = breakdown.breakdown_from_events(kernels, seconds, tm.num_steps)
        steps = max(tm.num_steps, 1)
        b.host_ms_per_step = {
            "schedule": tm.schedule_s / steps * 1e3,
            "prepare and launch": tm.prepare_s / steps * 1e3,
            "postprocess": tm.postprocess_s / steps * 1e3,
        }
        r.extra["breakdown"] = b.as_dict()
        print(b.format(f"{w.name} {variant}".strip()), flush=True)
    return r


def _sync() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except ImportError:  # pragma: no cover
        pass


def hf_baseline(model_dir: str, w: Workload, num_requests: int, dtype: str) -> Result:
    """`transformers` generate on the first `num_requests` of E1, batches of 64, left padding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        dtype, torch.bfloat16
    )
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS
    w = _fit_vocab(w, config.vocab_size)
    model.generation_config.pad_token_id = 0
    prompts, max_tokens = w.prompts[:num_requests], w.max_tokens[:num_requests]
    useful = 0
    _sync()
    t0 = time.perf_counter()
    for b in range(0, len(prompts), 64):
        batch, mt = prompts[b : b + 64], max_tokens[b : b + 64]
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids.to(dev),
                attention_mask=mask.to(dev),
                max_new_tokens=max(mt),
                do_sample=True,
                temperature=w.temperature,
                top_k=0,
                top_p=1.0,
            )
        useful += sum(mt)  # each request's own max_tokens; the rest of its row is padding work
    _sync()
    seconds = time.perf_counter() - t0
    del model
    return Result(
        workload="E1",
        variant=f"transformers generate, batches of 64 ({len(prompts)} requests)",
        requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=useful,
        seconds=seconds,
        output_tok_s=useful / seconds,
        total_tok_s=(useful + sum(len(p) for p in prompts)) / seconds,
    )


def _e6(args: argparse.Namespace, tmp: str) -> list[Result]:
    """E6 on a reduced DeepSeek-V3.2 (`DEEPSEEK_V32_REDUCED_CONFIG`, random weights): the top-2048
    selection, then the same weights with the indexer keeping every key (its top-k above any
    context), each on a fresh engine. extra.decode_tok_s: decode tokens over the decode steps'
    device time."""
    from tilellm.testing import DEEPSEEK_V32_REDUCED_CONFIG, make_random_model_dir

    w = e6(args.scale)
    out = []
    every_key = _needed_len(w)  # a top-k as long as the longest context keeps every key
    for variant, topk in (("top-2048", DEEPSEEK_V32_REDUCED_CONFIG["index_topk"]), ("every key", every_key)):
        model = make_random_model_dir(
            os.path.join(tmp, f"e6-{topk}"), {**DEEPSEEK_V32_REDUCED_CONFIG, "index_topk": topk}
        )
        llm = _make_llm(args, str(model), "dummy", max_model_len=_needed_len(w))
        r = run_workload(llm, w, f"indexer {variant}")
        decode_s = r.extra.get("device_s_by_kind", {}).get("decode")
        if decode_s:
            r.extra["decode_tok_s"] = round((r.output_tokens - r.requests) / decode_s)
        out.append(r)
        llm = None
        _free()
    if len(out) == 2 and out[0].extra.get("decode_tok_s") and out[1].extra.get("decode_tok_s"):
        out[0].extra["decode_speedup_vs_every_key"] = round(
            out[0].extra["decode_tok_s"] / out[1].extra["decode_tok_s"], 2
        )
    return out


def _add_rooflines(results: list[Result], model_dir: str, scale: float) -> None:
    """extra.roofline_tok_s and extra.of_roofline for E1-E3 results, from this card's ceilings."""
    from tilellm.bench.kernels import measure_ceilings
    from tilellm.bench.roofline import workload_roofline_s

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    ceilings = measure_ceilings()
    draws = {"E1": e1, "E2": e2, "E3": e3}
    for r in results:
        if r.workload not in draws or r.variant.startswith("transformers"):
            continue
        w = draws[r.workload](scale)
        seconds = workload_roofline_s(
            config,
            [len(p) for p in w.prompts],
            w.max_tokens,
            ceilings["copy_gbps"],
            ceilings["matmul_tflops"],
        )
        r.extra["roofline_tok_s"] = round(sum(w.max_tokens) / seconds)
        r.extra["of_roofline"] = round(r.output_tok_s / r.extra["roofline_tok_s"], 3)
        r.extra["ceilings"] = {k: round(v, 1) for k, v in ceilings.items()}


def _print_table(results: list[Result]) -> None:
    head = (
        f"{'workload':8} {'variant':28} {'reqs':>5} {'out tok':>8} {'sec':>7} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'host %':>7} {'idle %':>7} {'host%@256':>9} {'idle%@256':>9} "
        f"{'host us@256':>11} {'step ms@256':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in results:

        def f(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        print(
            f"{r.workload:8} {r.variant[:28]:28} {r.requests:>5} {r.output_tokens:>8} {r.seconds:>7.2f} "
            f"{r.output_tok_s:>10,.0f} {f(r.ttft_p50_s, '>9.3f')} "
            f"{f(None if r.steps == 0 else 100 * (r.host_share or 0), '>7.1f')} "
            f"{f(None if r.device_idle_share is None else 100 * r.device_idle_share, '>7.1f')} "
            f"{f(None if r.host_share_256 is None else 100 * r.host_share_256, '>9.1f')} "
            f"{f(None if r.device_idle_share_256 is None else 100 * r.device_idle_share_256, '>9.1f')} "
            f"{f(r.host_us_per_step_256, '>11.0f')} {f(r.step_ms_256, '>11.2f')}"
        )
    for r in results:
        if r.steps:
            print(
                f"  {r.workload} {r.variant}: {r.steps} steps; schedule {r.schedule_s:.2f}s, prepare "
                f"{r.prepare_s:.2f}s, execute {r.execute_s:.2f}s (device {r.device_s:.2f}s), "
                f"postprocess {r.postprocess_s:.2f}s; {r.extra}"
            )


def _profiled(llm: Any, w: Workload, shift: int, variant: str = "") -> Result:
    """`w` once more under the profiler, prompt ids shifted by `shift` (even: no run or warm-up
    before it finds these prompts in the prefix cache)."""
    rerun = dataclasses.replace(w, prompts=[[t + shift for t in p] for p in w.prompts])
    return run_workload(llm, rerun, f"{variant} profiled".strip(), profile=True)


SHORT_RUN = "--scale 0.02 --workloads E1"


def _check_scale(args: argparse.Namespace) -> None:
    """Full size (`--scale` left out) only on a GPU: on the CPU the full run takes hours, so say so
    before any work and name the short run; an explicit `--scale` runs anywhere."""
    device = resolve_device(args.device)
    if device != "cpu":
        args.scale = 1.0 if args.scale is None else args.scale
    elif args.scale is None:
        raise UsageError(
            "this is a GPU benchmark (E1-E3 on a random Qwen3-0.6B) and no GPU is in use: on "
            f"the CPU it runs for hours.\nA short run: tilellm bench throughput {SHORT_RUN} "
            "(or --scale 1: all of it)"
        )
    else:
        print(f"# on the CPU at --scale {args.scale:g}: a smoke run, not the workloads' figures", flush=True)
    if not args.scale > 0:
        raise UsageError(f"--scale must be > 0, got {args.scale:g}")


def main(args: argparse.Namespace) -> int:
    # The engine's INFO lines (model loaded, KV pool, kernels warmed up, graphs captured, with
    # their times) go to stderr: a long engine build shows its phases.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.dump_traceback_after:
        from tilellm.worker.tp_worker import DUMP_ENV

        faulthandler.dump_traceback_later(args.dump_traceback_after, exit=False, file=sys.__stderr__)
        os.environ[DUMP_ENV] = str(args.dump_traceback_after)  # tensor-parallel workers inherit it
    names = [n.strip().upper() for n in args.workloads.split(",") if n.strip()]
    unknown = set(names) - {"E1", "E2", "E3", "E6"}
    if unknown:
        raise UsageError(f"--workloads: unknown {', '.join(sorted(unknown))}; choose from E1, E2, E3, E6")
    _check_scale(args)
    results: list[Result] = []
    if args.model is not None:
        check_model_dir(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        model, load_format = _model_dir(args, tmp)
        if "E1" in names:
            w = e1(args.scale)
            if args.scale == 1.0:
                assert sum(w.max_tokens) == E1_OUTPUT_TOKENS
            if args.structured_outputs:
                _ensure_tokenizer(model, load_format)
            llm = _make_llm(args, model, load_format, max_model_len=_needed_len(w))
            for k in range(max(1, args.repeat)):
                # Even shifts: each run's warm-up shifts its prompts by 1 more (odd), so no run
                # finds another run's or warm-up's blocks in the prefix cache.
                run = (
                    w
                    if k == 0
                    else dataclasses.replace(w, prompts=[[t + 2 * k for t in p] for p in w.prompts])
                )
                results.append(
                    run_workload(llm, run, f"run {k + 1}/{args.repeat}" if args.repeat > 1 else "")
                )
            if args.profile:
                results.append(_profiled(llm, w, 2 * args.repeat))
            if args.structured_outputs:
                results += _e1_structured(llm, w, 2 * args.repeat + 2)
            llm = None
            _free()
            if args.compare_fused:
                llm = _make_llm(
                    args, model, load_format, max_model_len=_needed_len(w), fused_ops_backend="reference"
                )
                results.append(run_workload(llm, w, "unfused RMSNorm/SiLU/rotary"))
                results[-1].extra["fused_speedup"] = results[-1].seconds / results[0].seconds
                llm = None
                _free()
        if "E2" in names:
            w = e2(args.scale)
            e2_runs, profiled = [], []
            for caching in (True, False):
                llm = _make_llm(
                    args, model, load_format, max_model_len=_needed_len(w), enable_prefix_caching=caching
                )
                e2_runs.append(run_workload(llm, w, "prefix caching " + ("on" if caching else "off")))
                if args.profile and caching:
                    profiled.append(_profiled(llm, w, 2, "prefix caching on"))
                llm = None
                _free()  # before the next engine sizes its KV pool from free memory
            on, off = e2_runs
            on.extra["speedup_vs_off"] = off.seconds / on.seconds
            results += e2_runs + profiled
        if "E3" in names:
            w = e3(args.scale)
            llm = _make_llm(args, model, load_format, max_model_len=_needed_len(w))
            results.append(run_workload(llm, w))
            if args.profile:
                results.append(_profiled(llm, w, 2))
            llm = None
            _free()
        if "E6" in names:
            results += _e6(args, tmp)
        if args.hf_baseline:
            results.append(hf_baseline(model, e1(args.scale), args.hf_requests, args.dtype))
        if args.roofline:
            _add_rooflines(results, model, args.scale)
    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [asdict(r) for r in results]}, f, indent=2)
        print(f"wrote {args.json}")
    faulthandler.cancel_dump_traceback_later()
    return 0
