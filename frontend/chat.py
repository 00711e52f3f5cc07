"""`POST /v1/chat/completions`: from a validated request to SSE chunks or JSON.

Everything that can be refused is refused before a worker sees the request
and before any SSE header is sent, so a rejected stream is a clean HTTP
error: validation, tools, grammar, the chat template, the context (capped by
dropping the oldest turns when allowed), admission.
"""
from __future__ import annotations

import asyncio
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..common.chat_template import TemplateError
from ..common.grammar import grammar_for_response_format, validate_grammar
from .admission import Admission
from .emitter import Emitter, joined
from .generation import Generation, acquire_all, start_all
from .openai_api import (APIError, ChatRequest, chat_choice, chat_chunk, chat_response,
                         completion_id, parse_chat_request, sse, sse_error, to_sampling, usage,
                         usage_chunk)
from .registry import Registry, ServedModel
from .tools import check_tools, parse_tool_calls, prepare_conversation, tool_call_grammar
from .workers import WorkerPool


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


def request_grammar(response_format, tools, tool_choice) -> str | None:
    """The grammar the reply must follow, if any; 400 for a bad or clashing one."""
    forced = tool_call_grammar(tools, tool_choice) if tools else None
    try:
        wanted = grammar_for_response_format(response_format) if response_format else None
    except ValueError as exc:
        raise APIError(400, f"invalid response_format: {exc}", param="response_format") from None
    if forced and wanted:
        raise APIError(400, "response_format cannot be combined with a forced tool_choice",
                       param="response_format")
    grammar = forced or wanted
    if grammar:
        problem = validate_grammar(grammar)
        if problem:
            raise APIError(400, f"invalid response_format: {problem}", param="response_format")
    return grammar


def fit_context(model: ServedModel, messages: list[dict], tools, ctx: int,
                cap: bool) -> tuple[list[int], str, bool]:
    """(prompt ids, prompt text, capped). Drops the oldest turns, keeping the system
    prompt and the last user turn, until the prompt leaves room for a reply."""
    text = model.render_text(messages, tools)
    ids = model.tokenizer.encode(text)
    if len(ids) < ctx:
        return ids, text, False
    full = len(ids)
    keep_last = max(i for i, m in enumerate(messages) if m["role"] == "user") \
        if any(m["role"] == "user" for m in messages) else len(messages) - 1
    droppable = [i for i, m in enumerate(messages) if m["role"] != "system" and i != keep_last]
    if cap:
        for n in range(1, len(droppable) + 1):
            kept = [m for i, m in enumerate(messages) if i not in set(droppable[:n])]
            text = model.render_text(kept, tools)
            ids = model.tokenizer.encode(text)
            if len(ids) < ctx:
                return ids, text, True
    how = ("even after dropping every earlier turn it is "
           f"{len(ids)} tokens" if cap and droppable else "context capping is off" if not cap
           else "there is no earlier turn to drop")
    raise APIError(400, f"This model's maximum context length is {ctx} tokens, but the "
                   f"messages came to {full} tokens (plus at least 1 for the reply); {how}. "
                   "Shorten the conversation.", param="messages",
                   code="context_length_exceeded")


def logprob_entry(tok, token_id: int, logprob: float) -> dict:
    text = tok.token_str(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok, items) -> dict:
    return {"content": [logprob_entry(tok, it.token, it.logprob) | {
        "top_logprobs": [logprob_entry(tok, t, lp) for t, lp in it.top]} for it in items]}


