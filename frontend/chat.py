"""`POST /v1/chat/completions`: a validated request → a lifecycle Job.

Everything that can be refused is refused here, before a worker sees the request and
before any byte is sent: validation, tools, grammar, the chat template, the context
(capped by dropping the oldest turns when allowed); admission follows in the lifecycle.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time

from starlette.requests import Request

from ..common import limits as wire
from ..common.chat_template import TemplateError
from ..common.grammar import grammar_for_response_format, validate_grammar
from .body import read_body
from .emitter import Emitter
from .errors import APIError
from .lifecycle import Choice, Job, Lifecycle
from .limits import RequestLimits
from .openai_api import (ChatRenderer, ChatRequest, completion_id, context_exceeded,
                         parse_chat_request, render_options, session_header)
from .preparer import Preparer
from .registry import Registry, ServedModel
from .tools import prepare_conversation, tool_call_grammar


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
    if grammar and len(grammar) > wire.MAX_GRAMMAR_CHARS:
        raise APIError(400, f"the output constraint (response_format or a forced tool call) "
                            f"comes to a grammar of {len(grammar)} characters, more than "
                            f"{wire.MAX_GRAMMAR_CHARS}", param="tools" if forced
                       else "response_format", code="limit_exceeded")
    if grammar:
        problem = validate_grammar(grammar)
        if problem:
            raise APIError(400, f"invalid response_format: {problem}", param="response_format")
    return grammar


def cache_salt(headers, salt: str | None) -> str:
    """The request's prefix-cache scope: its API key (the bearer token or x-api-key it
    was admitted with) and its own `cache_salt`, hashed (the key never crosses the wire). Requests of
    different scopes never share a warm state, so `cached_tokens` tells a client nothing
    of another's prompts; "" (no key, no salt) is the one shared scope."""
    key = headers.get("authorization", "").partition(" ")[2].strip() \
        or headers.get("x-api-key", "").strip()          # Anthropic's clients send this
    if not key and not salt:
        return ""
    both = key.encode() + b"\0" + (salt or "").encode()
    return hashlib.blake2b(both, digest_size=16).hexdigest()


def fit_context(model: ServedModel, messages: list[dict], tools, ctx: int,
                cap: bool, render: dict | None = None) -> tuple[list[int], str, bool]:
    """(prompt ids, prompt text, capped). Drops the oldest turns, keeping the system
    prompt and the last user turn, until the prompt leaves room for a reply. `render`:
    render_text's prefill and template args (render_options; never dropped).

    The fewest turns to drop is found by bisection: a prompt only shrinks as more of the
    oldest turns go, so O(log turns) renders, each linear in the conversation (a scan
    dropping one turn at a time was cubic: 2,048 turns took minutes)."""
    def prompt(dropped: int) -> tuple[list[int] | None, str, int]:
        """(ids, text, tokens); ids None, tokens a lower bound, for a text too long to
        fit whatever it tokenizes to (it is not tokenized: seconds per megabyte)."""
        gone = set(droppable[:dropped])
        text = model.render_text([m for i, m in enumerate(messages) if i not in gone], tools,
                                 **(render or {}))
        least = len(text) // model.tokenizer.max_token_chars
        if least >= ctx:
            return None, text, least
        ids = model.tokenizer.encode(text)
        return ids, text, len(ids)

    droppable: list[int] = []
    ids, text, full = prompt(0)
    if ids is not None and full < ctx:
        return ids, text, False
    first_bound = ids is None               # `full` is a bound, not a count
    keep_last = max(i for i, m in enumerate(messages) if m["role"] == "user") \
        if any(m["role"] == "user" for m in messages) else len(messages) - 1
    droppable = [i for i, m in enumerate(messages) if m["role"] != "system" and i != keep_last]
    if cap and droppable:
        fitted = None
        low, high = 1, len(droppable)          # the answer, if any, is in [low, high]
        while low <= high:
            mid = (low + high) // 2
            ids, text, tokens = prompt(mid)
            if ids is not None and tokens < ctx:
                fitted, high = (ids, text), mid - 1
            else:
                low = mid + 1
        if fitted is not None:
            return fitted[0], fitted[1], True
        # none fits: every probe failed, the last of them with every turn dropped
    how = ("even after dropping every earlier turn it is "
           f"{'at least ' if ids is None else ''}{tokens} tokens" if cap and droppable
           else "context capping is off" if not cap else "there is no earlier turn to drop")
    raise context_exceeded(ctx, full, "messages", "reply", "messages", how,
                           at_least=first_bound)


