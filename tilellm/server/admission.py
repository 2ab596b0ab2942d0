"""Admission and fair feeding: what one HTTP request may cost, and who goes into the engine next.

The engine's own queue is first come, first served over sequences, so a request of 500 prompts x
n=128 handed to it in one piece would sit in front of every later request until its 64,000
sequences were done. Instead:

  - Admission counts what a request will cost: its sequences (prompts x n) and its tokens
    (prompt + max_tokens per sequence). A request that alone exceeds a limit can never be served:
    400 naming the limit. A request that does not fit beside what is already queued: 429 with
    `Retry-After`.
  - Admitted requests wait here, each in its own queue of engine requests (one per prompt). The
    feeder hands them to the engine round-robin, one engine request per HTTP request per turn,
    and keeps at most `engine_seqs` sequences inside the engine (running + waiting there). So a
    small request that arrives behind a huge one waits for at most one engine request of it.

Everything here runs on the event loop; the engine's updates reach it through `_TicketQueue`,
the queue object the engine delivers to (it counts finished sequences, then forwards to the
HTTP handler's queue).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tilellm.server.async_engine import EngineRequest, RequestUpdate
from tilellm.server.errors import APIError

logger = logging.getLogger("tilellm.server")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait: the queue moves every engine step


@dataclass(frozen=True)
class AdmissionLimits:
    """`max_waiting` / `max_waiting_tokens`: what may be queued (admitted, not yet running) in all;
    `max_request_seqs` / `max_request_tokens`: what one request may ask for; `engine_seqs`: the
    sequences the server keeps inside the engine at most (more wait here, fed round-robin)."""

    max_waiting: int = 1024
    max_waiting_tokens: int = 1 << 23
    max_request_seqs: int = 256
    max_request_tokens: int = 1 << 21
    engine_seqs: int = 512


def request_cost(prompt_lens: list[int], n: int, max_tokens: list[int]) -> tuple[int, int]:
    """(sequences, tokens) of a request: prompts x n sequences, each prompt + its max_tokens tokens
    (`max_tokens[i]`: what prompt i may generate, `SamplingParams.check_request`'s answer)."""
    return len(prompt_lens) * n, sum(p + m for p, m in zip(prompt_lens, max_tokens)) * n


@dataclass(eq=False)  # identity: tickets live in sets
class Ticket:
    """One admitted HTTP request: its engine requests not yet fed, and those in the engine."""

    queue: asyncio.Queue  # the HTTP handler's
    n: int
    seqs: int
    tokens: int
    pending: deque[tuple[int, EngineRequest, int]] = field(default_factory=deque)  # (tag, request, tokens)
    live: dict[int, list] = field(default_factory=dict)  # tag -> [request id, unfinished sequences]
    pending_tokens: int = 0
    closed: bool = False
    deadline: float | None = None  # monotonic time past which it fails with a 504 (request_timeout)


class _TicketQueue:
    """What the engine delivers one fed engine request's updates to (`put_nowait`, on the loop)."""

    def __init__(self, feeder: FairFeeder, ticket: Ticket):
        self._feeder = feeder
        self._ticket = ticket

    def put_nowait(self, update: RequestUpdate) -> None:
        self._feeder._on_update(self._ticket, update)


class FairFeeder:
    """Admits requests against `limits` and feeds `engine` (an `AsyncEngine` or `EngineProcess`)."""

    def __init__(self, engine: Any, limits: AdmissionLimits, request_timeout: float | None = None):
        self.engine = engine
        self.limits = limits
        self.request_timeout = request_timeout or None  # seconds an admitted request may take
        self.stalled: str | None = None  # why new requests are refused while the engine is stalled
        self._turns: deque[Ticket] = deque()  # tickets with engine requests still to feed
        self._tickets: set[Ticket] = set()  # every open ticket
        self.pending_seqs = 0  # admitted, not yet handed to the engine
        self.pending_tokens = 0
        self.engine_seqs = 0  # handed to the engine and not finished there
        self._adds: set[asyncio.Task] = set()

    # ---- admission ----

    def admit(self, requests: list[EngineRequest], queue: asyncio.Queue, max_tokens: list[int]) -> Ticket:
        """Queue `requests` (tags 0..k-1, one `SamplingParams`; request i may generate
        `max_tokens[i]` tokens); APIError 400 / 429 / 503 when not."""
        lim = self.limits
        n = requests[0].params.n
        prompt_lens = [len(r.prompt_token_ids) for r in requests]
        seqs, tokens = request_cost(prompt_lens, n, max_tokens)
        max_seqs = min(lim.max_request_seqs, lim.max_waiting)
        if seqs > max_seqs:
            raise APIError.invalid(
                f"this request asks for {seqs} sequences (prompts x n = {len(requests)} x {n}); the "
                f"limit per request is {max_seqs} (max_request_seqs): send fewer prompts or a smaller n",
                "n" if n > 1 else "prompt",
            )
        max_tok = min(lim.max_request_tokens, lim.max_waiting_tokens)
        if tokens > max_tok:
            raise APIError.invalid(
                f"this request may use {tokens} tokens ((prompt + max_tokens) x n, summed over its "
                f"prompts); the limit per request is {max_tok} (max_request_tokens): send fewer or "
                "shorter prompts, a smaller n or a smaller max_tokens",
                "max_tokens",
            )
        if not self.engine.is_alive:
            raise _unavailable(self.engine)
        if self.stalled is not None:
            raise APIError(503, self.stalled, code="engine_stalled")
        waiting = self.pending_seqs + max(0, self.engine_seqs - int(self.engine.stats.num_running))
        if waiting + seqs > lim.max_waiting or self.pending_tokens + tokens > lim.max_waiting_tokens:
            raise APIError(
                429,
                f"the server is busy ({waiting} sequences queued, limit {lim.max_waiting}; "
                f"{self.pending_tokens} tokens queued, limit {lim.max_waiting_tokens}); retry later",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        costs = [(p + m) * n for p, m in zip(prompt_lens, max_tokens)]  # each engine request's tokens
        pending = deque((tag, req, cost) for tag, (req, cost) in enumerate(zip(requests, costs)))
        ticket = Ticket(queue, n, seqs, tokens, pending)
        if self.request_timeout is not None:
            ticket.deadline = time.monotonic() + self.request_timeout
        ticket.pending_tokens = tokens
        self.pending_seqs += seqs
        self.pending_tokens += tokens
        self._tickets.add(ticket)
        self._turns.append(ticket)
        self._pump()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client is gone (or the handler stopped): drop what waits here, abort what runs."""
        if ticket.closed:
            return
        ids = [rid for rid, _ in ticket.live.values()]
        self._close(ticket)
        self.engine.abort(ids)
        self._pump()

    def fail_all(self, status: int, code: str, message: str) -> int:
        """Every open request gets this error (shutdown past its grace period, a stalled or dead
        engine); their engine requests are aborted. Returns how many HTTP requests were failed."""
        tickets = list(self._tickets)
        self.engine.abort([rid for t in tickets for rid in self._fail(t, status, code, message)])
        return len(tickets)

    def expire(self, now: float) -> int:
        """Requests past their deadline get a 504 `request_timeout`, their engine requests are
        aborted (their KV blocks freed). Returns how many."""
        late = [t for t in self._tickets if t.deadline is not None and t.deadline <= now]
        if not late:
            return 0
        message = (
            f"the request did not finish within {self.request_timeout:g} s (request_timeout) and "
            "was aborted; ask for fewer tokens or retry later"
        )
        self.engine.abort([rid for t in late for rid in self._fail(t, 504, "request_timeout", message)])
        self._pump()
        return len(late)

    def _fail(self, ticket: Ticket, status: int, code: str, message: str) -> list[str]:
        """Close `ticket`, its handler gets the error; returns its engine request ids to abort."""
        tags = [tag for tag, _, _ in ticket.pending] + list(ticket.live)
        ids = [rid for rid, _ in ticket.live.values()]
        self._close(ticket)
        for tag in tags:
            ticket.queue.put_nowait(RequestUpdate(tag, [], True, error=message, status=status, code=code))
        return ids

    @property
    def num_open(self) -> int:
        return len(self._tickets)

    # ---- feeding ----

    def _pump(self) -> None:
        budget = self.limits.engine_seqs
        while self._turns:
            ticket = self._turns[0]
            if ticket.closed or not ticket.pending:
                self._turns.popleft()
                continue
            if self.engine_seqs and self.engine_seqs + ticket.n > budget:
                return
            self._turns.rotate(-1)  # its next engine request waits for everyone else's turn
            tag, req, tokens = ticket.pending.popleft()
            self._feed(ticket, tag, req, tokens)

    def _feed(self, ticket: Ticket, tag: int, req: EngineRequest, tokens: int) -> None:
        ticket.pending_tokens -= tokens
        self.pending_seqs -= ticket.n
        self.pending_tokens -= tokens
        self.engine_seqs += ticket.n
        ticket.live[tag] = [req.request_id, ticket.n]
        task = asyncio.ensure_future(self._add(ticket, tag, req))
        self._adds.add(task)
        task.add_done_callback(self._adds.discard)

    async def _add(self, ticket: Ticket, tag: int, req: EngineRequest) -> None:
        try:
            await self.engine.add_requests([req], _TicketQueue(self, ticket), tags=[tag])
        except asyncio.CancelledError:
            raise
        except ValueError as exc:  # rejected by the engine: the server's checks let it through
            self._on_update(ticket, RequestUpdate(tag, [], True, error=str(exc), status=400, code=None))
        except Exception as exc:
            err = _unavailable(self.engine, exc)
            self._on_update(
                ticket, RequestUpdate(tag, [], True, error=err.message, status=503, code=err.code)
            )

    def _on_update(self, ticket: Ticket, update: RequestUpdate) -> None:
        entry = ticket.live.get(update.tag)
        if entry is not None:
            finished = sum(d.finish_reason is not None for d in update.deltas)
            done = entry[1] if update.finished else min(finished, entry[1])
            entry[1] -= done
            self.engine_seqs -= done
            if update.finished:
                del ticket.live[update.tag]
        if ticket.closed:
            return
        ticket.queue.put_nowait(update)
        if update.error is not None:  # the handler gives up on the whole request: free the rest
            self.cancel(ticket)
        elif not ticket.live and not ticket.pending:
            self._close(ticket)
        self._pump()

    def _close(self, ticket: Ticket) -> None:
        if ticket.closed:
            return
        ticket.closed = True
        self._tickets.discard(ticket)
        n_pending = len(ticket.pending)
        self.pending_seqs -= n_pending * ticket.n
        self.pending_tokens -= ticket.pending_tokens
        ticket.pending_tokens = 0
        ticket.pending.clear()
        for _, left in ticket.live.values():
            self.engine_seqs -= left
        ticket.live.clear()


def _unavailable(engine: Any, exc: BaseException | None = None) -> APIError:
    """503 for an engine that cannot take requests, with a code saying why."""
    if getattr(engine, "stopping", False):
        return APIError(503, "the server is shutting down", code="shutting_down")
    reason = getattr(engine, "error", None) or (str(exc) if exc is not None else None)
    return APIError(503, reason or "the engine is not running", code="engine_dead")
