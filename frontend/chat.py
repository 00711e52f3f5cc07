"""`POST /v1/chat/completions`: from a validated request to SSE chunks or JSON.

Everything that can be refused is refused before a worker sees the request
and before any SSE header is sent, so a rejected stream is a clean HTTP
error. Once running, a request is a `Generation`: token ids from the worker
→ incremental detokenizer → emitter (stop strings) → text pieces.
"""
from __future__ import annotations

import asyncio
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..common import protocol as p
from ..common.chat_template import TemplateError
from .admission import Admission
from .emitter import Emitter
from .openai_api import (APIError, ChatRequest, chat_chunk, chat_response, completion_id,
                         parse_chat_request, sse, sse_error, to_sampling, usage_chunk)
from .registry import Registry, Replica, ServedModel
from .workers import WorkerLost, WorkerPool


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (before reading it all)."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"request body exceeds the limit of {limit} bytes",
                       code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class Generation:
    """One request running on one replica, as text pieces."""

    def __init__(self, pool: WorkerPool, admission: Admission, model: ServedModel,
                 replica: Replica, prompt: list[int], req: ChatRequest, max_tokens: int):
        self.pool, self.admission, self.model, self.replica = pool, admission, model, replica
        self.prompt, self.req, self.max_tokens = prompt, req, max_tokens
        self.request_id = pool.new_request_id()
        self.detok = model.tokenizer.detokenizer()
        self.emitter = Emitter(req.stop)
        self.completion_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.stream = None

    async def start(self) -> None:
        msg = p.Generate(self.request_id, self.replica.model_id, self.prompt,
                         p.Sampling(**to_sampling(self.req)), self.max_tokens,
                         sorted(self.model.tokenizer.eot_ids), self.req.session_id)
        try:
            self.stream = await self.pool.generate(self.replica.worker, msg)
        except WorkerLost as exc:
            self.close()
            raise worker_lost(exc) from exc

    async def pieces(self):
        """Text to send, piece by piece; sets finish_reason at the end."""
        eot = self.model.tokenizer.eot_ids
        while self.finish_reason is None:
            try:
                msg = await self.stream.next()
            except WorkerLost as exc:
                raise worker_lost(exc) from exc
            if isinstance(msg, p.Error):
                status = 400 if msg.code == "bad_request" else 500
                raise APIError(status, msg.message, type="server_error" if status == 500
                               else "invalid_request_error", code=msg.code)
            self.cached_tokens = msg.cached_tokens
            for token in msg.tokens:
                self.completion_tokens += 1
                if token in eot:
                    continue
                text = self.emitter.push(self.detok.push(token))
                if text:
                    yield text
                if self.emitter.stopped:      # free the worker's slot at once
                    self.finish_reason = "stop"
                    self.pool.abort_soon(self.request_id)
                    return
            if msg.finish == "abort":
                raise APIError(503, "the model was unloaded while this request ran",
                               type="service_unavailable", code="model_unloaded")
            if msg.finish:
                tail = self.emitter.push(self.detok.flush())
                tail += self.emitter.finish()
                if tail:
                    yield tail
                self.finish_reason = "stop" if self.emitter.stopped else msg.finish

    def close(self) -> None:
        """Idempotent: abort the worker's side if unfinished, release the replica."""
        if self.replica is None:
            return
        self.admission.release(self.model, self.replica)
        self.replica = None
        if self.finish_reason is None:
            self.pool.abort_soon(self.request_id)
        else:
            self.pool.release(self.request_id)


def worker_lost(exc: Exception) -> APIError:
    return APIError(503, str(exc), type="service_unavailable", code="worker_lost")


class ChatService:
    def __init__(self, registry: Registry, pool: WorkerPool, admission: Admission,
                 max_body_bytes: int):
        self.registry, self.pool, self.admission = registry, pool, admission
        self.max_body_bytes = max_body_bytes

    async def prepare(self, request: Request) -> tuple[ChatRequest, Generation]:
        body = await read_body(request, self.max_body_bytes)
        req = parse_chat_request(body, request.headers.get("x-session-id"))
        model = self.registry.resolve(req.model)
        try:
            prompt = await run_in_threadpool(model.render, req.messages, req.tools)
        except TemplateError as exc:
            raise APIError(400, f"the chat template refused the conversation: {exc}",
                           param="messages") from exc
        ctx = model.context()
        if len(prompt) >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens, "
                           f"but the messages came to {len(prompt)} tokens (plus at least 1 "
                           "for the reply). Shorten the conversation.", param="messages",
                           code="context_length_exceeded")
        room = ctx - len(prompt)
        max_tokens = min(req.max_tokens or room, room)
        replica = await self.admission.acquire(model, req.session_id)
        return req, Generation(self.pool, self.admission, model, replica, prompt, req,
                               max_tokens)

    async def handle(self, request: Request) -> Response:
        req, gen = await self.prepare(request)
        await gen.start()
        rid, created = completion_id(), int(time.time())
        if req.stream:
            return StreamingResponse(self.sse(gen, rid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text = await until_disconnect(request, collect(gen))
        finally:
            gen.close()
        if text is None:                       # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(chat_response(rid, created, gen.model.name, text, gen.finish_reason,
                                          len(gen.prompt), gen.completion_tokens,
                                          gen.cached_tokens))

    async def sse(self, gen: Generation, rid: str, created: int):
        name = gen.model.name
        try:
            yield sse(chat_chunk(rid, created, name, {"role": "assistant", "content": ""}))
            async for piece in gen.pieces():
                yield sse(chat_chunk(rid, created, name, {"content": piece}))
            yield sse(chat_chunk(rid, created, name, {}, gen.finish_reason))
            if gen.req.include_usage:
                yield sse(usage_chunk(rid, created, name, len(gen.prompt), gen.completion_tokens,
                                      gen.cached_tokens))
        except APIError as exc:
            yield sse_error(exc)
        finally:
            gen.close()                        # also on disconnect: aborts the worker's slot
        yield sse("[DONE]")


async def collect(gen: Generation) -> str:
    return "".join([piece async for piece in gen.pieces()])


async def until_disconnect(request: Request, work):
    """Run `work`; None if the client disconnects first (the work is cancelled)."""
    task = asyncio.ensure_future(work)

    async def left():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(left())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    return None
