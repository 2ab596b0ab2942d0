"""tilellm: an LLM inference engine with paged, tiled, online-softmax attention in Triton.

Public API (vLLM-compatible where vLLM has the same concept)::

    from tilellm import LLM, SamplingParams
    llm = LLM(model="path/to/hf_model_dir")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover
    from tilellm.engine.llm import LLM
    from tilellm.engine.outputs import CompletionOutput, RequestOutput
    from tilellm.engine.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "tilellm.engine.llm",
    "SamplingParams": "tilellm.engine.sampling_params",
    "StructuredOutputsParams": "tilellm.engine.sampling_params",
    "RequestOutput": "tilellm.engine.outputs",
    "CompletionOutput": "tilellm.engine.outputs",
}


def __getattr__(name: str):
    # Lazy so that `import tilellm` (e.g. for the CLI's --help) does not import torch/triton.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tilellm' has no attribute {name!r}")
