"""/v1/completions and /v1/chat/completions: request -> engine requests -> response or SSE stream.

One HTTP request becomes one engine request per prompt (tags 0..k-1, `n` sequences each), all
feeding one queue. Choice `i` of prompt `t` has index `t * n + i` in the response, as in OpenAI.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tilellm.server.admission import FairFeeder, Ticket
from tilellm.server.async_engine import EngineRequest, RequestUpdate, SeqDelta
from tilellm.server.chat_tools import ToolPlan, plan_tools
from tilellm.server.errors import APIError
from tilellm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
    logit_bias_ids,
    structured_outputs_params,
)
from tilellm.server.reasoning import get_reasoning_parser
from tilellm.server.tool_parsers import get_tool_parser

logger = logging.getLogger("tilellm.server")

# Engine SamplingParams names that may appear in its ValueError messages, for the error's `param`.
_PARAM_NAMES = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "stop",
    "logprobs",
    "n",
    "prompt",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)


# Arguments of `apply_chat_template` that chat_template_kwargs may not override.
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "chat_template", "tools", "documents", "return_dict", "return_tensors", "padding", "truncation",
     "max_length"}
)  # fmt: skip


@dataclass
class _Choice:
    """Accumulated output of one choice (non-streaming) or its running state (streaming)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    final_text: str | None = None
    text_offset: int = 0  # completions logprobs: characters before the next token
    reasoning: Any = None  # chat streaming with a reasoning parser: its stream state
    tools: Any = None  # chat streaming with tools: the tool-call stream state
    started: bool = False  # chat streaming: role chunk sent


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else _json(obj)
    return f"data: {data}\n\n"


class _ChunkWriter:
    """The server-sent events of one stream: `head` (id, object, created, model), then the
    choices, then `"usage":null` when the client asked for usage. The fields every chunk repeats
    are serialised once; a choice may come as a dict or already serialised (`plain_choice`).
    The bytes are those of `_sse(head | {"choices": ..., "usage": None})`."""

    def __init__(self, head: dict[str, Any], include_usage: bool):
        self._prefix = "data: " + _json(head)[:-1] + ',"choices":['
        self._suffix = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    def __call__(self, choices: list[dict[str, Any] | str]) -> str:
        return self._prefix + ",".join(c if isinstance(c, str) else _json(c) for c in choices) + self._suffix


def plain_choice(index: int, key: str, text: str, token_ids: list[int] | None = None) -> str:
    """A streamed choice with new text and nothing else (no logprobs, not finished), serialised:
    `{"index":i,"text":...,"logprobs":null,"finish_reason":null[,"token_ids":[...]]}` for
    completions (`key` "text"), `{"index":i,"delta":{"content":...},...}` for chat (`key`
    "delta"). The per-token hot path of a stream: one small string, no dict, no full dump."""
    body = _json(text) if key == "text" else '{"content":' + _json(text) + "}"
    ids = "" if token_ids is None else ',"token_ids":[' + ",".join(map(str, token_ids)) + "]"
    return f'{{"index":{index},"{key}":{body},"logprobs":null,"finish_reason":null{ids}}}'


def _has_text(prompt: Any) -> bool:
    """Whether a completion prompt (text, texts, token ids or lists of them) holds any text."""
    return isinstance(prompt, str) or any(isinstance(p, str) for p in prompt)


def _merge(batch: list[RequestUpdate]) -> dict[tuple[int, int], SeqDelta]:
    """Coalesce queued updates per (tag, index), in order: the client gets one chunk per choice.
    The deltas are read, never changed: one update (the usual case) is handed out as it is."""
    if len(batch) == 1:
        update = batch[0]
        return {(update.tag, d.index): d for d in update.deltas}
    merged: dict[tuple[int, int], SeqDelta] = {}
    for update in batch:
        for d in update.deltas:
            key = (update.tag, d.index)
            m = merged.get(key)
            if m is None:
                merged[key] = SeqDelta(
                    d.index, d.text, list(d.token_ids), list(d.logprobs) if d.logprobs is not None else None
                )
                m = merged[key]
            else:
                m.text += d.text
                m.token_ids.extend(d.token_ids)
                if d.logprobs is not None:
                    m.logprobs = (m.logprobs or []) + list(d.logprobs)
            if d.finish_reason is not None:
                m.finish_reason, m.stop_reason, m.final_text = d.finish_reason, d.stop_reason, d.final_text
    return merged


