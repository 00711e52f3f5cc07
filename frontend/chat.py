"""`POST /v1/chat/completions`: a validated request → a lifecycle Job.

Everything that can be refused is refused here, before a worker sees the request and
before any byte is sent: validation, tools, grammar, the chat template, the context
(capped by dropping the oldest turns when allowed); admission follows in the lifecycle.
"""
from __future__ import annotations

import dataclasses
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from ..common.chat_template import TemplateError
from ..common.grammar import grammar_for_response_format, validate_grammar
from .emitter import Emitter
from .errors import APIError
from .lifecycle import Choice, Job, Lifecycle
from .limits import RequestLimits
from .openai_api import (ChatRenderer, completion_id, context_exceeded, parse_chat_request,
                         session_header)
from .registry import Registry, ServedModel
from .tools import prepare_conversation, tool_call_grammar


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (before reading it all)."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"request body exceeds the limit of {limit} bytes",
                       code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:      # gone, or cut off by the body deadline (limits.py)
        raise APIError(408, "the request body did not arrive", code="request_timeout") \
            from None
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
    raise context_exceeded(ctx, full, "messages", "reply", "messages", how)


def seeded(sampling, seed: int | None, i: int):
    """Choice i's sampling: a seeded request gives choice i the seed + i."""
    return dataclasses.replace(sampling, seed=None if seed is None else seed + i,
                               logit_bias=dict(sampling.logit_bias))


class ChatService:
    def __init__(self, registry: Registry, lifecycle: Lifecycle, max_body_bytes: int,
                 context_cap: bool = True, limits: RequestLimits = RequestLimits()):
        self.registry, self.lifecycle = registry, lifecycle
        self.max_body_bytes, self.context_cap = max_body_bytes, context_cap
        self.limits = limits

    async def prepare(self, request: Request) -> Job:
        body = await read_body(request, self.max_body_bytes)
        req = parse_chat_request(body, session_header(request.headers), self.limits)
        model = self.registry.resolve(req.model)
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
        max_tokens = min(req.max_tokens, room) if req.max_tokens else None   # None: fill
        think = text.rstrip().endswith("<think>")           # the template opened reasoning
        use_tools = bool(req.tools) and req.tool_choice != "none"
        choices = [Choice(prompt, seeded(req.sampling, req.sampling.seed, i), max_tokens,
                          Emitter(req.stop, think=think, tools=use_tools), grammar,
                          req.top_logprobs if req.logprobs else -1) for i in range(req.n)]
        renderer = ChatRenderer(completion_id(), int(time.time()), model.name,
                                model.tokenizer, req, req.n, capped)
        return Job(model, choices, req.stream, renderer,
                   None if capped else req.session_id,      # a capped turn is not cached
                   req.include_usage)

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        await self.lifecycle.run(request, send, await self.prepare(request))
