"""`POST /v1/completions`: the legacy text-completion API, on the same machinery.

A prompt is raw text (tokenized as the model's tokenizer does, BOS included
when the model wants one) or a list of token ids; there is no chat template,
no reasoning and no tool channel, only stop strings. `n` and a list of
prompts become parallel sequences: choice index = prompt index * n + j.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .admission import Admission
from .chat import read_body, request_grammar, until_disconnect, collect, merged, totals
from .emitter import Emitter, joined
from .generation import Generation, acquire_all, start_all
from .openai_api import APIError, CompletionRequest, parse_completion_request, sse, sse_error
from .openai_api import to_sampling
from .registry import Registry, ServedModel
from .workers import WorkerPool


def legacy_logprobs(tok, items, offset: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets = [], []
    for it in items:
        offsets.append(offset)
        text = tok.token_str(it.token)
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [it.logprob for it in items],
            "top_logprobs": [{tok.token_str(t): lp for t, lp in it.top} for it in items],
            "text_offset": offsets}


class CompletionService:
    def __init__(self, registry: Registry, pool: WorkerPool, admission: Admission,
                 max_body_bytes: int):
        self.registry, self.pool, self.admission = registry, pool, admission
        self.max_body_bytes = max_body_bytes

    def tokenize(self, model: ServedModel, prompt, ctx: int) -> list[int]:
        ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = model.config.vocab_size
        if any(t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be below the vocabulary size {vocab}",
                           param="prompt")
        if len(ids) >= ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens, but "
                           f"the prompt came to {len(ids)} tokens (plus at least 1 for the "
                           "completion).", param="prompt", code="context_length_exceeded")
        return ids

    async def handle(self, request: Request) -> Response:
        body = await read_body(request, self.max_body_bytes)
        req = parse_completion_request(body, request.headers.get("x-session-id"))
        model = self.registry.resolve(req.model)
        grammar = request_grammar(req.response_format, None, None)
        ctx = model.context()
        prompts = [await run_in_threadpool(self.tokenize, model, p, ctx) for p in req.prompts]
        replicas = await acquire_all(self.admission, model, len(prompts) * req.n,
                                     req.session_id)
        gens, echoes = [], []
        for k, replica in enumerate(replicas):
            ids = prompts[k // req.n]
            sampling = to_sampling(req)
            if req.seed is not None:
                sampling["seed"] = req.seed + k
            room = ctx - len(ids)
            gens.append(Generation(self.pool, self.admission, model, replica, ids, sampling,
                                   min(req.max_tokens, room), Emitter(req.stop, tools=False,
                                                                      reasoning=False),
                                   req.session_id if k == 0 else None, grammar,
                                   req.logprobs if req.logprobs is not None else -1))
            source = req.prompts[k // req.n]
            echoes.append((source if isinstance(source, str) else model.tokenizer.decode(ids))
                          if req.echo else "")
        await start_all(gens)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        if req.stream:
            return StreamingResponse(self.sse(req, model, gens, echoes, rid, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            results = await until_disconnect(request, asyncio.gather(*(collect(g) for g in gens)))
        finally:
            for gen in gens:
                gen.close()
        if results is None:
            return Response(status_code=499)
        choices = []
        for k, (gen, events) in enumerate(zip(gens, results)):
            text = joined(events)["content"]
            choices.append({"index": k, "text": echoes[k] + text, "finish_reason":
                            gen.finish_reason, "logprobs": legacy_logprobs(
                                model.tokenizer, gen.logprobs, len(echoes[k]))
                            if req.logprobs is not None else None})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": model.name, "choices": choices, "usage": totals(gens)})

    async def sse(self, req: CompletionRequest, model: ServedModel, gens, echoes, rid, created):
        def chunk(index, text, finish=None, logprobs=None):
            return sse({"id": rid, "object": "text_completion", "created": created,
                        "model": model.name, "choices": [{"index": index, "text": text,
                                                          "logprobs": logprobs,
                                                          "finish_reason": finish}]})
        sent = [0] * len(gens)
        offset = [len(e) for e in echoes]

        def new_logprobs(k):
            if req.logprobs is None:
                return None
            items, sent[k] = gens[k].logprobs[sent[k]:], len(gens[k].logprobs)
            out = legacy_logprobs(model.tokenizer, items, offset[k])
            offset[k] += sum(len(t) for t in out["tokens"])
            return out
        try:
            for k, echo in enumerate(echoes):
                if echo:
                    yield chunk(k, echo)
            async for k, event in merged(gens):
                if event is None:
                    yield chunk(k, "", gens[k].finish_reason, new_logprobs(k))
                else:
                    yield chunk(k, event.text, logprobs=new_logprobs(k))
            if req.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": model.name, "choices": [], "usage": totals(gens)})
        except APIError as exc:
            yield sse_error(exc)
        finally:
            for gen in gens:
                gen.close()
        yield sse("[DONE]")