def seeded(sampling, seed: int | None, i: int):
    """Choice i's sampling: a seeded request gives choice i the seed + i."""
    return dataclasses.replace(sampling, seed=None if seed is None else seed + i,
                               logit_bias=dict(sampling.logit_bias))


class ChatService:
    def __init__(self, registry: Registry, lifecycle: Lifecycle, max_body_bytes: int,
                 context_cap: bool = True, limits: RequestLimits = RequestLimits(),
                 preparer: Preparer | None = None):
        self.registry, self.lifecycle = registry, lifecycle
        self.max_body_bytes, self.context_cap = max_body_bytes, context_cap
        self.limits, self.preparer = limits, preparer or Preparer()

    def shape(self, req: ChatRequest, model: ServedModel, ctx: int):
        """The CPU part (a preparer thread): grammar, tools, template, tokens."""
        grammar = request_grammar(req.response_format, req.tools, req.tool_choice)
        messages, tools = prepare_conversation(req.messages, req.tools, req.tool_choice,
                                               model.tokenizer.chat_template)
        try:
            return grammar, *fit_context(model, messages, tools, ctx, self.context_cap,
                                         render_options(req))
        except TemplateError as exc:
            raise APIError(400, f"the chat template refused the conversation: {exc}",
                           param="messages") from exc

    async def prepare(self, request: Request) -> Job:
        body = await read_body(request, self.max_body_bytes)
        deadline = self.preparer.deadline()
        req = await self.preparer.run(deadline, parse_chat_request, body,
                                      session_header(request.headers), self.limits,
                                      size=len(body))
        return await self.job(request, req, deadline, len(body))

    async def job(self, request: Request, req: ChatRequest, deadline: float, size: int,
                  renderer=None) -> Job:
        """The Job for a validated request. Another API's edge (anthropic_api,
        responses_api) translates its body into a ChatRequest and passes its own
        `renderer(model, tokenizer, req, capped)`; chat's is the default."""
        model = await self.registry.want(req.model, req.keep_alive)
        ctx = model.context()
        grammar, prompt, text, capped = await self.preparer.run(
            deadline, self.shape, req, model, ctx, size=size)
        room = ctx - len(prompt)
        prediction = await self.preparer.run(deadline, model.tokenizer.encode, req.prediction,
                                             False, size=len(req.prediction)) \
            if req.prediction else None
        max_tokens = min(req.max_tokens, room) if req.max_tokens else None   # None: fill
        think = text.rstrip().endswith("<think>")           # the template opened reasoning
        use_tools = bool(req.tools) and req.tool_choice != "none"
        choices = [Choice(prompt, seeded(req.sampling, req.sampling.seed, i), max_tokens,
                          Emitter(req.stop, think=think, tools=use_tools,
                                  max_calls=None if req.parallel_tool_calls else 1), grammar,
                          req.top_logprobs if req.logprobs else -1, prediction=prediction)
                   for i in range(req.n)]
        renderer = ChatRenderer(completion_id(), int(time.time()), model.name,
                                model.tokenizer, req, req.n, capped) if renderer is None \
            else renderer(model, req, capped)
        renderer.model = self.registry.shown_name(req.model, model)    # the name asked by
        return Job(model, choices, req.stream, renderer,
                   None if capped else req.session_id,      # a capped turn is not cached
                   req.include_usage, salt=cache_salt(request.headers, req.cache_salt))

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        await self.lifecycle.run(request, send, await self.prepare(request))