class ChatService:
    def __init__(self, registry: Registry, pool: WorkerPool, admission: Admission,
                 max_body_bytes: int, context_cap: bool = True):
        self.registry, self.pool, self.admission = registry, pool, admission
        self.max_body_bytes, self.context_cap = max_body_bytes, context_cap

    async def prepare(self, request: Request):
        body = await read_body(request, self.max_body_bytes)
        req = parse_chat_request(body, request.headers.get("x-session-id"))
        model = self.registry.resolve(req.model)
        check_tools(req.tools, req.tool_choice)
        grammar = request_grammar(req.response_format, req.tools, req.tool_choice)
        messages, tools = prepare_conversation(req.messages, req.tools, req.tool_choice,
                                               model.tokenizer.chat_template)
        ctx = model.context()
        try:
            prompt, text, capped = await run_in_threadpool(
                fit_context, model, messages, tools, ctx, self.context_cap)
        except TemplateError as exc:
            raise APIError(400, f"the chat template refused the conversation: {exc}",
                           param="messages") from exc
        room = ctx - len(prompt)
        max_tokens = min(req.max_tokens or room, room)
        session = None if capped else req.session_id       # a capped turn is not cached
        replicas = await acquire_all(self.admission, model, req.n, session)
        think = text.rstrip().endswith("<think>")           # the template opened reasoning
        use_tools = bool(req.tools) and req.tool_choice != "none"
        gens = []
        for i, replica in enumerate(replicas):
            sampling = to_sampling(req)
            if req.seed is not None:
                sampling["seed"] = req.seed + i
            gens.append(Generation(self.pool, self.admission, model, replica, prompt, sampling,
                                   max_tokens, Emitter(req.stop, think=think, tools=use_tools),
                                   session if i == 0 else None, grammar,
                                   req.top_logprobs if req.logprobs else -1))
        return req, model, gens, capped

    async def handle(self, request: Request) -> Response:
        req, model, gens, capped = await self.prepare(request)
        await start_all(gens)
        rid, created = completion_id(), int(time.time())
        if req.stream:
            return StreamingResponse(self.sse(req, model, gens, rid, created, capped),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            results = await until_disconnect(request, asyncio.gather(
                *(collect(g) for g in gens)))
        finally:
            for gen in gens:
                gen.close()
        if results is None:                     # the client left; nobody reads this
            return Response(status_code=499)
        choices = [self.choice(i, req, model, gen, events)
                   for i, (gen, events) in enumerate(zip(gens, results))]
        body = chat_response(rid, created, model.name, choices, totals(gens))
        if capped:
            body["context_capped"] = True
        return JSONResponse(body)

    def choice(self, index: int, req: ChatRequest, model: ServedModel, gen: Generation,
               events) -> dict:
        parts = joined(events)
        content, calls = parts["content"], []
        for block in parts["tools"]:
            parsed = parse_tool_calls([block], req.tools)
            if parsed:
                calls += parsed
            else:                                # malformed: the raw text, as content
                content += f"<tool_call>{block}</tool_call>"
        finish = "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
        return chat_choice(index, content if content or not calls else None, finish,
                           parts["reasoning"], calls,
                           chat_logprobs(model.tokenizer, gen.logprobs) if req.logprobs else None)

    async def sse(self, req: ChatRequest, model: ServedModel, gens: list[Generation], rid: str,
                  created: int, capped: bool):
        def chunk(index, delta, finish=None, logprobs=None):
            body = chat_chunk(rid, created, model.name, delta, finish, index, logprobs)
            if capped:
                body["context_capped"] = True
            return sse(body)

        sent_lp = [0] * len(gens)
        calls = [0] * len(gens)

        def new_logprobs(i):
            if not req.logprobs:
                return None
            items, sent_lp[i] = gens[i].logprobs[sent_lp[i]:], len(gens[i].logprobs)
            return chat_logprobs(model.tokenizer, items)
        try:
            for i in range(len(gens)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, event in merged(gens):
                if event is None:                  # choice i ended
                    finish = "tool_calls" if calls[i] and gens[i].finish_reason == "stop" \
                        else gens[i].finish_reason
                    yield chunk(i, {}, finish, new_logprobs(i))
                elif event.kind == "reasoning":
                    yield chunk(i, {"reasoning_content": event.text, "reasoning": event.text},
                                logprobs=new_logprobs(i))
                elif event.kind == "tool" and (parsed := parse_tool_calls([event.text],
                                                                          req.tools)):
                    deltas = []
                    for call in parsed:
                        deltas.append({"index": calls[i], **call})
                        calls[i] += 1
                    yield chunk(i, {"tool_calls": deltas}, logprobs=new_logprobs(i))
                else:
                    text = event.text if event.kind == "content" else \
                        f"<tool_call>{event.text}</tool_call>"
                    yield chunk(i, {"content": text}, logprobs=new_logprobs(i))
            if req.include_usage:
                yield sse(usage_chunk(rid, created, model.name, *counts(gens)))
        except APIError as exc:
            yield sse_error(exc)
        finally:
            for gen in gens:
                gen.close()                    # also on disconnect: aborts the worker's slots
        yield sse("[DONE]")


def counts(gens: list[Generation]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a request's choices together."""
    return len(gens[0].prompt), sum(g.completion_tokens for g in gens), gens[0].cached_tokens


def totals(gens: list[Generation]) -> dict:
    return usage(*counts(gens))


async def collect(gen: Generation) -> list:
    return [event async for event in gen.events()]


async def merged(gens: list[Generation]):
    """(choice index, event) from every generation as they come; (i, None) when i ends."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for event in gen.events():
                await queue.put((i, event))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
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
