"""`POST /v1/completions`: the legacy text-completion API → a lifecycle Job.

A prompt is raw text (tokenized as the model's tokenizer does, BOS included
when the model wants one) or a list of token ids; there is no chat template,
no reasoning and no tool channel, only stop strings. `n` and a list of
prompts become parallel sequences: choice index = prompt index * n + j.
"""
from __future__ import annotations

import time

from starlette.requests import Request

from .body import read_body
from .chat import cache_salt, request_grammar, seeded
from .emitter import Emitter
from .errors import APIError
from .lifecycle import Choice, Job, Lifecycle
from .limits import RequestLimits
from .openai_api import (CompletionRenderer, completion_id, context_exceeded,
                         parse_completion_request, session_header)
from .preparer import Preparer
from .registry import Registry, ServedModel


def tokenize(model: ServedModel, prompts: list, ctx: int) -> list[list[int]]:
    """Every prompt's ids, checked (a preparer thread: one hop for the whole list)."""
    out, vocab = [], model.config.vocab_size
    for prompt in prompts:
        least = len(prompt) // model.tokenizer.max_token_chars if isinstance(prompt, str) else 0
        if least >= ctx:                  # cannot fit: not worth the tokenizer's seconds
            raise context_exceeded(ctx, least, "prompt", "completion", "prompt",
                                   "counted by its length alone", at_least=True)
        ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if any(t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be below the vocabulary size {vocab}",
                           param="prompt")
        if len(ids) >= ctx:
            raise context_exceeded(ctx, len(ids), "prompt", "completion", "prompt")
        out.append(ids)
    return out


class CompletionService:
    def __init__(self, registry: Registry, lifecycle: Lifecycle, max_body_bytes: int,
                 limits: RequestLimits = RequestLimits(), preparer: Preparer | None = None):
        self.registry, self.lifecycle = registry, lifecycle
        self.max_body_bytes, self.limits = max_body_bytes, limits
        self.preparer = preparer or Preparer()

    async def prepare(self, request: Request) -> Job:
        body = await read_body(request, self.max_body_bytes)
        deadline = self.preparer.deadline()
        req = await self.preparer.run(deadline, parse_completion_request, body,
                                      session_header(request.headers), self.limits,
                                      size=len(body))
        model = await self.registry.want(req.model, req.keep_alive)
        grammar = await self.preparer.run(deadline, request_grammar, req.response_format,
                                          None, None, size=len(body))
        ctx = model.context()
        prompts = await self.preparer.run(deadline, tokenize, model, req.prompts, ctx,
                                          size=len(body))
        prediction = await self.preparer.run(deadline, model.tokenizer.encode, req.prediction,
                                             False, size=len(req.prediction)) \
            if req.prediction else None
        choices, echoes = [], []
        for k in range(len(prompts) * req.n):
            ids, source = prompts[k // req.n], req.prompts[k // req.n]
            choices.append(Choice(ids, seeded(req.sampling, req.sampling.seed, k),
                                  min(req.max_tokens, ctx - len(ids)),
                                  Emitter(req.stop, tools=False, reasoning=False), grammar,
                                  req.logprobs if req.logprobs is not None else -1,
                                  prediction=prediction))
            echoes.append((source if isinstance(source, str) else model.tokenizer.decode(ids))
                          if req.echo else "")
        renderer = CompletionRenderer(completion_id("cmpl"), int(time.time()),
                                      self.registry.shown_name(req.model, model),
                                      model.tokenizer, req, len(choices), echoes)
        return Job(model, choices, req.stream, renderer, req.session_id, req.include_usage,
                   salt=cache_salt(request.headers, req.cache_salt))

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        await self.lifecycle.run(request, send, await self.prepare(request))
