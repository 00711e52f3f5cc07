"""One request's life, the same for chat and text completions:

    admission (slots for the whole group, on one replica) → start every choice
    → stream SSE chunks, or collect and answer once → release

all inside one `try/finally` this module owns, so a choice's slot is released and
an unfinished worker sequence aborted whatever ends the request: the last token, an
error, a client that disconnects (its watcher cancels the work), a server shutdown.
The endpoints (chat.py, completions.py) only prepare a `Job`; what their answers look
like is their renderer's business (openai_api).

Everything that can be refused is refused before the first byte is sent: a rejected
stream is a clean HTTP error; a failure after that is an SSE `error` event, then
`[DONE]`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..common import protocol as p
from .admission import Admission
from .emitter import Emitter
from .errors import APIError
from .generation import Generation
from .metrics import Metrics, ModelMetrics
from .openai_api import counts
from .registry import ServedModel
from .workers import WorkerPool

CLIENT_CLOSED = 499      # nginx's status for a request its client abandoned
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]


@dataclass
class Choice:
    """One sequence of a request, ready to start."""

    prompt: list[int]
    sampling: p.Sampling
    max_tokens: int | None             # None: as many as the replica's context leaves
    emitter: Emitter
    grammar: str | None = None
    logprobs: int = -1
    pooling: str = ""                  # an embedding: "mean" or "last" (Generate.pooling)
    prediction: list[int] | None = None   # OpenAI's predicted output, as token ids


@dataclass
class Job:
    """A validated request: its model, its choices (one replica runs them all), how to
    answer. `session` goes with the first choice (the one whose KV stays warm)."""

    model: ServedModel
    choices: list[Choice]
    stream: bool
    renderer: object                   # openai_api.ChatRenderer | CompletionRenderer
    session: str | None = None
    include_usage: bool = False
    headers: dict = field(default_factory=dict)
    error: APIError | None = None      # what ended a stream after its first byte
    salt: str = ""                     # prefix-cache scope (chat.cache_salt)
    gens: list = field(default_factory=list)   # its Generations once built (a cancel's)

    @property
    def need(self) -> int:
        """Positions the longest choice needs (its prompt + max_tokens, or + 1 reply
        token when it sets none): the router sends the job only to a replica whose
        context holds that."""
        return max(len(c.prompt) + (c.max_tokens or 1) for c in self.choices)


class Lifecycle:
    def __init__(self, pool: WorkerPool, admission: Admission, metrics: Metrics | None = None):
        self.pool, self.admission = pool, admission
        self.metrics = metrics or Metrics()
        self.running = 0                      # requests inside run(): queued or generating
        self.generations: set[Generation] = set()
        self.on_end: list = []                # called after each request (the drain)

    def stop_all(self, error: Exception) -> None:
        """End every running generation with `error` (a drain's deadline)."""
        for gen in list(self.generations):
            gen.fail(error)

    async def run(self, request: Request, send, job: Job) -> None:
        """Answer `job` on `send` (ASGI); APIError before the first byte is sent."""
        self.running += 1
        try:
            await self.answer(request, send, job)
        finally:
            self.running -= 1
            for callback in self.on_end:
                callback()

    async def answer(self, request: Request, send, job: Job) -> None:
        model, n = job.model, len(job.choices)
        info = request.scope.setdefault("pantheon", {})     # for the access log
        arrived = info.setdefault("arrived", time.monotonic())
        info["model"] = model.name
        figures = self.metrics.for_model(model.name)
        asked = time.monotonic()
        k = self.admission.share(model, n)       # choices holding slots at once
        try:
            replica = await self.admission.acquire(model, job.session, k, need=job.need)
        except APIError as exc:
            figures.rejected(exc.status, exc.code)
            raise
        figures.queue.observe(time.monotonic() - asked)
        gens: list[Generation] = job.gens
        lanes = None
        try:
            for i, c in enumerate(job.choices):
                gens.append(Generation(self.pool, self.admission, model,
                                       replica if i < k else None, c.prompt, c.sampling,
                                       c.max_tokens or replica.ctx - len(c.prompt), c.emitter,
                                       job.session if i == 0 else None, c.grammar, c.logprobs,
                                       figures, arrived if i == 0 else None,
                                       info.get("request_id", ""), job.salt, c.pooling, c.prediction))
            self.generations.update(gens)
            for gen in gens[:k]:
                await gen.start()
            lanes = Lanes(gens, k, self.admission, model)
            if job.stream:
                await send({"type": "http.response.start", "status": 200,
                            "headers": SSE_HEADERS})
                try:
                    ended = await until_disconnect(request, self.stream(send, job, lanes),
                                                   [gen.stream.stalled for gen in gens[:k]])
                except ClientStalled:
                    await drop(request)
                    return
                if ended is None:      # the client went away: logged as nginx does
                    info["status"] = CLIENT_CLOSED
                await send({"type": "http.response.body", "body": b""})
                return
            results = await until_disconnect(request, lanes.collect())
            response = Response(status_code=CLIENT_CLOSED) if results is None else \
                JSONResponse(job.renderer.whole(gens, results))
            await response(request.scope, request.receive, send)
        except APIError as exc:
            job.error = exc
            raise
        finally:
            if lanes is not None:
                lanes.close()             # no later choice starts once we are past here
            for _ in range(k - min(k, len(gens))):  # slots of choices never built
                self.admission.release(model, replica)
            for gen in gens:
                gen.close()           # releases its slot; aborts the worker's if unfinished
                self.generations.discard(gen)
            report(figures, info, job, gens, arrived)

    async def stream(self, send, job: Job, lanes: "Lanes") -> bool:
        renderer, gens = job.renderer, lanes.gens

        async def out(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            for body in renderer.opening(gens):
                await out(renderer.frame(body))
            async for i, event in lanes.events():
                await out(renderer.frame(renderer.event(i, gens[i], event) if event is not None
                                         else renderer.closing(i, gens[i])))
            if job.include_usage:
                await out(renderer.frame(renderer.usage(gens)))
        except APIError as exc:
            job.error = exc
            await out(renderer.failure(exc))
        await out(renderer.end())
        return True


def report(figures: ModelMetrics, info: dict, job: Job, gens: list[Generation],
           arrived: float) -> None:
    """A request is over: its figures, for /metrics and for the access log."""
    now = time.monotonic()
    figures.e2e.observe(now - arrived)
    prompt, completion, cached, _ = counts(gens) if gens else (0, 0, 0, None)
    info.update(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
    if gens and gens[0].first_at is not None:
        info["ttft_s"] = round(gens[0].first_at - arrived, 4)
    if info.get("log_prompts") and gens:
        info["prompt"] = job.model.tokenizer.decode(gens[0].prompt)
    reasons = [g.finish_reason for g in gens if g.finish_reason]
    if job.error is not None:
        figures.failed(job.error.code)
    elif len(reasons) < len(gens):
        figures.failed("cancelled")              # the client went away
    figures.finished(prompt, cached, reasons)


async def collect(gen: Generation) -> list:
    return [event async for event in gen.events()]


class Lanes:
    """A request's choices, `k` at a time: lane j runs choices j, j + k, j + 2k, ...;
    each after the first of its lane gives its slot back first and then queues for one
    behind every other request (Admission.share), so one request with many choices
    (n, or a completions prompt list) never holds more than k slots of a replica."""

    def __init__(self, gens: list[Generation], k: int, admission: Admission,
                 model: ServedModel):
        self.gens, self.k, self.admission, self.model = gens, k, admission, model
        self.home = gens[0].replica            # where the first choices run
        self.tasks: list[asyncio.Future] = []  # the lanes' pumps, while streaming
        self.closed = False

    def close(self) -> None:
        """The request is over: stop the lanes (a later choice never starts now; the
        request's finally closes every Generation right after)."""
        self.closed = True
        for task in self.tasks:
            task.cancel()

    async def begin(self, i: int) -> Generation:
        """Choice i, started: the first k already are; a later one takes its lane's
        slot back from the choice before it, then queues for a slot of its own."""
        gen = self.gens[i]
        if i >= self.k:
            self.gens[i - self.k].close()
            replica = await self.admission.acquire(self.model, None, 1, admitted=True,
                                                   prefer=self.home,
                                                   need=len(gen.prompt) + gen.max_tokens)
            if self.closed:                     # the request ended while this one queued
                self.admission.release(self.model, replica)
                raise asyncio.CancelledError()
            gen.bind(replica)
            await gen.start()
        return gen

    async def collect(self) -> list[list]:
        """Every choice's events, by choice index."""
        results: list = [None] * len(self.gens)

        async def lane(j: int) -> None:
            for i in range(j, len(self.gens), self.k):
                results[i] = await collect(await self.begin(i))
        await asyncio.gather(*(lane(j) for j in range(self.k)))
        return results

    async def events(self):
        """(choice index, event) from every choice as they come; (i, None) when i ends.
        One choice is read directly; several through a task per lane, cancelled on the
        way out."""
        gens = self.gens
        if len(gens) == 1:
            async for event in gens[0].events():
                yield 0, event
            yield 0, None
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(j):
            i = j
            try:
                for i in range(j, len(gens), self.k):
                    gen = await self.begin(i)
                    async for event in gen.events():
                        queue.put_nowait((i, event))
                    queue.put_nowait((i, None))
            except Exception as exc:
                queue.put_nowait((i, exc))
        tasks = self.tasks = [asyncio.ensure_future(pump(j)) for j in range(self.k)]
        try:
            for _ in range(len(gens)):
                while True:
                    i, item = await queue.get()
                    if isinstance(item, Exception):
                        raise item
                    yield i, item
                    if item is None:
                        break
        finally:
            for task in tasks:
                task.cancel()


class ClientStalled(Exception):
    """The client stopped reading its stream; the pool aborted the request."""


async def until_disconnect(request: Request, work, stalled: list[asyncio.Event] = ()):
    """Run `work`; None if the client disconnects first (the work is cancelled);
    ClientStalled if one of `stalled` is set first."""
    task = asyncio.ensure_future(work)

    async def left():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watchers = [asyncio.ensure_future(left())] + \
        [asyncio.ensure_future(event.wait()) for event in stalled]
    try:
        done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    if any(event.is_set() for event in stalled):
        raise ClientStalled()
    return None


async def drop(request: Request) -> None:
    """Close a stalled client's connection hard: its unsent bytes would otherwise keep
    it open (limits.BoundedHttp puts the transport's abort in the scope)."""
    abort = request.scope.get("extensions", {}).get("pantheon.abort")
    if abort is not None:
        abort()
        await asyncio.sleep(0)        # the transport reports the loss before we return
