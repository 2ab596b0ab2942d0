"""FP8 KV cache scales, one per layer (what the engine uses) or one per KV head: which is closer?

    python benchmarks/kv_scales.py [--model DIR] [--prompts 64] [--json F]

Runs the model (default: the embedded arithmetic model, CPU, fp32) over held-out demo prompts, keeps every
layer's K and V as the cache would store them (after the K norm and rotary), and quantizes them
to e4m3 both ways with the engine's rule (scale = amax / 200 for K, amax / 100 for V, measured
on the same values): per tensor (each layer's K and V) and per KV head. Reported per layer, for
each: the relative RMS error of K and of V, and of each head's causal attention output over the
prompt (the queries against the dequantized K and V, against fp32). A synthetic row repeats the
measurement with one head's K and V shrunk 100x and 10,000x (heads of very different ranges,
where per-head scales should help most).

e4m3 keeps 3 mantissa bits in every binade, so a scale only decides which values become
subnormal (below 2^-6 of the scale) or saturate: per-head scales can only help values far below
a head's own range.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from tilellm.kernels.fp8 import FP8_MAX, K_SCALE_RANGE, V_SCALE_RANGE, dequantize_fp8, quantize_fp8


def _capture(model: str, num_prompts: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) of every layer's first prefill of each prompt."""
    from tilellm import LLM, SamplingParams
    from tilellm.assets import demo_metadata
    from tilellm.attention.backends import base
    from tilellm.demo.task import problems_for_model

    llm = LLM(model, device="cpu", dtype="float32", enable_prefix_caching=False)
    prompts = [p.prompt for p in problems_for_model(demo_metadata(model), num_prompts, seed=7)]
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real = base.AttentionBackend.forward

    def keep(self, layer, q, k, v, meta_, *, positions=None):
        if meta_.kind.value == "prefill":
            # the layer rotates q and k itself (with the store): capture them as the cache gets them
            q_rot, k_rot = (q, k) if positions is None else layer.rotate(q, k, positions)
            captured.append((q_rot.detach().clone(), k_rot.detach().clone(), v.detach().clone()))
        return real(self, layer, q, k, v, meta_, positions=positions)

    base.AttentionBackend.forward = keep
    try:
        for p in prompts:  # one at a time: each capture is one prompt's rows
            llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        base.AttentionBackend.forward = real
    return captured


def _roundtrip(x: torch.Tensor, value_range: float, per_head: bool) -> torch.Tensor:
    """x [T, H, D] quantized to e4m3 and back with amax / value_range scales."""
    amax = x.abs().amax(dim=(0, 2), keepdim=True) if per_head else x.abs().amax()
    scale = amax.clamp(min=1e-6) / value_range
    return dequantize_fp8(quantize_fp8(x, scale), scale, torch.float32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one prompt, q [T, Hq, D] over k / v [T, Hkv, D] -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    mask = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
    p = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", p, v)


def measure(layers: list[list[tuple]], shrink: float = 1.0) -> list[dict]:
    """Per layer: relative errors of K, V and the attention output, per tensor and per head
    (head 0's K and V multiplied by `shrink` first)."""
    rows = []
    for i, items in enumerate(layers):
        errs: dict[str, list[float]] = {}
        for q, k, v in items:
            if shrink != 1.0:
                k, v = k.clone(), v.clone()
                k[:, 0] *= shrink
                v[:, 0] *= shrink
            exact = _attention(q, k, v)
            for per_head in (False, True):
                name = "head" if per_head else "tensor"
                kq, vq = _roundtrip(k, K_SCALE_RANGE, per_head), _roundtrip(v, V_SCALE_RANGE, per_head)
                errs.setdefault(f"k_{name}", []).append(_rel(kq, k))
                errs.setdefault(f"v_{name}", []).append(_rel(vq, v))
                out = _attention(q, kq, vq)
                # the worst head's error: a head of small values weighs little in the whole output
                worst = max(_rel(out[:, h], exact[:, h]) for h in range(out.shape[1]))
                errs.setdefault(f"out_{name}", []).append(worst)
        rows.append({"layer": i, **{key: sum(v) / len(v) for key, v in errs.items()}})
    return rows


def main() -> int:
    from tilellm.assets import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    captured = _capture(args.model, args.prompts)
    from tilellm.models.loader import read_model_config

    num_layers = int(read_model_config(args.model)[0]["num_hidden_layers"])
    layers = [captured[i::num_layers] for i in range(num_layers)]
    result = {"model": args.model, "prompts": args.prompts, "fp8_max": FP8_MAX}
    print(f"{args.model}: {args.prompts} prompts; relative RMS error (mean over prompts); out: worst head")
    cases = (("as trained", 1.0), ("head 0 100x smaller", 1e-2), ("head 0 10,000x smaller", 1e-4))
    for i, items in enumerate(layers):  # how far apart the heads' ranges are in this model
        k_amax = torch.stack([k.abs().amax(dim=(0, 2)) for _, k, _ in items]).amax(0)
        v_amax = torch.stack([v.abs().amax(dim=(0, 2)) for _, _, v in items]).amax(0)
        ratios = (float(k_amax.max() / k_amax.min()), float(v_amax.max() / v_amax.min()))
        result.setdefault("head_range_ratio", []).append(ratios)
        print(f"layer {i}: largest / smallest head amax: K {ratios[0]:.2f}, V {ratios[1]:.2f}")
    print(f"{'case':22} {'layer':>5} {'K tensor':>9} {'K head':>9} {'V tensor':>9} {'V head':>9} "
          f"{'out tens.':>9} {'out head':>9}")  # fmt: skip
    for case, shrink in cases:
        rows = measure(layers, shrink)
        result[case] = rows
        for r in rows:
            errors = [r[f"{x}_{y}"] for x in ("k", "v", "out") for y in ("tensor", "head")]
            print(f"{case:22} {r['layer']:>5} " + " ".join(f"{e:>9.2e}" for e in errors))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
