"""`fused_moe` (Triton) against its PyTorch twin, the twin against transformers, and the alignment.

Inputs are random normal with weights scaled by 1/sqrt(fan-in), so outputs are O(1); routing is
uniformly random (K distinct experts per token when K <= E, drawn with repeats otherwise, which
the layer must add twice), so small batches leave most experts without a token. Outputs go into
NaN-filled buffers: a row the kernels never write shows up. On CPU everything runs in fp32 (the
interpreter's bf16 tl.dot is wrong); the half-precision and CUDA-graph tests need a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import assert_close, poisoned, randn, tolerance
from tilellm.kernels import moe as tk
from tilellm.kernels.reference import moe as ref


def make(T, E, K, H, I, dtype, device, *, seed=0, ids_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    x = randn((T, H), dtype, device, gen)
    w13 = (randn((E, 2 * I, H), torch.float32, "cpu", gen) / H**0.5).to(device=device, dtype=dtype)
    w2 = (randn((E, H, I), torch.float32, "cpu", gen) / I**0.5).to(device=device, dtype=dtype)
    weights = torch.rand((T, K), generator=gen).to(device)
    if K <= E:
        ids = torch.rand((T, E), generator=gen).argsort(dim=1)[:, :K]
    else:
        ids = torch.randint(0, E, (T, K), generator=gen)
    return x, w13, w2, weights, ids.to(device=device, dtype=ids_dtype)


def check(x, w13, w2, weights, ids, tol):
    expected = ref.fused_moe(x, w13, w2, weights, ids)
    inputs = [t.clone() for t in (x, w13, w2, weights, ids)]
    out = poisoned(expected)
    got = tk.fused_moe(x, w13, w2, weights, ids, out=out)
    assert got is out, "fused_moe must return the out buffer it was given"
    assert_close(got, expected, tol, "fused_moe")
    for name, before, after in zip(("x", "w13", "w2", "weights", "ids"), inputs, (x, w13, w2, weights, ids)):
        assert torch.equal(before, after), f"fused_moe modified {name}"


# ----------------------------------------------------------------------------------------------
# Triton vs reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("K", [1, 2, 6])
@pytest.mark.parametrize("E", [1, 4, 8, 16])
def test_matches_reference(E, K, T, device):
    # I = 40: not a multiple of any column tile; H = 48: not a multiple of the reduction step
    ids_dtype = torch.int32 if (E + K + T) % 2 else torch.int64
    inputs = make(T, E, K, 48, 40, torch.float32, device, seed=E * 100 + K * 10 + T, ids_dtype=ids_dtype)
    check(*inputs, tolerance(torch.float32, device))


@pytest.mark.parametrize(("H", "I"), [(16, 16), (64, 32), (20, 24), (128, 176), (24, 200)])
def test_layer_dims(H, I, device):
    """Tiny test models' (H, I) and odd ones: partial column tiles, several partial reduction steps."""
    check(*make(9, 4, 2, H, I, torch.float32, device, seed=H + I), tolerance(torch.float32, device))


def test_many_tokens(device):
    """T = 4096: the large-batch tiles (128-row blocks), many blocks per expert."""
    check(*make(4096, 8, 2, 16, 16, torch.float32, device, seed=4096), tolerance(torch.float32, device))


def test_routing_to_few_experts(device):
    """Every token goes to experts 3 and 11 of 16: fourteen experts own no block."""
    x, w13, w2, weights, _ = make(40, 16, 2, 32, 24, torch.float32, device, seed=5)
    ids = torch.tensor([[3, 11], [11, 3]], device=device).repeat(20, 1)
    check(x, w13, w2, weights, ids, tolerance(torch.float32, device))


def test_no_tokens(device):
    x, w13, w2, weights, ids = make(0, 4, 2, 16, 16, torch.float32, device)
    for fn in (tk.fused_moe, ref.fused_moe):
        assert fn(x, w13, w2, weights, ids).shape == (0, 16)


def test_new_output_and_strided_inputs(device):
    """Without `out`: a new [T, H] tensor; x a column slice and w13 / w2 transposed views work."""
    x, w13, w2, weights, ids = make(11, 4, 2, 32, 24, torch.float32, device, seed=3)
    wide = torch.cat([x, x], dim=1)[:, 32:]
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    got = tk.fused_moe(wide, w13_t, w2_t, weights, ids)
    assert got.shape == (11, 32) and got.dtype == torch.float32 and got.is_contiguous()
    assert_close(got, ref.fused_moe(x, w13, w2, weights, ids), tolerance(torch.float32, device), "strided")


