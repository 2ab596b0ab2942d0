"""Engine configuration: the `LLM(...)` / `LLMEngine(...)` keyword arguments, checked once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Everything that configures an engine (SPEC section 3 names). Invalid values raise ValueError.

    max_model_len None: the model's `max_position_embeddings` (capped by the KV pool's size).
    num_kv_blocks None: on CUDA, sized from free memory after a profiling forward times
    `gpu_memory_utilization`; on CPU, a pool of at most 2 GiB.
    tensor_parallel_size N > 1: N processes (this one is rank 0), one GPU each on CUDA (GPUs
    `device`'s index .. + N - 1), gloo on CPU; the model's sizes are checked when it is loaded.
    """

    model: str
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    seed: int = 0
    device: str | None = None
    attention_backend: str = "auto"
    # RMSNorm / SiLU-and-mul / rotary: None follows attention_backend ("reference" = unfused
    # PyTorch, to measure what the fused Triton kernels gain).
    fused_ops_backend: str | None = None
    num_kv_blocks: int | None = None
    load_format: str = "safetensors"
    skip_tokenizer_init: bool = False

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
