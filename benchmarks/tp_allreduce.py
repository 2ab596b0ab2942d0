"""What share of a tensor-parallel decode step the all-reduces take, and how E1 scales with TP.

    python benchmarks/tp_allreduce.py --world-size 2 --hidden 4096 --layers 36 --tokens 1,64,256,16384 \
        [--e1 tp1.json tp2.json] [--json FILE]

A tensor-parallel decoder layer all-reduces its attention output (after o_proj) and its MLP output
(after down_proj): 2 x layers all-reduces of a [tokens, hidden] tensor per step. Each rank (NCCL on
GPUs, gloo on CPU) times one all-reduce of each size eagerly, and, on GPUs, the whole step's
2 x layers all-reduces replayed from a CUDA graph, as the engine's decode graphs run them (median of
repeated replays, after warm-up; random data).

`--e1 tp1.json tpN.json` (from `tilellm bench throughput --workloads E1 --model-shape qwen3-8b -tp N
--json ...`, N = the world size) adds the summary: output tok/s at 1 and N GPUs, scaling efficiency
(speedup / N), and the all-reduce share of a decode step at 256 running requests (the
graph-replayed all-reduces of 256 tokens over the step time that E1 measured at TP N). The
all-reduces run between dependent matmuls, so they do not overlap compute: their time is the
step's communication share. `benchmarks/tensor_parallel.sh` runs all of it on two GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_cuda(fn, iters: int = 50) -> float:
    """Median milliseconds of `fn` over `iters` calls, each between CUDA events."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_cpu(fn, iters: int = 20) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_step_graph(x: torch.Tensor, num_allreduces: int) -> float:
    """Median ms of one CUDA-graph replay of `num_allreduces` all-reduces of x's shape."""
    bufs = [torch.randn_like(x) * 1e-3 for _ in range(2)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # NCCL's first calls on a side stream, before any capture
        for b in bufs:
            dist.all_reduce(b)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local, as the engine captures under tensor parallelism: NCCL's watchdog thread may
    # still query the events of the eager calls above while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(num_allreduces):
            dist.all_reduce(bufs[i % 2])
    for _ in range(3):
        graph.replay()
    ms = _time_cuda(graph.replay, iters=20)
    # A live graph that holds NCCL work keeps its communicator from being destroyed (NCCL >= 2.26
    # waits for such graphs): free it before the process group goes.
    del graph
    torch.cuda.synchronize()
    return ms


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(rank)
    rows = []
    for tokens in args.tokens:
        # Scaled so that repeated in-place sums stay finite (the values do not change the timing).
        x = torch.randn(tokens, args.hidden, device=device, dtype=dtype, generator=gen) * 1e-3
        for _ in range(5):
            dist.all_reduce(x)
        timer = _time_cuda if cuda else _time_cpu
        one_ms = timer(lambda x=x: dist.all_reduce(x))
        row = {"tokens": tokens, "bytes": x.numel() * x.element_size(), "eager_ms": one_ms}
        if cuda:
            row["step_graph_ms"] = _time_step_graph(x, 2 * args.layers)
        row["step_eager_ms"] = 2 * args.layers * one_ms
        rows.append(row)
    if rank == 0:
        out["rows"] = rows
        out["backend"] = dist.get_backend()
    dist.barrier()
    dist.destroy_process_group()


def _e1_summary(tp1_path: str, tpn_path: str, world: int, rows: list[dict]) -> dict:
    def e1(path: str) -> dict:
        with open(path) as f:
            results = json.load(f)["results"]
        return next(r for r in results if r["workload"] == "E1")

    r1, r2 = e1(tp1_path), e1(tpn_path)
    speedup = r2["output_tok_s"] / r1["output_tok_s"]
    summary = {
        "tp1_tok_s": r1["output_tok_s"],
        f"tp{world}_tok_s": r2["output_tok_s"],
        "speedup": speedup,
        "scaling_efficiency": speedup / world,
        "tp1_step_ms_256": r1.get("step_ms_256"),
        f"tp{world}_step_ms_256": r2.get("step_ms_256"),
    }
    at_256 = next((r for r in rows if r["tokens"] == 256), None)
    if at_256 and r2.get("step_ms_256"):
        per_step = at_256.get("step_graph_ms", at_256["step_eager_ms"])
        summary["allreduce_ms_per_step_256"] = per_step
        summary["allreduce_share_256"] = per_step / r2["step_ms_256"]
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096, help="Qwen3-8B: 4096")
    ap.add_argument("--layers", type=int, default=36, help="Qwen3-8B: 36")
    ap.add_argument("--tokens", default="1,64,256,16384", help="comma-separated token counts per step")
    ap.add_argument(
        "--e1", nargs=2, metavar=("TP1_JSON", "TPN_JSON"), default=None, help="E1 at TP 1 and TP world-size"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    missing = [p for p in args.e1 or [] if not os.path.isfile(p)]
    if missing:  # checked before the ranks start, not after minutes of timing
        ap.error(f"--e1: no such file: {', '.join(missing)} (written by `tilellm bench throughput --json`)")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(args.world_size, _free_port(), args, out), nprocs=args.world_size)
        result = {"world_size": args.world_size, "hidden": args.hidden, "layers": args.layers, **dict(out)}
    print(f"all-reduce over {args.world_size} ranks ({result['backend']}), hidden {args.hidden}:")
    print(f"{'tokens':>7} {'MB':>8} {'one ms':>9} {'step (2 x layers) ms':>22} {'in a CUDA graph ms':>20}")
    for r in result["rows"]:
        graph = f"{r['step_graph_ms']:.3f}" if "step_graph_ms" in r else "-"
        mb = r["bytes"] / 1e6
        print(f"{r['tokens']:7d} {mb:8.2f} {r['eager_ms']:9.4f} {r['step_eager_ms']:22.3f} {graph:>20}")
    if args.e1:
        result["e1"] = _e1_summary(*args.e1, args.world_size, result["rows"])
        print(json.dumps(result["e1"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
