"""What the engine hands back per request (vLLM's `RequestOutput` / `CompletionOutput` shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token at one step; `rank` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. `text` is the whole text so far (not a delta).

    finish_reason: None while running, "stop" (EOS, a stop token or a stop string) or "length"
    (max_tokens or max_model_len); "abort" after `abort_request`.
    stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    logprobs: per generated token, {token_id: Logprob} holding the sampled token and the top-k.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """State of one request after a step; `outputs` has one entry per sample (`n`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob}
    # (the prompt's token and the top k). With delta outputs only the first output carries it.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
