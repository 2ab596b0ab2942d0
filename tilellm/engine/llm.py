"""`LLM`: the offline, batched front end, on top of `LLMEngine`.

llm = LLM(model="path/to/model")
outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=16))
outs[0].outputs[0].text
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from tilellm.config import EngineConfig
from tilellm.engine.llm_engine import LLMEngine
from tilellm.engine.metrics import Metric
from tilellm.engine.outputs import RequestOutput
from tilellm.engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict

logger = logging.getLogger(__name__)


_freeze_lock = threading.Lock()
_freeze_depth = 0
_froze = False  # whether the outermost `frozen_heap` froze (and so unfreezes) the heap


@contextlib.contextmanager
def frozen_heap():
    """Everything alive on entry is out of the cyclic collector's sight until exit (`gc.freeze`).

    The heap an engine builds (torch, Triton, the model, CUDA graphs) makes a full collection
    cost 0.2-0.3 s; one lands in the first steps of a large batch, whose requests allocate enough
    to trigger it (E1 on an H200: a 296 ms pause in its second step's scheduling). Frozen, a
    collection during generation scans only what the generation allocated. Exit gives the objects
    back (an engine dropped later is still collected). Nested and concurrent uses unfreeze on the
    last exit; a heap someone else froze before is left as it is."""
    global _freeze_depth, _froze
    with _freeze_lock:
        if _freeze_depth == 0:
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _freeze_depth += 1
    try:
        yield
    finally:
        with _freeze_lock:
            _freeze_depth -= 1
            if _freeze_depth == 0 and _froze:
                gc.unfreeze()


class LLM:
    """Generate completions for batches of prompts (vLLM's `LLM`)."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        """`model`: a local Hugging Face model directory (config.json, *.safetensors, tokenizer);
        None: the embedded model that ships with tilellm (logged).

        `engine_args`: any setting of `tilellm.config.EngineConfig`, with its defaults: `dtype`,
        `block_size`, `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`,
        `gpu_memory_utilization`, `enable_prefix_caching`, `enforce_eager`,
        `tensor_parallel_size`, `seed`, `device`, `attention_backend`, `num_kv_blocks`,
        `load_format`, `skip_tokenizer_init`, `fused_ops_backend`, `speculative_config` (a dict
        of vLLM's keys, e.g. {"method": "ngram", "num_speculative_tokens": 4}).
        """
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(
                f"LLM() got unknown engine argument(s) {unknown}; the settings are {sorted(known)}"
            )
        if model is None:
            from tilellm.assets import default_model_path

            model = str(default_model_path())
            logger.warning("no model given: using the embedded model at %s", model)
        self.llm_engine = LLMEngine(model, **engine_args)
        # Offline batches only need final outputs: overlap host and device work on CUDA.
        self.llm_engine.async_scheduling = bool(getattr(self.llm_engine.runner, "is_cuda", False))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's; see
        `generation_config`), what `generate` uses when given none."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (vLLM's `LLM.get_metrics`): `Gauge` / `Counter` (`name`,
        `value`) and `Vector` (`name`, `values`) objects, e.g. `tilellm:spec_decode_num_drafts`
        and `tilellm:spec_decode_num_accepted_tokens_per_pos` with speculative decoding on."""
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (idempotent; also done at exit and on GC)."""
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing left to report to
            pass

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...});
        outputs come back in the prompts' order. One SamplingParams for all, or one per prompt."""
        prompts = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if isinstance(sampling_params, (dict, str)) or not isinstance(sampling_params, Sequence):
                raise TypeError(
                    "sampling_params must be a SamplingParams or a list of them, got "
                    f"{type(sampling_params).__name__}"
                    + (": pass SamplingParams(**{...})" if isinstance(sampling_params, dict) else "")
                )
            params_list = list(sampling_params)
            bad = next((p for p in params_list if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise TypeError(f"sampling_params must hold SamplingParams, got a {type(bad).__name__}")
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts: "
                    "pass one, or one per prompt"
                )
        engine = self.llm_engine
        ids = [f"llm-{next(self._request_counter)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, params in zip(ids, prompts, params_list):
                engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception:
            for rid in added:
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        gen0 = engine.generation_tokens_total
        last_refresh = 0.0
        try:
            with frozen_heap():
                while engine.has_unfinished_requests():
                    for out in engine.step(emit_partial=False):
                        if out.finished:
                            results[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
                    if bar is not None:
                        now = time.perf_counter()
                        if now - last_refresh > 0.2:
                            rate = (engine.generation_tokens_total - gen0) / max(now - start, 1e-9)
                            bar.set_postfix_str(f"output {rate:,.0f} tok/s", refresh=True)
                            last_refresh = now
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                rate = (engine.generation_tokens_total - gen0) / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"output {rate:,.0f} tok/s")
                bar.close()
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat() needs the tokenizer (skip_tokenizer_init=True)")
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}"
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            _check_conversation(conv)
            text = tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            # The template already holds any BOS: do not let encode() add another.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


# The roles the server's chat API accepts; a template may silently drop any other.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_conversation(conv: Any) -> None:
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"a conversation must be a non-empty list of message dicts, got {conv!r:.80}")
    for i, m in enumerate(conv):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(
                f"message {i} has an unknown role {m['role']!r}: use one of {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(m.get("content", ""), (str, type(None))):
            raise ValueError(f"message {i}: content must be a string, got {type(m['content']).__name__}")


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list:
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a string, a list of token ids, a {'prompt': ...} dict or a list of "
            f"those, got {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return [_one_prompt(p) for p in prompts]


def _one_prompt(p: Prompt):
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return _TokensPrompt(p["prompt_token_ids"], p.get("prompt"))
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return p


class _TokensPrompt(list):
    """Token ids that remember their text (chat prompts), so outputs can show it."""

    def __init__(self, ids: list[int], text: str | None):
        super().__init__(ids)
        self.text = text
