"""`POST /v1/embeddings`: each input a sequence of the request's lifecycle Job whose
Generate asks the worker to pool instead of decode.

An input (a string, or token ids) is tokenized as /v1/completions tokenizes a prompt;
the worker prefills it in the batch like any prompt, with no decode, and sends back its
final hidden states pooled (`mean` over the positions, or the `last` one: as the model
file says, `--pooling` overriding). Here the vector is cut to `dimensions` and
L2-normalised, then written as floats or base64 (float32 little-endian, as OpenAI's).
"""
from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request

from .body import parse_json, read_body
from .chat import cache_salt
from .emitter import Emitter
from .errors import APIError
from .keep_alive import parse_keep_alive
from .lifecycle import Choice, Job
from .openai_api import context_exceeded, counts
from ..common.protocol import Sampling

GGUF_POOLING = {1: "mean", 3: "last"}      # llama.cpp's pooling_type values served here


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def parse_request(body: bytes, limits) -> tuple[dict, list]:
    """(the body, `input` as a list of strings and token-id lists); 400 naming the bad
    field or entry (a preparer thread: a list of ids can be megabytes)."""
    data = parse_json(body)
    if data.get("encoding_format", "float") not in ("float", "base64", None):
        raise _bad("encoding_format", 'encoding_format must be "float" or "base64"')
    for name in ("model", "cache_salt"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise _bad(name, f"{name} must be a string")
    return data, parse_inputs(data.get("input"), limits)


def parse_inputs(raw, limits) -> list:
    """`input` as a list of strings and token-id lists; 400 naming the bad entry."""
    if isinstance(raw, str) or _ids(raw):
        inputs = [raw]
    elif isinstance(raw, list) and raw:
        inputs = raw
    else:
        raise _bad("input", "input is required: a string, a list of strings, token ids or "
                            "a list of token-id lists" if raw is None else
                   "input must be a non-empty string, list of strings, token ids or list "
                   "of token-id lists")
    for i, item in enumerate(inputs):
        if not (isinstance(item, str) and item) and not _ids(item):
            raise _bad(f"input[{i}]", f"input[{i}] must be a non-empty string or a "
                                      "non-empty list of token ids")
    if len(inputs) > limits.max_choices:
        raise APIError(400, f"input may have at most {limits.max_choices} entries, got "
                            f"{len(inputs)}", param="input", code="limit_exceeded")
    return inputs


def tokenize(model, inputs: list, ctx: int) -> list[list[int]]:
    """Every input's ids, each checked against the vocabulary and the context (a
    preparer thread)."""
    out, vocab = [], model.config.vocab_size
    for i, item in enumerate(inputs):
        where = f"input[{i}]"
        if isinstance(item, str) and len(item) // model.tokenizer.max_token_chars >= ctx:
            raise context_exceeded(ctx, len(item) // model.tokenizer.max_token_chars, where,
                                   "pooling", where, "counted by its length alone",
                                   at_least=True)
        ids = model.tokenizer.encode(item) if isinstance(item, str) else list(item)
        if any(t >= vocab for t in ids):
            raise _bad(where, f"{where}: token ids must be below the vocabulary size {vocab}")
        if len(ids) >= ctx:
            raise context_exceeded(ctx, len(ids), where, "pooling", where)
        out.append(ids)
    return out


class EmbeddingsRenderer:
    """The pooled states as OpenAI's embedding list (never streamed)."""

    def __init__(self, model: str, fmt: str, dimensions: int | None):
        self.model, self.fmt, self.dimensions = model, fmt, dimensions

    def vector(self, raw: list[float]):
        v = np.asarray(raw, dtype=np.float64)[:self.dimensions]
        norm = float(np.linalg.norm(v))
        v = (v / norm if norm > 0 else v).astype("<f4")
        return base64.b64encode(v.tobytes()).decode() if self.fmt == "base64" \
            else [float(x) for x in v]

    def whole(self, gens, results) -> dict:
        if any(not g.embedding for g in gens):
            raise APIError(500, "a worker answered an embedding request without one",
                           type="server_error", code="no_embedding")
        prompt = counts(gens)[0]
        return {"object": "list", "model": self.model,
                "data": [{"object": "embedding", "index": i, "embedding": self.vector(g.embedding)}
                         for i, g in enumerate(gens)],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}


class EmbeddingsService:
    def __init__(self, chat, pooling: str = "auto"):
        self.chat, self.pooling = chat, pooling

    def pooling_for(self, model) -> str:
        if self.pooling != "auto":
            return self.pooling
        return GGUF_POOLING.get(model.config.pooling_type, "mean")

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        chat = self.chat
        body = await read_body(request, chat.max_body_bytes)
        deadline = chat.preparer.deadline()
        data, inputs = await chat.preparer.run(deadline, parse_request, body, chat.limits,
                                               size=len(body))
        fmt = data.get("encoding_format") or "float"
        model = await chat.registry.want(data.get("model"),
                                         parse_keep_alive(data.get("keep_alive")))
        dims = data.get("dimensions")
        width = model.config.d_model
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)
                                 or not 1 <= dims <= width):
            raise _bad("dimensions", f"dimensions must be an integer in [1, {width}]")
        salt = data.get("cache_salt")
        prompts = await chat.preparer.run(deadline, tokenize, model, inputs, model.context(),
                                          size=len(body))
        pooling = self.pooling_for(model)
        choices = [Choice(ids, Sampling(temperature=0.0), 1,
                          Emitter(tools=False, reasoning=False), pooling=pooling)
                   for ids in prompts]
        job = Job(model, choices, False, EmbeddingsRenderer(
            chat.registry.shown_name(data.get("model"), model), fmt, dims),
                  salt=cache_salt(request.headers, salt))
        await chat.lifecycle.run(request, send, job)
