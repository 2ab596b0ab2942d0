"""Engine configuration: every engine setting, its default and its help, written once.

`EngineConfig`'s fields are the keywords of `LLM(...)` / `LLMEngine(...)`; their metadata makes
the command line's flags (`tilellm.engine.arg_utils.EngineArgs.add_cli_args`), so a default or a
help text is never restated. Checked once, when built: a bad value raises ValueError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def _arg(
    default: Any,
    help: str,
    *,
    cli: bool = True,
    choices: tuple[str, ...] | None = None,
    short: str = "",
    json_value: bool = False,
):
    """A setting: its default, its help, whether the CLI exposes it, its choices, and whether its
    flag takes a JSON value."""
    metadata = {"help": help, "cli": cli, "choices": choices, "short": short, "json": json_value}
    return field(default=default, metadata=metadata)


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer drafts up to
    `num_speculative_tokens` tokens per decoding sequence and one target forward verifies them.

    method "ngram": prompt lookup. The last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`, longest first) are searched for in the sequence's earlier tokens (prompt
    and output); the tokens after their most recent occurrence are the draft.
    method "draft_model": `model`, a local Hugging Face directory with the target's vocabulary, run
    on the same device with its own KV cache over the same blocks, drafts autoregressively.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
            # vLLM's defaults: 5 and 5 when neither is given, else the other equals the one given.
            lo, hi = (lo or hi or 5), (hi or lo or 5)
            if lo > hi:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
                )
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model', not 'ngram'")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "speculative_config.model must name the draft model's directory for method 'draft_model'"
            )

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict (vLLM's keys), a JSON string, or one already built;
        None stays None. Unknown keys raise ValueError naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; the keys are {sorted(known)}")
        value = dict(value)
        if "method" not in value and value.get("model"):
            value["method"] = "draft_model"  # as vLLM infers it from a model
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if getattr(self, k) is not None}


DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("auto", "triton", "reference")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATIONS = ("fp8",)
CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only", "none")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that configures an engine (vLLM's names). Invalid values raise ValueError.

    max_model_len None: the model's `max_position_embeddings` (capped by the KV pool's size).
    num_kv_blocks None: on CUDA, sized from free memory after a profiling forward times
    `gpu_memory_utilization`; on CPU, what max_num_seqs requests of max_model_len tokens need.
    tensor_parallel_size N > 1: N processes (this one is rank 0), one GPU each on CUDA (GPUs
    `device`'s index .. + N - 1), gloo on CPU; the model's sizes are checked when it is loaded.
    """

    model: str = _arg("", "Hugging Face model directory (default: the embedded model)", cli=False)
    dtype: str = _arg(
        "auto", "weights and activations (auto: the checkpoint's; float32 on CPU)", choices=DTYPES
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache values: auto (the model's dtype), or fp8 / fp8_e4m3 (e4m3 with per-layer K and V "
        "scales: the checkpoint's, else measured on the first prompt; twice the tokens in the same memory)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = _arg(
        None,
        "weight quantization: fp8 quantizes a 16/32-bit checkpoint at load (128 x 128 blocks, "
        "W8A8); FP8 checkpoints load as FP8 without it",
        choices=QUANTIZATIONS,
    )
    block_size: int = _arg(16, "tokens per KV-cache block")
    max_num_seqs: int = _arg(256, "most sequences running at once")
    max_num_batched_tokens: int = _arg(8192, "token budget of one step")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's)")
    gpu_memory_utilization: float = _arg(0.9, "share of GPU memory the engine may use")
    enable_prefix_caching: bool = _arg(True, "share cached prefix blocks between requests")
    enforce_eager: bool = _arg(False, "disable CUDA graphs")
    cudagraph_mode: str = _arg(
        "full_and_piecewise",
        "CUDA graphs (vLLM's compilation_config.cudagraph_mode): full_and_piecewise (decode steps "
        "in whole-step graphs, prefill and mixed steps in piecewise graphs around eager attention), "
        "full_decode_only (decode steps only), none (every step eager, as enforce_eager)",
        choices=CUDAGRAPH_MODES,
    )
    tensor_parallel_size: int = _arg(1, "GPUs (processes) the model is split over", short="-tp")
    seed: int = _arg(0, "seed of requests that bring none")
    device: str | None = _arg(None, "cuda or cpu (default: cuda when available)")
    attention_backend: str = _arg(
        "auto", "attention kernels (auto: triton on CUDA, reference on CPU)", choices=BACKENDS
    )
    # RMSNorm / SiLU-and-mul / rotary: None follows attention_backend ("reference" = unfused
    # PyTorch, to measure what the fused Triton kernels gain).
    fused_ops_backend: str | None = _arg(None, "fused element-wise ops (default: as attention)", cli=False)
    num_kv_blocks: int | None = _arg(None, "fix the KV pool size (blocks) instead of sizing it")
    load_format: str = _arg("safetensors", "safetensors, or dummy (random weights)", cli=False)
    skip_tokenizer_init: bool = _arg(False, "token-id prompts only", cli=False)
    generation_config: str = _arg(
        "auto",
        "default sampling values: auto (the model's generation_config.json), vllm (none), or a directory",
    )
    stream_interval: int = _arg(
        1,
        "streamed requests get their tokens every N (the first at once, the last at the finish): "
        "fewer, larger updates and SSE events for clients that cannot take one per token",
    )
    speculative_config: SpeculativeConfig | None = _arg(
        None,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        'or \'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}\'',
        json_value=True,
    )

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "stream_interval",
        ):
            positive(name)
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                positive(name)
        if self.dtype not in (
            "auto",
            "float32",
            "float16",
            "bfloat16",
            "fp32",
            "fp16",
            "bf16",
            "half",
            "float",
        ):
            raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}"
            )
        if isinstance(self.cudagraph_mode, str):  # vLLM spells the modes in capitals
            object.__setattr__(self, "cudagraph_mode", self.cudagraph_mode.lower())
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(
                "cudagraph_mode must be 'full_and_piecewise', 'full_decode_only' or 'none', "
                f"got {self.cudagraph_mode!r}"
            )
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.attention_backend not in ("auto", "triton", "reference"):
            raise ValueError(
                f"attention_backend must be 'auto', 'triton' or 'reference', got {self.attention_backend!r}"
            )
        if self.fused_ops_backend not in (None, "auto", "triton", "reference"):
            raise ValueError(
                "fused_ops_backend must be None, 'auto', 'triton' or 'reference', "
                f"got {self.fused_ops_backend!r}"
            )
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.device is not None and str(self.device).split(":")[0] not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda', 'cpu' or None, got {self.device!r}")