def _logprob_value(v: Any) -> float:
    return float(getattr(v, "logprob", v))


def split_logprob_entry(entry: Any, sampled: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's logprob and the `k` most likely (token id, logprob), from one engine entry.

    An entry is a mapping token id -> logprob (a float or an object with `.logprob`) holding the
    sampled token and the top candidates, as vLLM's `Logprob` dicts do.
    """
    if isinstance(entry, dict):
        items = [(int(t), _logprob_value(v)) for t, v in entry.items()]
    else:
        items = [(int(t), _logprob_value(v)) for t, v in entry]
    by_id = dict(items)
    sampled_lp = by_id.get(sampled, float("-inf"))
    tops = sorted(items, key=lambda x: -x[1])[:k]
    return sampled_lp, tops


def _finite(x: float) -> float:
    # JSON has no infinities; OpenAI reports -9999.0 for "impossible".
    return x if x > -9999.0 else -9999.0


@dataclass
class PreparedChat:
    """What `OpenAIServing.prepare_chat` makes of a chat request, ready for admission."""

    plan: ToolPlan | None
    prompt: list[int]
    params: Any  # SamplingParams
    max_tokens: list[int]  # what the prompt may generate (max_tokens cut to its room)
    top: int | None  # top logprobs per token, None: no logprobs


class OpenAIServing:
    def __init__(
        self,
        feeder: FairFeeder,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        chat_template: str | None = None,
        default_sampling: dict[str, Any] | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
    ):
        self.feeder = feeder
        # `--tool-call-parser` with `--enable-auto-tool-choice`: tool_choice "auto" is served.
        self.auto_tools = get_tool_parser(tool_call_parser) if tool_call_parser else None
        # `--reasoning-parser`: chat answers carry the model's thinking as `reasoning_content`.
        self.reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.chat_template = chat_template  # `--chat-template`: instead of the tokenizer's
        # The model's generation_config.json values for fields a request leaves unset.
        self.default_sampling = {k: v for k, v in (default_sampling or {}).items() if k != "max_tokens"}
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._token_str_cache: dict[int, str] = {}
        self._grammar: Any = None  # compiles structured outputs to check them (`_check_grammar`)
        # Tokenizing and chat templates run here, off the event loop: a multi-megabyte prompt
        # takes seconds of CPU. Two workers: enough to overlap, few enough to bound their memory.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tilellm-tokenize")
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer) if tokenizer else 0

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _check_chars(self, num_chars: int, param: str) -> None:
        """400 before tokenizing a text that cannot fit: every token covers at most
        `longest_token_chars` characters, so more than max_model_len x that is too many tokens."""
        if num_chars > self.max_prompt_chars:
            raise APIError.invalid(
                f"{param}: {num_chars} characters cannot fit in this model's maximum context length of "
                f"{self.max_model_len} tokens (at most {self.max_prompt_chars} characters); shorten it",
                param,
            )

    # ---- shared steps ----

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _token_str(self, tid: int) -> str:
        s = self._token_str_cache.get(tid)
        if s is None:
            # Without a tokenizer (--skip-tokenizer-init) a token is named by its id, as vLLM's
            # `return_tokens_as_token_ids` does.
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            self._token_str_cache[tid] = s
        return s

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids or max(ids) < self.vocab_size:  # (negative ids fail the request schema)
            return
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError.invalid(
                f"{param}: token id {bad} is out of range (vocabulary size {self.vocab_size})", param
            )

    def _need_tokenizer(self, param: str, what: str) -> None:
        if self.tokenizer is None:
            raise APIError.invalid(
                f"{param}: {what} needs a tokenizer, and this server runs without one "
                "(--skip-tokenizer-init); send token ids",
                param,
            )

    @staticmethod
    def _check_text(text: str, param: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON allows "\ud800"; a tokenizer does not
            raise APIError.invalid(
                f"{param}: contains a lone UTF-16 surrogate (invalid Unicode)", param
            ) from None

    async def _check_grammar_off_loop(self, params: Any, req: Any, param: str | None = None) -> None:
        """`_check_grammar` in the tokenizer pool, for requests with a structured output (the
        others need no check, and a thread hop costs every request in a burst time on the loop)."""
        if params.structured_outputs is not None:
            await self._off_loop(self._check_grammar, params, req, param)

    def _check_grammar(self, params: Any, req: Any, param: str | None = None) -> None:
        """400 for a structured output the grammar backend cannot compile (compiled here, off the
        event loop, before admission; the engine compiles it again, from its cache when it is in
        this process)."""
        so = params.structured_outputs
        if so is None:
            return
        self._need_tokenizer("structured_outputs", "structured outputs")
        from tilellm.engine.structured_output import GrammarBackend, GrammarError

        if self._grammar is None:
            eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
            self._grammar = GrammarBackend(self.tokenizer, self.vocab_size, eos)
        try:
            self._grammar.compile(so)
        except GrammarError as e:
            if param is None:
                param = "structured_outputs" if req.structured_outputs is not None else "response_format"
            raise APIError.invalid(str(e).replace("structured_outputs", param, 1), param) from None

    def _check_request(self, params: Any, prompts: list[list[int]], renames: dict[str, str]) -> list[int]:
        """The engine's own rule (`SamplingParams.check_request`, the offline API's too) for every
        prompt, as a 400; returns what each prompt may generate (max_tokens cut to its room)."""
        try:
            return [params.check_request(len(ids), self.max_model_len, self.vocab_size) for ids in prompts]
        except ValueError as exc:
            raise _engine_value_error(exc, renames) from None

    def _sampling_params(
        self,
        req: Any,
        max_tokens: int,
        logprobs: int | None,
        renames: dict[str, str],
        prompt_logprobs: int | None = None,
        structured_outputs: Any = None,
    ) -> Any:
        """The engine's SamplingParams for `req`; `structured_outputs` (a tool choice's constraint)
        replaces the request's own, which must then be unset."""
        from tilellm.engine.sampling_params import RequestOutputKind, SamplingParams

        defaults = self.default_sampling
        kwargs: dict[str, Any] = dict(
            # Not streamed: one update per engine request, when it finishes (as vLLM's server):
            # no per-step update to build, pipe, route and wake the handler for.
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            n=req.n,
            temperature=defaults.get("temperature", 1.0) if req.temperature is None else req.temperature,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens,
        )
        optional = dict(
            top_p=defaults.get("top_p") if req.top_p is None else req.top_p,
            top_k=defaults.get("top_k") if req.top_k is None else req.top_k,
            min_p=defaults.get("min_p") if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=[req.stop] if isinstance(req.stop, str) else req.stop,
            stop_token_ids=req.stop_token_ids,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=(
                defaults.get("repetition_penalty")
                if req.repetition_penalty is None
                else req.repetition_penalty
            ),
            logit_bias=logit_bias_ids(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs or structured_outputs_params(req),
        )
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        if optional["stop"]:
            self._need_tokenizer("stop", "a stop string")
        if optional["bad_words"]:
            self._need_tokenizer("bad_words", "bad_words")
        for text in optional["stop"] or []:
            self._check_text(text, "stop")
        try:
            params = SamplingParams(**kwargs)
            if params.bad_words:  # tokenized here too: a word the engine would refuse is a 400
                params.update_from_tokenizer(self.tokenizer)
            return params
        except (ValueError, TypeError) as exc:
            raise _engine_value_error(exc, renames) from None

    def _submit(
        self, base_id: str, prompts: list[list[int]], params: Any, max_tokens: list[int]
    ) -> tuple[asyncio.Queue, Ticket]:
        """Admit the request (400 / 429 / 503 when not); the feeder hands its prompts to the engine."""
        queue: asyncio.Queue = asyncio.Queue()
        reqs = [EngineRequest(f"{base_id}-{t}", ids, params) for t, ids in enumerate(prompts)]
        return queue, self.feeder.admit(reqs, queue, max_tokens)

    async def _collect(
        self,
        queue: asyncio.Queue,
        num_prompts: int,
        ticket: Ticket,
        raw: Request,
        prompt_logprobs: dict[int, list] | None = None,
    ) -> tuple[dict[tuple[int, int], _Choice], list[int]]:
        """Wait for every engine request to finish; abort them all if the client goes away.
        `prompt_logprobs` (when given) receives each prompt's logprobs by tag."""
        choices: dict[tuple[int, int], _Choice] = {}
        cached = [0] * num_prompts

        async def consume() -> None:
            async for batch in _updates(queue, num_prompts):
                for u in batch:
                    cached[u.tag] = u.num_cached_tokens
                    if prompt_logprobs is not None and u.prompt_logprobs is not None:
                        prompt_logprobs[u.tag] = u.prompt_logprobs
                for key, d in _merge(batch).items():
                    c = choices.setdefault(key, _Choice())
                    c.text.append(d.text)
                    c.token_ids.extend(d.token_ids)
                    c.logprobs.extend(d.logprobs or [])
                    if d.finish_reason is not None:
                        c.finish_reason, c.stop_reason, c.final_text = (
                            d.finish_reason,
                            d.stop_reason,
                            d.final_text,
                        )

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        gone = False
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():  # client gone (or we were cancelled): free its KV blocks now
                gone = True
                consumer.cancel()  # (takes effect at its next await: not `cancelled()` yet)
                self.feeder.cancel(ticket)
        if gone:
            raise APIError(499, "client disconnected")
        consumer.result()  # re-raise an engine error
        return choices, cached

    @staticmethod
    def _usage(prompts: list[list[int]], choices: dict[Any, _Choice]) -> dict[str, int]:
        p = sum(len(ids) for ids in prompts)
        c = sum(len(ch.token_ids) for ch in choices.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _usage_chunk(
        self,
        base_id: str,
        object_name: str,
        created: int,
        prompts: list[list[int]],
        choices: dict[Any, _Choice],
    ) -> str:
        """The final streamed event of `stream_options.include_usage`: no choices, the token counts."""
        body = {"id": base_id, "object": object_name, "created": created, "model": self.model_name}
        body.update(choices=[], usage=self._usage(prompts, choices))
        return _sse(body)

    # ---- /v1/completions ----

    def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError.invalid("prompt: must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                self._need_tokenizer("prompt", "a text prompt")
                self._check_chars(len(p), "prompt")
                self._check_text(p, "prompt")
            ids = _encode(self.tokenizer, p) if isinstance(p, str) else list(p)
            self._check_token_ids(ids, "prompt")
            out.append(ids)
        return out

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        check_unsupported(req)
        if req.echo:
            self._need_tokenizer("echo", "echo")
        # Text is tokenized off the event loop; token ids are only checked, here (a thread hop
        # costs more than the check, and every request in a burst waits behind the loop).
        if _has_text(req.prompt):
            prompts = await self._off_loop(self._completion_prompts, req)
        else:
            prompts = self._completion_prompts(req)
        # echo with logprobs scores the prompt's tokens too (lm-eval's loglikelihood requests).
        want_prompt = req.logprobs if req.echo and req.logprobs is not None else None
        if req.prompt_logprobs is not None:
            want_prompt = max(want_prompt or 0, req.prompt_logprobs)
        params = self._sampling_params(req, req.max_tokens, req.logprobs, {}, want_prompt)
        await self._check_grammar_off_loop(params, req)
        max_tokens = self._check_request(params, prompts, {})
        base_id = f"cmpl-{uuid.uuid4().hex}"
        queue, ticket = self._submit(base_id, prompts, params, max_tokens)
        created = int(time.time())
        echo = [""] * len(prompts)
        if req.echo:
            echo = await self._off_loop(lambda: [self.tokenizer.decode(ids) for ids in prompts])
        if req.stream:
            gen = self._completion_stream(req, base_id, created, prompts, echo, queue, ticket)
            return _sse_response(self._guarded_stream(gen, base_id, ticket))
        prompt_lps: dict[int, list] = {}
        choices, _ = await self._collect(queue, len(prompts), ticket, raw, prompt_lps)
        out = []
        for (tag, idx), c in sorted(choices.items()):
            text = c.final_text if c.final_text is not None else "".join(c.text)
            lp = None
            if req.logprobs is not None:
                echoed = None
                if req.echo:
                    echoed = self._prompt_logprobs_part(prompts[tag], prompt_lps.get(tag), req.logprobs, c)
                lp = self._completion_logprobs(c.logprobs, c.token_ids, req.logprobs, c)
                if echoed is not None:
                    lp = {key: echoed[key] + lp[key] for key in lp}
            out.append(
                {
                    "index": tag * req.n + idx,
                    "text": echo[tag] + text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
            if self._return_token_ids(req):
                out[-1].update(prompt_token_ids=prompts[tag], token_ids=c.token_ids)
            if req.prompt_logprobs is not None:
                out[-1]["prompt_logprobs"] = self._vllm_prompt_logprobs(
                    prompt_lps.get(tag), req.prompt_logprobs
                )
        body = {
            "id": base_id,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": out,
            "usage": self._usage(prompts, choices),
        }
        return JSONResponse(body)

    def _return_token_ids(self, req: CompletionRequest) -> bool:
        """Choices carry `token_ids` when asked (vLLM's `return_token_ids`) or when there is no text."""
        return req.return_token_ids or self.tokenizer is None

    def _prompt_logprobs_part(
        self, prompt_ids: list[int], entries: list | None, k: int, c: _Choice
    ) -> dict[str, Any]:
        """The echoed prompt's part of a completion's `logprobs` (OpenAI's legacy shape: the first
        token has no logprob, `null`), advancing the choice's text offset past the prompt."""
        tokens, token_lps, tops, offsets = [], [], [], []
        entries = entries or [None] * len(prompt_ids)
        for i, (tid, entry) in enumerate(zip(prompt_ids, entries)):
            s = self._token_str(tid)
            tokens.append(s)
            offsets.append(c.text_offset)
            c.text_offset += len(s)
            if i == 0 or entry is None:
                token_lps.append(None)
                tops.append(None)
                continue
            lp, top = split_logprob_entry(entry, tid, k)
            token_lps.append(_finite(lp))
            tops.append({self._token_str(t): _finite(v) for t, v in top} if k > 0 else None)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _vllm_prompt_logprobs(self, entries: list | None, k: int) -> list[Any] | None:
        """vLLM's `prompt_logprobs` of a choice: None for the first token, then {token id (string):
        {"logprob", "rank", "decoded_token"}} holding the prompt's token and the top k."""
        if entries is None:
            return None
        out: list[Any] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            out.append(
                {
                    str(t): {
                        "logprob": _finite(v.logprob),
                        "rank": v.rank,
                        "decoded_token": self._token_str(t),
                    }
                    for t, v in entry.items()
                }
            )
        return out

    def _completion_logprobs(
        self, entries: list[Any], token_ids: list[int], k: int, c: _Choice
    ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for entry, tid in zip(entries, token_ids):
            lp, top = split_logprob_entry(entry, tid, k)
            s = self._token_str(tid)
            tokens.append(s)
            token_lps.append(_finite(lp))
            tops.append({self._token_str(t): _finite(v) for t, v in top} if k > 0 else None)
            offsets.append(c.text_offset)
            c.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _guarded_stream(
        self, events: AsyncIterator[str], base_id: str, ticket: Ticket, done: bool = True
    ) -> AsyncIterator[str]:
        """`events`, then `[DONE]` (unless `done` is false: the Responses API's streams end with
        their last event). The engine's error and any unexpected error become an error event; a
        stream that does not run to its end (the client went away, or an unexpected error)
        aborts its engine requests, which frees their KV blocks at once."""
        finished = False
        end = [_sse("[DONE]")] if done else []
        try:
            async for event in events:
                yield event
            for event in end:
                yield event
            finished = True
        except APIError as exc:  # the engine failed these requests (they are gone from it already)
            yield _sse(exc.body())
            for event in end:
                yield event
            finished = True
        except Exception:
            logger.exception("internal error while streaming %s", base_id)
            yield _sse(
                APIError(500, "internal server error; see the server log", code="internal_error").body()
            )
            for event in end:
                yield event
        finally:
            if not finished:
                self.feeder.cancel(ticket)
            await events.aclose()

    async def _completion_stream(
        self,
        req: CompletionRequest,
        base_id: str,
        created: int,
        prompts: list[list[int]],
        echo: list[str],
        queue: asyncio.Queue,
        ticket: Ticket,
    ) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return_ids = self._return_token_ids(req)
        state: dict[tuple[int, int], _Choice] = {}

        chunk = _ChunkWriter(
            {"id": base_id, "object": "text_completion", "created": created, "model": self.model_name},
            include_usage,
        )

        # echo: the prompt's text first; with logprobs it waits for the prompt's logprobs, which
        # come with the request's first update.
        echo_scored = req.echo and req.logprobs is not None
        if req.echo and not echo_scored:
            for tag, text in enumerate(echo):
                for idx in range(req.n):
                    state[(tag, idx)] = _Choice(text_offset=len(text))
                    yield chunk(
                        [
                            {
                                "index": tag * req.n + idx,
                                "text": text,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
        async for batch in _updates(queue, len(prompts)):
            if echo_scored:
                for u in batch:
                    if u.prompt_logprobs is None or (u.tag, 0) in state:
                        continue
                    first = []
                    for idx in range(req.n):
                        c = state[(u.tag, idx)] = _Choice()
                        lp = self._prompt_logprobs_part(prompts[u.tag], u.prompt_logprobs, req.logprobs, c)
                        first.append(
                            {
                                "index": u.tag * req.n + idx,
                                "text": echo[u.tag],
                                "logprobs": lp,
                                "finish_reason": None,
                            }
                        )
                    yield chunk(first)
            out = []
            for (tag, idx), d in _merge(batch).items():
                c = state.setdefault((tag, idx), _Choice())
                c.token_ids.extend(d.token_ids)
                lp = None
                if req.logprobs is not None and d.logprobs is not None:
                    lp = self._completion_logprobs(d.logprobs, d.token_ids, req.logprobs, c)
                if lp is None and d.finish_reason is None:
                    out.append(
                        plain_choice(tag * req.n + idx, "text", d.text, d.token_ids if return_ids else None)
                    )
                    continue
                out.append(
                    {
                        "index": tag * req.n + idx,
                        "text": d.text,
                        "logprobs": lp,
                        "finish_reason": d.finish_reason,
                    }
                )
                if return_ids:
                    out[-1]["token_ids"] = d.token_ids
                if d.finish_reason is not None:
                    out[-1]["stop_reason"] = d.stop_reason
            if out:
                yield chunk(out)
        else:
            if include_usage:
                yield self._usage_chunk(base_id, "text_completion", created, prompts, state)

    # ---- /v1/chat/completions ----

    def _chat_prompt(
        self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids: the messages through the chat template, with `tools` (OpenAI's
        tool dicts) given to it when not None."""
        messages = []
        for i, m in enumerate(req.messages):
            if m.content is None or isinstance(m.content, str):
                content = m.content or ""
            else:
                parts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        param = f"messages[{i}].content[{j}]"
                        raise APIError.invalid(f"{param}: only text content parts are supported", param)
                    parts.append(part.text)
                content = "".join(parts)
            self._check_text(content, f"messages[{i}].content")
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.tool_calls:
                message["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        self._need_tokenizer("messages", "a chat request")
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        template = getattr(req, "chat_template", None) or self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError.invalid(
                "this model has no chat template; use /v1/completions, or start the server with "
                "--chat-template",
                "messages",
            )
        kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
        reserved = sorted(set(kwargs) & _TEMPLATE_ARGUMENTS)
        if reserved:
            raise APIError.invalid(
                f"chat_template_kwargs may not set {', '.join(reserved)}: they are request fields or the "
                "template's own inputs",
                "chat_template_kwargs",
            )
        continue_final = getattr(req, "continue_final_message", False)
        if continue_final and req.add_generation_prompt:
            raise APIError.invalid(
                "continue_final_message needs add_generation_prompt false (the last message is continued)",
                "continue_final_message",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=continue_final,
                chat_template=template,
                tools=tools,
                **kwargs,
            )
        except Exception as exc:  # the template's own checks (e.g. role order) raise jinja errors
            raise APIError.invalid(f"messages: the chat template rejected them: {exc}", "messages") from None
        return _encode(self.tokenizer, text, add_special_tokens=False)

    def plan_tools(self, req: ChatCompletionRequest) -> ToolPlan | None:
        """The request's tool plan (None: no tool may be called); a 400 naming the field."""
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.auto_tools)
        constrained = req.structured_outputs is not None or (
            req.response_format is not None and req.response_format.type != "text"
        )
        if plan is not None and plan.structured_outputs is not None and constrained:
            raise APIError.invalid(
                'tool_choice "required" or a named function constrains the output itself; leave '
                "response_format and structured_outputs unset",
                "tool_choice",
            )
        return plan

    def chat_message(
        self, text: str, finish_reason: str | None, plan: ToolPlan | None
    ) -> tuple[dict, str | None]:
        """A whole answer as the chat API's assistant message (reasoning split off, tool calls
        parsed), and its finish_reason (`tool_calls` when the model stopped after calling)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message["reasoning_content"], text = self.reasoning.split(text)
            message["content"] = text
        if plan is not None:
            message["content"], calls = plan.extract(text)
            message["tool_calls"] = [call.to_openai() for call in calls or ()]
            if calls and finish_reason == "stop" and plan.choice != "named":  # (OpenAI's: named is stop)
                finish_reason = "tool_calls"
        return message, finish_reason

    async def prepare_chat(
        self, req: ChatCompletionRequest, renames: dict[str, str], format_param: str | None = None
    ) -> PreparedChat:
        """A chat request's steps before admission (shared with /v1/responses): its tool plan,
        prompt, SamplingParams and the tokens it may generate; a 400 naming the field (`renames`
        maps engine names to the endpoint's; `format_param` names its output-format field)."""
        check_unsupported(req)
        plan = self.plan_tools(req)
        prompt = await self._off_loop(self._chat_prompt, req, plan.template_tools if plan else None)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        forced = plan.structured_outputs if plan is not None else None
        params = self._sampling_params(req, requested, top, renames, structured_outputs=forced)
        await self._check_grammar_off_loop(params, req, "tools" if forced is not None else format_param)
        max_tokens = self._check_request(params, [prompt], renames)
        return PreparedChat(plan, prompt, params, max_tokens, top)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        mt_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        renames = {"max_tokens": mt_param, "logprobs": "top_logprobs", "prompt": "messages"}
        prep = await self.prepare_chat(req, renames)
        plan, prompt, params, max_tokens, top = prep.plan, prep.prompt, prep.params, prep.max_tokens, prep.top
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        queue, ticket = self._submit(base_id, [prompt], params, max_tokens)
        created = int(time.time())
        if req.stream:
            gen = self._chat_stream(req, base_id, created, prompt, queue, ticket, plan)
            return _sse_response(self._guarded_stream(gen, base_id, ticket))
        choices, _ = await self._collect(queue, 1, ticket, raw)
        out = []
        for (_, idx), c in sorted(choices.items()):
            text = c.final_text if c.final_text is not None else "".join(c.text)
            lp = self._chat_logprobs(c.logprobs, c.token_ids, top) if top is not None else None
            message, finish_reason = self.chat_message(text, c.finish_reason, plan)
            out.append(
                {
                    "index": idx,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": base_id,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": out,
            "usage": self._usage([prompt], choices),
        }
        return JSONResponse(body)

    def parse_delta(
        self, c: _Choice, text: str, finished: bool, plan: ToolPlan | None
    ) -> tuple[str, str, list[dict[str, Any]]]:
        """A streamed piece of the answer as (reasoning, content, tool-call deltas), through the
        choice's reasoning and tool-call stream states; `finished`: the answer's last piece."""
        reasoning, content = "", text
        if self.reasoning is not None:
            if c.reasoning is None:
                c.reasoning = self.reasoning.stream()
            reasoning, content = c.reasoning.feed(text)
            if finished:
                r, t = c.reasoning.flush()
                reasoning, content = reasoning + r, content + t
        calls: list[dict[str, Any]] = []
        if plan is not None:
            if c.tools is None:
                c.tools = plan.stream()
            content, calls = c.tools.feed(content)
            if finished:
                t, more = c.tools.flush()
                content, calls = content + t, calls + more
        return reasoning, content, calls

    def _parsed_choice(
        self, c: _Choice, idx: int, d: Any, lp: Any, plan: ToolPlan | None
    ) -> dict[str, Any] | None:
        """A streamed chat choice with the delta split into reasoning_content, content and tool_calls."""
        finished = d.finish_reason is not None
        reasoning, content, calls = self.parse_delta(c, d.text, finished, plan)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or (plan is None and not reasoning and not finished):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        finish_reason = d.finish_reason
        if finish_reason == "stop" and c.tools is not None and c.tools.num_calls and plan.choice != "named":
            finish_reason = "tool_calls"
        if not delta and lp is None and not finished:  # all held back (a tag or a value in pieces)
            return None
        out: dict[str, Any] = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        if finished:
            out["stop_reason"] = d.stop_reason
        return out

    def _chat_logprobs(self, entries: list[Any], token_ids: list[int], k: int) -> dict[str, Any]:
        content = []
        for entry, tid in zip(entries, token_ids):
            lp, top = split_logprob_entry(entry, tid, k)
            s = self._token_str(tid)
            content.append(
                {
                    "token": s,
                    "logprob": _finite(lp),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": self._token_str(t),
                            "logprob": _finite(v),
                            "bytes": list(self._token_str(t).encode()),
                        }
                        for t, v in top
                    ],
                }
            )
        return {"content": content}

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        base_id: str,
        created: int,
        prompt: list[int],
        queue: asyncio.Queue,
        ticket: Ticket,
        plan: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        top = (req.top_logprobs or 0) if req.logprobs else None
        state: dict[tuple[int, int], _Choice] = {}

        chunk = _ChunkWriter(
            {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name},
            include_usage,
        )

        first = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(req.n)
        ]
        yield chunk(first)
        async for batch in _updates(queue, 1):
            out = []
            for (tag, idx), d in _merge(batch).items():
                c = state.setdefault((tag, idx), _Choice())
                c.token_ids.extend(d.token_ids)
                lp = None
                if top is not None and d.logprobs is not None:
                    lp = self._chat_logprobs(d.logprobs, d.token_ids, top)
                if self.reasoning is not None or plan is not None:
                    parsed = self._parsed_choice(c, idx, d, lp, plan)
                    if parsed is not None:
                        out.append(parsed)
                    continue
                if lp is None and d.finish_reason is None:
                    out.append(plain_choice(idx, "delta", d.text))
                    continue
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                out.append({"index": idx, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason})
                if d.finish_reason is not None:
                    out[-1]["stop_reason"] = d.stop_reason
            if out:
                yield chunk(out)
        else:
            if include_usage:
                yield self._usage_chunk(base_id, "chat.completion.chunk", created, [prompt], state)


def _template_tool_call(call: Any) -> dict[str, Any]:
    """An assistant message's call as chat templates read it: arguments as a mapping when they are
    a JSON object (Qwen's and Hermes' templates dump them with `tojson`), else the text as sent."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.id is not None:
        out["id"] = call.id
    return out


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` can stand for: its longest vocabulary entry
    (byte-level BPE spells each byte as one character, so an entry is never shorter than the text
    it decodes to) or its longest decoded token, whichever is longer; added tokens included."""
    vocab = tokenizer.get_vocab()
    longest = max((len(t) for t in vocab), default=1)
    decoded = max((len(tokenizer.decode([i])) for i in vocab.values()), default=1)
    return max(longest, decoded, 1)


_TRIM_AFTER_CHARS = 1 << 20


def _encode(tokenizer: Any, text: str, **kw: Any) -> list[int]:
    """`tokenizer.encode`, then (after a large text) the C heap's free pages back to the system:
    the tokenizer's buffers for a megabyte prompt are hundreds of megabytes that glibc keeps."""
    ids = tokenizer.encode(text, **kw)
    if len(text) >= _TRIM_AFTER_CHARS:
        _malloc_trim()
    return ids


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


async def _updates(queue: asyncio.Queue, num_requests: int) -> AsyncIterator[list[RequestUpdate]]:
    """Batches of whatever is queued, until all `num_requests` engine requests finished.
    An update carrying the engine's error raises it as a 500 `APIError` (code engine_error)."""
    remaining = num_requests
    while remaining:
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        err = next((u for u in batch if u.error is not None), None)
        if err is not None:
            raise APIError(err.status, err.error, code=err.code)
        remaining -= sum(u.finished for u in batch)
        yield batch


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(gen, media_type="text/event-stream", headers=headers)


def _engine_value_error(exc: Exception, renames: dict[str, str]) -> APIError:
    """The engine's ValueError as a 400; `param` is the known field its message names first."""
    message = str(exc) or type(exc).__name__
    found = [
        (m.start(), name) for name in _PARAM_NAMES if (m := re.search(rf"\b{re.escape(name)}\b", message))
    ]
    param = renames.get(min(found)[1], min(found)[1]) if found else None
    return APIError.invalid(message, param)
