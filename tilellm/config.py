"""Engine configuration: every engine setting, its default and its help, written once.

`EngineConfig`'s fields are the keywords of `LLM(...)` / `LLMEngine(...)`; their metadata makes
the command line's flags (`tilellm.engine.arg_utils.EngineArgs.add_cli_args`), so a default or a
help text is never restated. Checked once, when built: a bad value raises ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _arg(
    default: Any, help: str, *, cli: bool = True, choices: tuple[str, ...] | None = None, short: str = ""
):
    """A setting: its default, its help, whether the CLI exposes it, its choices."""
    return field(default=default, metadata={"help": help, "cli": cli, "choices": choices, "short": short})


DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("auto", "triton", "reference")


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
    block_size: int = _arg(16, "tokens per KV-cache block")
    max_num_seqs: int = _arg(256, "most sequences running at once")
    max_num_batched_tokens: int = _arg(8192, "token budget of one step")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's)")
    gpu_memory_utilization: float = _arg(0.9, "share of GPU memory the engine may use")
    enable_prefix_caching: bool = _arg(True, "share cached prefix blocks between requests")
    enforce_eager: bool = _arg(False, "disable CUDA graphs")
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

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
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
