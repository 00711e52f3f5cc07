"""Graceful drain: SIGTERM (or SIGINT) stops taking work, lets what runs finish, then stops.

    signal → draining: /health 503 {"status": "draining"}, new requests and loads 503
             (`shutting_down`, Retry-After), loads in progress cancelled, callbacks run
             (a router registration deregisters)
           → requests in flight and queued run to completion, up to `timeout_s`
           → the rest end with an error (an SSE `error` event, or a 503)
           → uvicorn stops; serve() stops and reaps the workers; the process exits 0

A second signal skips the wait. uvicorn's own signal handling is replaced (it would
close the listener at once and re-raise the signal at the end, so the exit code would
be the signal's, not 0).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Awaitable, Callable

import uvicorn

from .errors import APIError

log = logging.getLogger("pantheon.frontend.drain")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RETRY_AFTER_S = 5


def shutting_down(what: str = "the server is shutting down") -> APIError:
    return APIError(503, f"{what}; retry on another instance or after it restarts",
                    type="service_unavailable", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class Drain:
    """The drain's state and its one task. `busy()` says whether requests still run or
    wait; `stop_rest()` ends them; `on_start` callbacks run when the drain begins."""

    def __init__(self, timeout_s: float, busy: Callable[[], int],
                 stop_rest: Callable[[], None]):
        self.timeout_s, self.busy, self.stop_rest = timeout_s, busy, stop_rest
        self.on_start: list[Callable[[], Awaitable | None]] = []
        self.draining = False
        self.started_at = 0.0
        self.skip = asyncio.Event()           # a second signal: stop waiting
        self.settled = asyncio.Event()        # nothing runs any more
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None

    def signal(self, signum: int) -> None:
        """A stop signal arrived (called on the event loop)."""
        name = signal.Signals(signum).name
        if not self.draining:
            log.warning("%s: draining (%d request(s) running or queued; up to %.0f s)",
                        name, self.busy(), self.timeout_s)
            self.begin()
        elif not self.skip.is_set():
            log.warning("%s again: not waiting for the %d request(s) left", name, self.busy())
            self.skip.set()

    def begin(self) -> None:
        self.draining, self.started_at = True, time.monotonic()
        self.task = asyncio.ensure_future(self.run())

    def changed(self) -> None:
        """A request ended (or left the queue): the drain may be over."""
        if self.draining and not self.busy():
            self.settled.set()

    async def run(self) -> None:
        for callback in self.on_start:
            try:
                result = callback()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("a drain callback failed")
        self.changed()
        waiting = [asyncio.ensure_future(e.wait()) for e in (self.settled, self.skip)]
        try:
            await asyncio.wait(waiting, timeout=self.timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in waiting:
                fut.cancel()
        left = self.busy()
        if left:
            log.warning("drain: ending %d request(s) still running after %.1f s", left,
                        time.monotonic() - self.started_at)
            self.stop_rest()
            try:        # their handlers write the error and return at once
                await asyncio.wait_for(self.settled.wait(), 5.0)
            except asyncio.TimeoutError:
                log.warning("drain: %d request(s) did not end; closing anyway", self.busy())
        else:
            log.info("drain: every request finished in %.1f s",
                     time.monotonic() - self.started_at)
        if self.server is not None:
            self.server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT handed to a Drain instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        drain.server = self

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()

        def handle(signum, frame):
            loop.call_soon_threadsafe(self.drain.signal, signum)
        previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