# ----------------------------------------------------------------------------------------------
# Reference vs transformers' DeepseekV3Experts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("T", "E", "K", "H", "I"), [(1, 4, 2, 64, 32), (17, 8, 2, 64, 32), (33, 16, 6, 48, 40)]
)
def test_reference_matches_transformers(T, E, K, H, I):
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    config = DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, hidden_act="silu"
    )
    config._experts_implementation = "eager"  # the module alone, outside a model's dispatch
    experts = DeepseekV3Experts(config)
    x, w13, w2, weights, ids = make(T, E, K, H, I, torch.float32, "cpu", seed=T)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        expected = experts(x, ids, weights)
    assert_close(ref.fused_moe(x, w13, w2, weights, ids), expected, 1e-6, "reference vs DeepseekV3Experts")


# ----------------------------------------------------------------------------------------------
# moe_align_block_size
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("T", "K", "E", "block_m"),
    [
        (1, 1, 1, 16),
        (1, 6, 16, 16),
        (3, 2, 4, 16),
        (17, 6, 8, 32),
        (64, 2, 16, 64),
        (300, 8, 128, 16),
        (50, 3, 2, 128),
    ],
)
def test_align_invariants(T, K, E, block_m, device):
    _, _, _, _, ids = make(T, E, K, 16, 16, torch.float32, device, seed=T * K, ids_dtype=torch.int32)
    sorted_ids, expert_ids, num_post = tk.moe_align_block_size(ids, E, block_m)
    n = T * K
    max_padded = n + min(E, n) * (block_m - 1)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (-(-max_padded // block_m),)
    assert num_post.shape == (1,)
    sorted_ids, expert_ids, total = sorted_ids.cpu().long(), expert_ids.cpu().long(), int(num_post)
    flat = ids.cpu().reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert total == int(padded.sum()) and total % block_m == 0 and total <= max_padded
    valid = sorted_ids[:total] < n
    assert torch.equal(sorted_ids[:total][valid].sort().values, torch.arange(n)), "each pair exactly once"
    assert bool((sorted_ids[:total][~valid] == n).all()), "padding entries must be T*K"
    assert bool((sorted_ids[total:] == n).all()), "entries past num_tokens_post_padded must be T*K"
    blocks = sorted_ids[:total].view(-1, block_m)
    owners = expert_ids[: total // block_m]
    assert bool((owners[1:] >= owners[:-1]).all()), "blocks in expert order"
    assert torch.equal(torch.bincount(owners, minlength=E) * block_m, padded), (
        "each expert's group, block-aligned"
    )
    for b, e in enumerate(owners.tolist()):
        pairs = blocks[b][blocks[b] < n]
        assert pairs.numel() > 0, f"block {b} holds only padding"
        assert bool((flat[pairs] == e).all()), f"block {b} mixes experts (expert_ids says {e})"
        assert bool((pairs[1:] > pairs[:-1]).all()), f"block {b}: pairs out of order"
    assert bool((expert_ids[total // block_m :] == E).all()), "blocks past the padded total hold E"


def test_config_table():
    assert tk.moe_config(1, 8, 128).block_m == 16  # decode
    assert tk.moe_config(4096, 8, 128).block_m >= 64  # prefill
    limits = [limit for limit, _ in tk.MOE_CONFIGS]
    assert limits[-1] is None and limits[:-1] == sorted(limits[:-1])
    for _, cfg in tk.MOE_CONFIGS:
        assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_k >= 16  # tl.dot's minimum


# ----------------------------------------------------------------------------------------------
# Input checks (both twins)
# ----------------------------------------------------------------------------------------------


BAD_INPUTS = {
    "hidden_3d": (
        lambda a: {**a, "hidden_states": a["hidden_states"][None]},
        r"hidden_states must be 2-D \[T, H\]",
    ),
    "hidden_int": (
        lambda a: {**a, "hidden_states": a["hidden_states"].int()},
        "hidden_states must be float16",
    ),
    "hidden_not_tensor": (lambda a: {**a, "hidden_states": [[1.0]]}, "hidden_states must be a torch.Tensor"),
    "w13_2d": (lambda a: {**a, "w13": a["w13"][0]}, r"w13 must be 3-D \[E, 2 \* I, H\]"),
    "w13_dtype": (lambda a: {**a, "w13": a["w13"].double()}, "w13 dtype torch.float64 differs"),
    "w13_wrong_h": (lambda a: {**a, "w13": a["w13"][:, :, :8]}, r"w13 \[E, 2 \* I, H\] has H = 8"),
    "w13_odd": (
        lambda a: {**a, "w13": a["w13"][:, :-1]},
        r"w13 \[E, 2 \* I, H\] must have an even, positive dim 1",
    ),
    "w2_wrong_i": (lambda a: {**a, "w2": a["w2"][:, :, :4]}, r"w2 must be \[E, H, I\] = \(4, 16, 24\)"),
    "w2_wrong_e": (lambda a: {**a, "w2": a["w2"][:2]}, r"w2 must be \[E, H, I\] = \(4, 16, 24\)"),
    "weights_dtype": (
        lambda a: {**a, "topk_weights": a["topk_weights"].half()},
        "topk_weights must be float32",
    ),
    "weights_shape": (
        lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]},
        r"topk_weights \[T, K\] shape",
    ),
    "ids_float": (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids must be int32 or int64"),
    "ids_1d": (lambda a: {**a, "topk_ids": a["topk_ids"][0]}, r"topk_ids must be 2-D \[T, K\]"),
    "ids_rows": (lambda a: {**a, "topk_ids": a["topk_ids"][:3]}, r"topk_ids \[T, K\] must have T = 5 rows"),
    "ids_device": (lambda a: {**a, "topk_ids": a["topk_ids"].to("meta")}, "topk_ids is on meta"),
    "ids_too_big": (
        lambda a: {**a, "topk_ids": a["topk_ids"] + 4},
        r"topk_ids\[0, 0\] = \d+ is out of range \[0, 4\)",
    ),
    "ids_negative": (
        lambda a: {**a, "topk_ids": a["topk_ids"] - 4},
        r"topk_ids\[\d+, \d+\] = -\d+ is out of range \[0, 4\)",
    ),
    "out_shape": (lambda a: {**a, "out": torch.empty(5, 8)}, r"out must have shape \(5, 16\)"),
    "out_dtype": (
        lambda a: {**a, "out": torch.empty(5, 16, dtype=torch.float16)},
        "out must have dtype torch.float32",
    ),
}


@pytest.mark.parametrize("fn", [tk.fused_moe, ref.fused_moe], ids=["triton", "reference"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, fn):
    x, w13, w2, weights, ids = make(5, 4, 2, 16, 24, torch.float32, "cpu")
    args = {"hidden_states": x, "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids}
    bad, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=r"^fused_moe: " + message):
        fn(**bad(args))


# ----------------------------------------------------------------------------------------------
# GPU only: half precision, no host sync, CUDA graphs
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("T", "E", "K", "H", "I"), [(1, 64, 6, 2048, 1408), (64, 128, 8, 2048, 768), (517, 8, 2, 256, 96)]
)
def test_half_precision(T, E, K, H, I, dtype):
    check(*make(T, E, K, H, I, dtype, "cuda", seed=T), tolerance(dtype, "cuda"))


@pytest.mark.gpu
def test_no_host_sync_and_cuda_graph(monkeypatch):
    """The whole layer runs without a device-to-host sync and replays from a CUDA graph."""
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    x, w13, w2, weights, ids = make(33, 16, 4, 128, 96, torch.bfloat16, "cuda", seed=7)
    out = torch.empty_like(x)
    tk.fused_moe(x, w13, w2, weights, ids, out=out)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tk.fused_moe(x, w13, w2, weights, ids, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.fused_moe(x, w13, w2, weights, ids, out=out)
    new_x, _, _, new_weights, new_ids = make(33, 16, 4, 128, 96, torch.bfloat16, "cuda", seed=8)
    x.copy_(new_x)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    out.fill_(float("nan"))
    graph.replay()
    assert_close(
        out, ref.fused_moe(x, w13, w2, weights, ids), tolerance(torch.bfloat16, "cuda"), "graph replay"
    )


def test_value_checks_only_under_debug_off_cpu(monkeypatch):
    """Off the CPU the id range check (a device-to-host copy) runs only with TILELLM_DEBUG=1.

    Meta tensors stand in for device ones: reading their values raises, so the call passes exactly
    when the value check is skipped.
    """
    args = [t.to("meta") for t in make(2, 4, 2, 16, 16, torch.float32, "cpu")]
    monkeypatch.delenv("TILELLM_DEBUG", raising=False)
    tk.check_fused_moe(*args, None)
    monkeypatch.setenv("TILELLM_DEBUG", "1")
    with pytest.raises(NotImplementedError):
        tk.check_fused_moe(*args, None)
