"""Build a model from a Hugging Face directory: config.json + safetensors (one file or sharded).

    model, config = load_model("path/to/model", dtype="auto", device="cuda")

The model is built on the meta device (no memory, no init), its parameters are then allocated
on the target device in the target dtype, and each checkpoint tensor is handed to its
parameter's `weight_loader` as a lazy `safetensors` slice, so a tensor-parallel rank reads only
its own rows/columns. Checkpoint q/k/v and gate/up matrices land in the merged `qkv_proj` /
`gate_up_proj` through the model's `packed_modules_mapping`; each MoE expert's
`experts.{e}.{gate,up,down}_proj.weight` lands in its slice of the stacked `experts.w13_weight` /
`experts.w2_weight` (`FusedMoE`).

FP8 checkpoints (`quantization_config.quant_method == "fp8"`) load with no flag, and
`quantization="fp8"` quantizes a bf16 / fp16 / fp32 one as it loads (`tilellm.models.quantization`):
the layers are switched to FP8 on the meta device, their `weight_scale_inv` (or per-tensor
`weight_scale`) tensors follow the weights' names through the same mapping, and once everything
is loaded each module's `process_weights_after_loading(dtype)` finishes the job (online
quantization, per-tensor scales to blocks, MLA's dequantized `kv_b_proj`).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import torch
from torch import nn

from tilellm.models.layers.layernorm import LayerNorm, RMSNorm
from tilellm.models.layers.linear import default_weight_loader, read_all
from tilellm.models.parallel import check_tp, partition_kv_heads
from tilellm.models.quantization import (
    DUMMY_INPUT_SCALE,
    apply_fp8,
    fill_dummy_fp8_,
    quantize_experts_online,
    resolve_quantization,
)
from tilellm.models.registry import get_model_class, supported_architectures

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "half": torch.float16,
    "float": torch.float32,
}

# checkpoint tensors that are not parameters (recomputed by the model)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# one MoE expert's matrix (or its FP8 scales) in a checkpoint -> (its stacked parameter, shard id
# (expert, matrix)); a per-tensor `weight_scale` loads into the block scales' parameter
_EXPERT_TENSOR = re.compile(
    r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv|weight_scale|input_scale)$"
)
# a stacked expert parameter -> the checkpoint tensors' last name part
_EXPERT_PARAM = re.compile(r"\.experts\.(?:w13|w2)_(weight|weight_scale_inv)$")


def _read_json(path: pathlib.Path, what: str) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from e


def read_model_config(model_dir: str | pathlib.Path) -> tuple[dict, Any]:
    """(raw config.json dict, transformers config). Errors name the file or the architecture."""
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    raw = _read_json(path, "config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"malformed config {path}: expected a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ValueError(
            f"{path} has no 'architectures' entry; supported: {', '.join(supported_architectures())}"
        )
    try:
        get_model_class(archs[0])
    except ValueError as e:
        raise ValueError(f"{e} (from {path})") from e

    from transformers import AutoConfig

    return raw, AutoConfig.from_pretrained(str(model_dir))


def resolve_dtype(dtype: str | torch.dtype, raw_config: dict) -> torch.dtype:
    """ "auto" = config.json's torch_dtype (float32 when absent); else float32/float16/bfloat16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    if dtype == "auto":
        name = raw_config.get("torch_dtype") or raw_config.get("dtype") or "float32"
        if name not in _DTYPES:
            raise ValueError(f"config.json's torch_dtype {name!r} is not supported; pass dtype= explicitly")
        return _DTYPES[name]
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto', 'float32', 'float16' or 'bfloat16'")
    return _DTYPES[dtype]


def is_mla(config: Any) -> bool:
    """DeepSeek's multi-head latent attention: one cached latent row per token, not K and V."""
    return bool(getattr(config, "kv_lora_rank", None))


