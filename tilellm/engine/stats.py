"""Counters and snapshots the engine exposes (server metrics, inspector, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Engine state after the last step. Counts of sequences (samples), blocks and tokens.

    The one record of these counts: the engine fills it (`LLMEngine.get_stats`), the server
    publishes it to its metrics, test engines build one; all zero before the first step.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # Speculative decoding (empty per-position list: it is off).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Where the engine's steps went (`StepTimings`, summed since start): steps, and seconds of
    # scheduling, preparing and launching, waiting for the step's result, and postprocessing.
    num_steps: int = 0
    step_schedule_s: float = 0.0
    step_prepare_s: float = 0.0
    step_execute_s: float = 0.0
    step_postprocess_s: float = 0.0
    # The steps' device spans (CUDA events), where the runner times them: TILELLM_TIME_DEVICE=1,
    # or a benchmark's run; else 0.
    step_device_s: float = 0.0
    # Seconds in which the engine had requests to run: filled by the server's engine loop (from
    # a request's admission to the step that finishes the last one; 0 offline).
    busy_s: float = 0.0


@dataclass
class StepSnapshot:
    """What the last step computed, per scheduled sequence (for the inspector).

    query_lens[i] new tokens of request_ids[i] ending at seq_lens[i]; block_tables[i] its blocks
    (the ones covering seq_lens[i]); num_cached_tokens[i] its prefix-cache hit at admission.
    """

    request_ids: list[str]
    query_lens: list[int]
    seq_lens: list[int]
    num_cached_tokens: list[int]
    block_tables: list[list[int]]
    block_size: int
    kind: str = ""  # "prefill" | "decode" | "mixed"
    num_drafts: list[int] = field(default_factory=list)  # of query_lens[i]: draft tokens verified


@dataclass
class StepTimings:
    """Where the engine's step time goes, summed over steps (seconds).

    schedule: the scheduler; prepare: metadata and sampling arrays on the host; execute: the
    runner's call (H2D, launch, wait for the sampled tokens); device: the same span measured by
    CUDA events (only with `time_device`); postprocess: appending tokens, stop checks, outputs.
    """

    num_steps: int = 0
    num_decode_steps: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    execute_s: float = 0.0
    device_s: float = 0.0
    postprocess_s: float = 0.0
    # Per-step records (kind, num_seqs, num_tokens, schedule, prepare, execute, device, post) when on.
    records: list[tuple] = field(default_factory=list)

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.postprocess_s

    def reset(self) -> None:
        self.__init__()
