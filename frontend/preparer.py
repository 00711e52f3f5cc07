"""Request preparation off the event loop: parsing, templating, tokenization.

A few threads of their own (not Starlette's shared pool of 40, which many slow
requests could fill), in two pools: bodies over `LARGE_BYTES` queue in one, the rest in
the other, so a short request never waits behind a burst of long conversations. One
deadline per request across all its steps, queue included: a request still being prepared at the deadline is a 503 naming it, and work
not yet begun is dropped. The event loop meanwhile answers everyone else (/health,
other streams); the tokenizer releases the GIL while it runs.
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from ..common import settings
from .errors import APIError


LARGE_BYTES = 64 << 10      # a body this big is prepared in the pool for large ones


class Preparer:
    def __init__(self, timeout_s: float = settings.PREPARE_TIMEOUT_S,
                 threads: int = min(4, os.cpu_count() or 1)):
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="prepare")
        self.large = ThreadPoolExecutor(max(1, threads), thread_name_prefix="prepare-large")

    def deadline(self) -> float:
        """A new request's deadline, on the loop's clock."""
        return asyncio.get_running_loop().time() + self.timeout_s

    async def run(self, deadline: float, fn, *args, size: int = 0):
        """fn(*args) in a pool (by `size`, the request body's bytes); 503 if it has not
        returned by `deadline`."""
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        if left <= 0:
            raise self.late()
        pool = self.large if size > LARGE_BYTES else self.pool
        try:
            return await asyncio.wait_for(loop.run_in_executor(pool, fn, *args), left)
        except asyncio.TimeoutError:
            raise self.late() from None

    def late(self) -> APIError:
        return APIError(503, f"preparing the request (template, tokenizer) took longer than "
                             f"{self.timeout_s:g} s; send a shorter one or retry later",
                        type="service_unavailable", code="prepare_timeout",
                        headers={"Retry-After": "5"})

    def close(self) -> None:
        for pool in (self.pool, self.large):
            pool.shutdown(wait=False, cancel_futures=True)