def model_kv_spec(config: Any, tp_size: int = 1) -> tuple[int, int, int]:
    """(num_layers, KV heads per tensor-parallel rank, head_dim) for sizing the KV pool.

    MLA models cache one row of kv_lora_rank + qk_rope_head_dim values per token (one "head",
    the same on every rank) instead of K and V (see `kv_caches_per_layer`).
    """
    if is_mla(config):
        return config.num_hidden_layers, 1, int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, partition_kv_heads(num_kv, 0, tp_size).num_heads, head_dim


def index_head_dim(config: Any) -> int:
    """DeepSeek-V3.2's indexer key width (cached per token beside the latent row), 0 for others."""
    return int(getattr(config, "index_head_dim", 0) or 0) if getattr(config, "index_topk", None) else 0


def kv_caches_per_layer(config: Any) -> int:
    """Cache tensors per attention layer: 2 (K and V), or 1 for MLA's latent rows."""
    return 1 if is_mla(config) else 2


def weight_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint: those named by model.safetensors.index.json, else
    model.safetensors, else every *.safetensors in the directory."""
    model_dir = pathlib.Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path, "safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"malformed safetensors index {index_path}: no 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"safetensors shard {f.name} listed in {index_path} not found: {f}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (use load_format='dummy' for random ones)"
        )
    return files


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate every meta parameter on `device` in `dtype` (tied parameters stay tied; those
    marked `keep_fp32` in float32, those with a `tilellm_dtype` (FP8 weights) in that dtype) and
    move the buffers, which were computed on the CPU, keeping their dtype."""
    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in allocated:
                p_dtype = (
                    torch.float32 if getattr(p, "keep_fp32", False) else getattr(p, "tilellm_dtype", dtype)
                )
                new = nn.Parameter(torch.empty(p.shape, dtype=p_dtype, device=device), requires_grad=False)
                for marker in ("keep_fp32", "tilellm_dtype", "is_input_scale"):
                    if hasattr(p, marker):
                        setattr(new, marker, getattr(p, marker))
                allocated[id(p)] = new
            module._parameters[name] = allocated[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                if b.is_meta:
                    raise RuntimeError(
                        f"buffer {name!r} of {type(module).__name__} was built on the meta device"
                    )
                module._buffers[name] = b.to(device)


def _fill_dummy_weights(model: nn.Module, device: torch.device, seed: int) -> None:
    """Random weights for benchmarks: N(0, 0.02) everywhere except norm weights (1) and
    LayerNorm biases (0); FP8 weights as N(0, 0.02) quantized, with their scales (`fill_dummy_fp8_`),
    and static input scales `DUMMY_INPUT_SCALE`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm | LayerNorm)]
    norm_weights = {id(m.weight) for m in norms}
    norm_biases = {id(m.bias) for m in norms if isinstance(m, LayerNorm)}
    fp8 = [
        (p, module._parameters[f"{name}_scale_inv"])
        for module in model.modules()
        for name, p in module._parameters.items()
        if p is not None and p.dtype == torch.float8_e4m3fn
    ]
    fp8_ids = {id(t) for pair in fp8 for t in pair}
    with torch.no_grad():
        for weight, scale_inv in fp8:
            fill_dummy_fp8_(weight, scale_inv, gen, 0.02)
        for p in model.parameters():
            if id(p) in fp8_ids:
                continue
            if getattr(p, "is_input_scale", False):  # static activation scales
                p.fill_(DUMMY_INPUT_SCALE)
                continue
            if id(p) in norm_weights:
                p.fill_(1.0)
            elif id(p) in norm_biases:
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _packed_target(name: str, mapping: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """Checkpoint tensor name -> (parameter name, shard id): a MoE expert's matrix, or through
    `packed_modules_mapping`."""
    expert = _EXPERT_TENSOR.search(name)
    if expert is not None:
        stacked = "w2" if expert.group(2) == "down_proj" else "w13"
        suffix = "weight_scale_inv" if expert.group(3) == "weight_scale" else expert.group(3)
        return f"{name[: expert.start()]}.experts.{stacked}_{suffix}", (int(expert.group(1)), expert.group(2))
    if name.endswith(".weight_scale"):  # a per-tensor FP8 scale: held as block scales
        name += "_inv"
    for ckpt_part, (packed_part, shard_id) in mapping.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{packed_part}."), shard_id
    return name, None


def _checkpoint_name(param_name: str, shard_id: Any, mapping: dict[str, tuple[str, Any]]) -> str:
    """Inverse of `_packed_target`: the checkpoint tensor a (parameter, shard) is loaded from."""
    stacked = _EXPERT_PARAM.search(param_name)
    if stacked is not None:
        expert, matrix = shard_id
        return f"{param_name[: stacked.start()]}.experts.{expert}.{matrix}.{stacked.group(1)}"
    for ckpt_part, (packed_part, sid) in mapping.items():
        if sid == shard_id and f".{packed_part}." in param_name:
            return param_name.replace(f".{packed_part}.", f".{ckpt_part}.")
    return param_name


def _is_ignored_input_scale(
    model: nn.Module, name: str, mapping: dict[str, tuple[str, Any]], params: dict[str, nn.Parameter]
) -> bool:
    """A static activation scale (`X.input_scale`) of an FP8 layer that quantizes its activations
    dynamically (no `input_scale` parameter: the checkpoint's scheme is "dynamic"): not read."""
    if not name.endswith(".input_scale") or _packed_target(name, mapping)[0] in params:
        return False
    pname, _ = _packed_target(name.removesuffix("input_scale") + "weight", mapping)
    owner_name, _, local = pname.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return False
    return hasattr(owner, f"{local}_scale_inv")


def load_weights(model: nn.Module, files: list[pathlib.Path]) -> None:
    """Load every parameter of `model` from the safetensors `files`; every checkpoint tensor
    must be used and every parameter shard filled, else a ValueError naming tensor and file."""
    from safetensors import safe_open

    mapping = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(model, "tie_word_embeddings", False))
    params = dict(model.named_parameters())  # a tied lm_head.weight is listed once, as the embedding
    expected = set()
    for pname in params:
        owner_name, _, local_name = pname.rpartition(".")
        owner = model.get_submodule(owner_name)
        if hasattr(owner, "param_shard_ids"):  # parameters filled from several tensors each (MoE)
            shard_ids = owner.param_shard_ids(local_name)
        else:
            shard_ids = getattr(owner, "shard_ids", (None,))
        expected.update((pname, sid) for sid in shard_ids)
    loaded: set[tuple[str, Any]] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if ckpt_name.endswith(_IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
                    continue
                if _is_ignored_input_scale(model, ckpt_name, mapping, params):
                    continue
                if _load_kv_cache_scale(model, ckpt_name, f.get_slice(ckpt_name), path):
                    continue
                pname, shard_id = _packed_target(ckpt_name, mapping)
                if pname not in params:
                    model_name = type(model).__name__
                    raise ValueError(
                        f"unexpected tensor {ckpt_name!r} in {path}: {model_name} has no {pname!r}"
                    )
                owner = model.get_submodule(pname.rpartition(".")[0])
                loader = getattr(owner, "weight_loader", default_weight_loader)
                try:
                    loader(params[pname], f.get_slice(ckpt_name), shard_id)
                except ValueError as e:
                    raise ValueError(f"cannot load tensor {ckpt_name!r} from {path}: {e}") from e
                loaded.add((pname, shard_id))
    missing = sorted(_checkpoint_name(p, s, mapping) for p, s in expected - loaded)
    scales_loaded = any(p.endswith("input_scale") for p, _ in loaded)
    if not scales_loaded and any(m.endswith(".input_scale") for m in missing):
        raise ValueError(
            "quantization_config says activation_scheme 'static' but the checkpoint has no input_scale "
            "tensors; set activation_scheme to 'dynamic' in config.json to quantize activations per token"
        )
    if missing:
        where = ", ".join(str(p) for p in files)
        raise ValueError(f"missing weight(s) {', '.join(repr(m) for m in missing)}: not found in {where}")


# An FP8 KV cache's per-layer scales as checkpoints ship them (vLLM's formats): the attention
# module's `k_scale` / `v_scale`, or the older `k_proj.output_scale` / `v_proj.output_scale`.
_KV_CACHE_SCALE = re.compile(r"^(.*?)\.(?:(?:attn\.)?([kv])_scale|([kv])_proj\.output_scale)$")


def _load_kv_cache_scale(model: nn.Module, ckpt_name: str, src: Any, path: pathlib.Path) -> bool:
    """A KV cache scale of `ckpt_name`'s attention layer (kept on the layer as a float, used when
    the cache is FP8); False when the tensor is not one."""
    match = _KV_CACHE_SCALE.match(ckpt_name)
    if match is None:
        return False
    try:
        module = model.get_submodule(f"{match.group(1)}.attn")
    except AttributeError:
        return False
    if not hasattr(module, "checkpoint_kv_scales"):
        return False
    value = read_all(src).float()
    if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value) <= 0:
        raise ValueError(f"KV cache scale {ckpt_name!r} in {path} must be one positive number, got {value}")
    module.checkpoint_kv_scales[match.group(2) or match.group(3)] = float(value)
    return True


def process_weights_after_loading(model: nn.Module, dtype: torch.dtype) -> None:
    """Each module's `process_weights_after_loading(dtype)`, where it has one, once every tensor
    is loaded; a module's children before it (MLA dequantizes a `kv_b_proj` once that layer has
    finished its own quantization)."""
    for module in reversed(list(model.modules())):  # pre-order reversed: children first
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook(dtype)


def load_model(
    model_dir: str | pathlib.Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str | None = None,
    attention_backend: str = "auto",
    fused_ops_backend: str | None = None,
    load_format: str = "safetensors",
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 0,
    quantization: str | None = None,
) -> tuple[nn.Module, Any]:
    """(model in eval mode on `device`, its transformers config) for a HF model directory.

    dtype: "auto" (config.json's torch_dtype, float32 when absent), "float32", "float16", "bfloat16".
    device: None = "cuda" when available, else "cpu".
    load_format: "safetensors", or "dummy" for random weights (only config.json needed).
    fused_ops_backend: RMSNorm / SiLU-and-mul / rotary implementation; None follows attention_backend.
    tp_rank, tp_size: this rank's shard of every tensor-parallel layer.
    quantization: None = as the checkpoint says (FP8 checkpoints load in FP8); "fp8" = also
    quantize a bf16 / fp16 / fp32 checkpoint's linear layers and experts to FP8 as it loads.
    """
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    check_tp(tp_rank, tp_size)
    raw, config = read_model_config(model_dir)
    torch_dtype = resolve_dtype(dtype, raw)
    quant_config, online = resolve_quantization(raw, quantization)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    files = weight_files(model_dir) if load_format == "safetensors" else []
    cls = get_model_class(raw["architectures"][0])
    with torch.device("meta"):
        model = cls(
            config,
            attention_backend=attention_backend,
            fused_ops_backend=fused_ops_backend,
            device=device,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
    if quant_config is not None:
        backend = fused_ops_backend or attention_backend
        apply_fp8(model, quant_config, online=online, backend=backend, device=device)
    _materialize(model, device, torch_dtype)
    if load_format == "dummy":
        _fill_dummy_weights(model, device, seed)
    else:
        load_weights(model, files)
    if quant_config is not None and online:
        quantize_experts_online(model, quant_config)
    process_weights_after_loading(model, torch_dtype)
    return model.eval(), config
