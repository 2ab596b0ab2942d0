"""The engine watchdog: a stalled engine turns /health red and fails the requests waiting on it,
a dead one stops the server, and requests past `request_timeout` are aborted.

Every message from the engine loop counts as a heartbeat (`EngineClient.last_heard`): while the
engine has work it steps and reports after every step, so silence for `stall_timeout` seconds
while sequences are inside the engine means it is stuck (a stopped process, a hung device call).
An idle engine says nothing and is not suspected: the silence is measured from the later of its
last message and the last moment it had no work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from tilellm.server.admission import FairFeeder

logger = logging.getLogger("tilellm.server")


class EngineWatchdog:
    """Checks `engine` (an `EngineClient`) and `feeder` every `tick` seconds on the event loop.

    `stall_timeout` (seconds, 0 or None: off): silence with work pending that marks the engine
    stalled; it is cleared by the engine's next message. `on_dead()` is called once when the
    engine is gone without the server stopping it (the launcher exits non-zero).
    """

    def __init__(
        self,
        engine: Any,
        feeder: FairFeeder,
        stall_timeout: float | None,
        on_dead: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.feeder = feeder
        self.stall_timeout = stall_timeout or None
        self.on_dead = on_dead
        self.stalled_since: float | None = None  # monotonic time the stall was declared
        self.dead = False
        self._quiet_since = time.monotonic()  # the last check that found no work in the engine
        limits = [t / 4 for t in (self.stall_timeout, feeder.request_timeout) if t]
        self.tick = min([1.0, *limits])

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def stall_message(self) -> str:
        return (
            f"the engine has made no progress for over {self.stall_timeout:g} s (engine_stall_timeout) "
            "with requests in flight; retry later"
        )

    async def run(self) -> None:
        while not self.dead:
            await asyncio.sleep(self.tick)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        self.feeder.expire(now)
        if not self.engine.is_alive:
            if not self.engine.stopping and not self.dead:
                self._died()
            return
        heard = self.engine.last_heard
        if self.stalled_since is not None:
            if heard > self.stalled_since:
                logger.warning(
                    "the engine is making progress again after %.1f s: serving", now - self.stalled_since
                )
                self.stalled_since = None
                self.feeder.stalled = None
            return
        if self.feeder.engine_seqs == 0:
            self._quiet_since = now
        elif self.stall_timeout and now - max(heard, self._quiet_since) > self.stall_timeout:
            self.stalled_since = now
            self.feeder.stalled = self.stall_message()
            n = self.feeder.fail_all(503, "engine_stalled", self.feeder.stalled)
            logger.error(
                "the engine has sent nothing for %.1f s with work pending: /health is 503 and %d "
                "requests were failed (engine_stalled) until it makes progress again",
                now - max(heard, self._quiet_since),
                n,
            )

    def _died(self) -> None:
        self.dead = True
        reason = self.engine.error or "the engine is not running"
        n = self.feeder.fail_all(503, "engine_dead", reason)
        action = "stopping the server (exit status 1)" if self.on_dead is not None else "answering 503"
        logger.error("%s; %d requests waiting in the server failed (engine_dead); %s", reason, n, action)
        if self.on_dead is not None:
            self.on_dead()
