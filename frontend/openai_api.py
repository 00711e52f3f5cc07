"""The pure part of the OpenAI API: request validation, response / server-sent-event
shapes, and the per-endpoint renderers. No I/O here; the request lifecycle
(lifecycle.py) calls these.

A request body is checked once at the edge and becomes one `ChatRequest`; everything past
that point can trust its fields. Every rejection is an `APIError` whose message names the
offending field, carried in `param` as well, the way OpenAI reports it.
"""
from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

from ..common import limits as wire
from ..common.protocol import SAMPLING_RANGES, Sampling
from .body import parse_json
from .emitter import joined
from .errors import APIError
from .keep_alive import parse_keep_alive
from .limits import RequestLimits
from .tools import check_tools, parse_tool_calls, tool_call_text

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_N = 16


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(slots=True, kw_only=True)
class GenerationRequest:
    """What both endpoints share: sampling, stop strings, streaming, routing."""

    model: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    session_id: str | None = None
    n: int = 1
    response_format: dict | None = None
    return_token_ids: bool = False      # vLLM's: token_ids per choice, prompt_token_ids
    cache_salt: str | None = None       # vLLM's: a prefix-cache scope of the client's own
    prediction: str | None = None       # OpenAI's predicted output: seeds speculation
    keep_alive: float | None = None     # Ollama's: seconds the model stays loaded after


@dataclass(slots=True, kw_only=True)
class ChatRequest(GenerationRequest):
    """A validated, normalized chat-completions request."""

    messages: list[dict]
    max_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: object = None
    logprobs: bool = False
    top_logprobs: int = 0
    parallel_tool_calls: bool = True    # false: the reply ends with its first tool call
    prefill: str | None = None          # the reply's start, continued (an assistant prefill)
    template_args: dict = field(default_factory=dict)   # chat template variables


def render_options(req: ChatRequest) -> dict:
    """render_text's options a request sets: its prefill and template args."""
    return {k: v for k, v in (("prefill", req.prefill), ("args", req.template_args))
            if v is not None and v != {}}


@dataclass(slots=True, kw_only=True)
class CompletionRequest(GenerationRequest):
    """A /v1/completions body, normalized: one entry of `prompts` per prompt."""

    prompts: list                       # each a str or a list of token ids
    max_tokens: int = 16
    echo: bool = False
    logprobs: int | None = None         # None: off; N: the chosen token's and the top N


# name: (integers only, accepts the value, what it must be): the sampling ranges of the
# wire's one table, and the fields only the HTTP API has.
_NUMERIC = {
    **{name: rule for name, rule in SAMPLING_RANGES.items() if name != "repeat_last_n"},
    "max_tokens": (True, lambda v: v >= 1, "an integer >= 1"),
    "max_completion_tokens": (True, lambda v: v >= 1, "an integer >= 1"),
    "n": (True, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]"),
    "top_logprobs": (True, lambda v: 0 <= v <= 20, "an integer in [0, 20]"),
}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed")
_TOKEN_ID = re.compile(r"[0-9]+")


def _show(value) -> str:
    """A short description of a bad value for an error message."""
    text = json.dumps(value) if isinstance(value, (str, bool, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(value, integer: bool) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return not integer and isinstance(value, float) and math.isfinite(value)


def _number(body: dict, name: str):
    """The field's value checked against its `_NUMERIC` rule, or None when absent / null."""
    value = body.get(name)
    if value is None:
        return None
    integer, ok, what = _NUMERIC[name]
    if not _is_number(value, integer) or not ok(value):
        raise _bad(name, f"{name} must be {what}, got {_show(value)}")
    return value if integer else float(value)


def _text(content, where: str) -> str:
    """Content as one string: a string, or a list of text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"{where} must be a string or a list of text content parts, "
                          f"got {_show(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"{where}[{j}]", f"{where}[{j}] must be a content part object")
        if part.get("type") != "text":
            raise _bad(f"{where}[{j}].type", f"{where}[{j}].type is {_show(part.get('type'))}: "
                                             "only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}].text", f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(where, f"{where} must be an object, got {_show(m)}")
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; "
                                    f"got {_show(role)}")
    tool_calls = m.get("tool_calls")
    if role == "assistant" and tool_calls is not None:
        if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
            raise _bad(f"{where}.tool_calls", f"{where}.tool_calls must be a list of objects")
    content = m.get("content")
    if content is None:
        if not (role == "assistant" and tool_calls):
            raise _bad(f"{where}.content", f"{where}.content may be null only for an "
                                           "assistant message with tool_calls")
    else:
        content = _text(content, f"{where}.content")
    out = {"role": "system" if role == "developer" else role, "content": content}
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise _bad(f"{where}.name", f"{where}.name must be a string")
        out["name"] = m["name"]
    if role == "assistant" and tool_calls:
        out["tool_calls"] = tool_calls
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP:
        raise _bad("stop", f"stop may have at most {MAX_STOP} entries, got {len(stops)}")
    return list(stops)


def _logit_bias(value) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("logit_bias", "logit_bias must be an object mapping token ids to numbers")
    if len(value) > wire.MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"logit_bias may have at most {wire.MAX_LOGIT_BIAS} entries, "
                                 f"got {len(value)}", code="limit_exceeded")
    out = {}
    for key, bias in value.items():
        if not _TOKEN_ID.fullmatch(key) or len(key) > 10 or int(key) > wire.MAX_TOKEN_ID:
            raise _bad("logit_bias", f"logit_bias key {_show(key)} is not a token id "
                                     f"(an integer in [0, {wire.MAX_TOKEN_ID}])")
        if not _is_number(bias, False) or not -100 <= bias <= 100:
            raise _bad("logit_bias", f"logit_bias[{key}] must be a number in [-100, 100], "
                                     f"got {_show(bias)}")
        out[int(key)] = float(bias)
    return out


def _tools(tools, tool_choice) -> list[dict] | None:
    """`tools` after the one check of tools and tool_choice (tools.check_tools)."""
    check_tools(tools, tool_choice)
    return tools or None


def _optional(body: dict, name: str, kind: type, what: str, prefix: str = ""):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise _bad(prefix + name, f"{prefix}{name} must be {what}, got {_show(value)}")
    return value


def _json_object(body: bytes) -> dict:
    return parse_json(body)


# The session key a request may carry in a header, in this order: X-Session-Id (the
# OpenAI-compatible servers' and vllm-router's consistent_hash key), X-SMG-Routing-Key
# (SMG forwards only that one). A `session_id` body field wins over both.
SESSION_HEADERS = ("x-session-id", "x-smg-routing-key")


def session_header(headers) -> str | None:
    """The first non-empty session header of a request's (case-insensitive) headers."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return None


def _common(data: dict, session_header: str | None) -> dict:
    """Fields /v1/chat/completions and /v1/completions share, validated."""
    numbers = {name: _number(data, name) for name in _NUMERIC}
    sampling = {k: numbers[k] for k in SAMPLING_FIELDS if numbers[k] is not None}
    if sampling.get("top_k") == -1:
        sampling["top_k"] = 0
    stream = _optional(data, "stream", bool, "a boolean") or False
    options = _optional(data, "stream_options", dict, "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "stream_options is only allowed when stream is true")
        include_usage = _optional(options, "include_usage", bool, "a boolean",
                                  "stream_options.") or False
    session_id = _optional(data, "session_id", str, "a string")
    if session_id is None:
        session_id = session_header or None
    if session_id is not None and len(session_id) > wire.MAX_SESSION_ID_CHARS:
        raise _bad("session_id", f"session_id may have at most {wire.MAX_SESSION_ID_CHARS} "
                                 f"characters, got {len(session_id)}", code="limit_exceeded")
    cache_salt = _optional(data, "cache_salt", str, "a string")
    if cache_salt is not None and len(cache_salt) > wire.MAX_CACHE_SALT_CHARS:
        raise _bad("cache_salt", f"cache_salt may have at most {wire.MAX_CACHE_SALT_CHARS} "
                                 f"characters, got {len(cache_salt)}", code="limit_exceeded")
    response_format = _optional(data, "response_format", dict, "an object")
    return_token_ids = _optional(data, "return_token_ids", bool, "a boolean") or False
    prediction = _prediction(data.get("prediction"))
    return dict(model=_optional(data, "model", str, "a string"),
                sampling=Sampling(logit_bias=_logit_bias(data.get("logit_bias")), **sampling),
                stop=_stop(data.get("stop")),
                stream=stream, include_usage=include_usage, n=numbers["n"] or 1,
                user=_optional(data, "user", str, "a string"),
                session_id=session_id, cache_salt=cache_salt,
                response_format=response_format, return_token_ids=return_token_ids,
                keep_alive=parse_keep_alive(data.get("keep_alive")),
                prediction=prediction), numbers



def _prediction(value) -> str | None:
    """OpenAI's `prediction`: {"type": "content", "content": text or [text parts]}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise _bad("prediction", 'prediction must be {"type": "content", "content": ...}')
    content = value.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text"
                   and isinstance(part.get("text"), str) for part in content):
            raise _bad("prediction", "prediction.content parts must be "
                                     '{"type": "text", "text": "..."}')
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise _bad("prediction", "prediction.content must be a string or a list of text parts")
    if len(content) > wire.MAX_PREDICTION_CHARS:
        raise _bad("prediction", f"prediction.content may have at most "
                                 f"{wire.MAX_PREDICTION_CHARS} characters, got {len(content)}",
                   code="limit_exceeded")
    return content or None


DEFAULT_LIMITS = RequestLimits()


def parse_completion_request(body: bytes, session_header: str | None = None,
                             limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    """Validate a /v1/completions body; raises `APIError(400)` naming the bad field."""
    data = _json_object(body)
    prompt = data.get("prompt")
    if isinstance(prompt, str) or _token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or _token_list(p) for p in prompt):
        prompts = prompt
    else:
        raise _bad("prompt", "prompt is required: a string, a list of token ids, or a list "
                             "of those" if prompt is None else
                   "prompt must be a string, a non-empty list of token ids, or a list of those")
    if any(p == "" or p == [] for p in prompts):
        raise _bad("prompt", "prompt must not be empty")
    if data.get("suffix") not in (None, ""):
        raise _bad("suffix", "suffix (fill-in-the-middle) is not supported", code="unsupported")
    if data.get("best_of") not in (None, 1):
        raise _bad("best_of", "best_of is not supported", code="unsupported")
    fields, numbers = _common(data, session_header)
    logprobs = data.get("logprobs")
    if logprobs is not None and (not _is_number(logprobs, True) or not 0 <= logprobs <= 20):
        raise _bad("logprobs", f"logprobs must be an integer in [0, 20], got {_show(logprobs)}")
    limits.stop(fields["stop"])
    limits.tokens(fields["n"], numbers["max_tokens"] or 16, len(prompts))
    return CompletionRequest(prompts=prompts, max_tokens=numbers["max_tokens"] or 16,
                             echo=_optional(data, "echo", bool, "a boolean") or False,
                             logprobs=logprobs, **fields)


def _token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        _is_number(t, True) and t >= 0 for t in value)


def parse_chat_request(body: bytes, session_header: str | None = None,
                       limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    """Validate a /v1/chat/completions body; raises `APIError(400)` naming the bad field."""
    return chat_request(_json_object(body), session_header, limits)


def chat_request(data: dict, session_header: str | None = None,
                 limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    """A decoded chat body (or another edge's body translated into one) → ChatRequest."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of message objects"
                   if messages is not None else "messages is required")
    limits.messages(messages)
    messages = [_message(m, i) for i, m in enumerate(messages)]
    fields, numbers = _common(data, session_header)
    logprobs = _optional(data, "logprobs", bool, "a boolean") or False
    if numbers["top_logprobs"] is not None and not logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    max_tokens = numbers["max_completion_tokens"] or numbers["max_tokens"]
    limits.stop(fields["stop"])
    limits.tokens(fields["n"], max_tokens)
    limits.tools(data.get("tools"))
    prefill = None
    if _optional(data, "continue_final_message", bool, "a boolean"):
        last = messages[-1]
        if last["role"] != "assistant" or last.get("tool_calls"):
            raise _bad("continue_final_message", "continue_final_message needs the last "
                                                 "message to be an assistant's text")
        prefill = messages.pop()["content"] or ""
    return ChatRequest(messages=messages, max_tokens=max_tokens, prefill=prefill,
                       template_args=template_args(data),
                       tools=_tools(data.get("tools"), data.get("tool_choice")),
                       tool_choice=data.get("tool_choice"),
                       logprobs=logprobs, top_logprobs=numbers["top_logprobs"] or 0,
                       parallel_tool_calls=_optional(data, "parallel_tool_calls", bool,
                                                     "a boolean") is not False, **fields)


EFFORTS = ("none", "minimal", "low", "medium", "high")
# what a template's own variables are; chat_template_kwargs cannot set them
TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
MAX_TEMPLATE_ARGS_CHARS = 64 << 10


def template_args(data: dict) -> dict:
    """The chat template's variables a body sets: `reasoning_effort` (OpenAI's; passed as
    it is, and as Qwen3's `enable_thinking`: off for "none" and "minimal") and vLLM's
    `chat_template_kwargs`, which win. A template gets those it reads (render_text)."""
    args = {}
    effort = data.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise _bad("reasoning_effort", f"reasoning_effort must be one of "
                                           f"{', '.join(EFFORTS)}, got {_show(effort)}")
        args = {"reasoning_effort": effort, "enable_thinking": effort not in EFFORTS[:2]}
    kwargs = _optional(data, "chat_template_kwargs", dict, "an object")
    if kwargs:
        own = sorted(set(kwargs) & set(TEMPLATE_OWN))
        if own:
            raise _bad("chat_template_kwargs", f"chat_template_kwargs cannot set {own[0]} "
                                               "(the request's own fields do)")
        if len(json.dumps(kwargs)) > MAX_TEMPLATE_ARGS_CHARS:
            raise _bad("chat_template_kwargs", f"chat_template_kwargs may take at most "
                                               f"{MAX_TEMPLATE_ARGS_CHARS} characters of JSON",
                       code="limit_exceeded")
        args.update(kwargs)
    return args


# ---- responses -------------------------------------------------------------------------

def completion_id(prefix: str = "chatcmpl") -> str:
    """A random, unique id: `chatcmpl-…` for chat, `cmpl-…` for text completions."""
    return f"{prefix}-{uuid.uuid4().hex}"


def context_exceeded(ctx: int, tokens: int, what: str, reply: str, param: str,
                     why: str = "", at_least: bool = False) -> APIError:
    """The 400 for a prompt that leaves no room for one token of reply (`at_least`:
    `tokens` is a bound from the text's length; it was not tokenized)."""
    tail = f"; {why}. Shorten the conversation." if why else "."
    bound = "at least " if at_least else ""
    return APIError(400, f"This model's maximum context length is {ctx} tokens, but the "
                    f"{what} came to {bound}{tokens} tokens (plus at least 1 for the "
                    f"{reply}){tail}",
                    param=param, code="context_length_exceeded")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          speculation: tuple[int, int] | None = None) -> dict:
    """OpenAI's usage; with `speculation` (tokens proposed, accepted: only when the request
    was speculated on) its completion_tokens_details' prediction counts."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if speculation is not None:
        proposed, accepted = speculation
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": proposed - accepted}
    return out


def chat_choice(index: int, content: str | None, finish_reason, reasoning: str = "",
                tool_calls: list | None = None, logprobs: dict | None = None) -> dict:
    """One choice of a whole chat.completion. Reasoning goes in `reasoning_content` and,
    for clients of vLLM's newer name, `reasoning`."""
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_response(id: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    """A whole (non-streamed) chat.completion."""
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def chat_chunk(id: str, created: int, model: str, delta: dict, finish_reason=None,
               index: int = 0, logprobs: dict | None = None) -> dict:
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage_chunk(id: str, created: int, model: str, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, usage."""
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def sse(data: dict | str) -> bytes:
    """One server-sent event: compact JSON for a dict, a string (`"[DONE]"`) as it is."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8")


def sse_error(err: APIError | dict) -> bytes:
    """An event carrying `{"error": {...}}`, for a failure after the stream has started.
    A dict is taken as the whole body when it has an "error" key, else as the error object."""
    if isinstance(err, APIError):
        return sse(err.body())
    return sse(err if "error" in err else {"error": err})


def models_list(names: list[str], created: int, owned_by: str = "pantheon") -> dict:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": owned_by}
                     for name in names]}


# ---- renderers: what differs between the endpoints ---------------------------------------
#
# The lifecycle drives a renderer with each choice's text events as they settle; it
# returns the JSON objects to send (a chunk, or the whole response). A choice is a
# `Generation` (generation.py): its emitted text, `finish_reason`, `token_ids`,
# `logprobs`, `prompt` and counts.

def logprob_entry(tok, token_id: int, logprob: float) -> dict:
    text = tok.token_str(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok, items) -> dict:
    return {"content": [logprob_entry(tok, it.token, it.logprob) | {
        "top_logprobs": [logprob_entry(tok, t, lp) for t, lp in it.top]} for it in items]}


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


def counts(gens) -> tuple[int, int, int, tuple[int, int] | None]:
    """(prompt, completion, cached, speculation) tokens of a request's choices together:
    each prompt counted once (the `n` choices of a prompt share it, prefilled once), with
    the cached tokens of its first choice, so cached never exceeds prompt; speculation:
    (proposed, accepted) over the choices, None when nothing was proposed."""
    first: dict[int, object] = {}
    for g in gens:
        first.setdefault(id(g.prompt), g)
    proposed = sum(getattr(g, "proposed", 0) for g in gens)
    spec = (proposed, sum(getattr(g, "accepted", 0) for g in gens)) if proposed else None
    return (sum(len(g.prompt) for g in first.values()), sum(g.completion_tokens for g in gens),
            sum(g.cached_tokens for g in first.values()), spec)


class Renderer:
    """What both endpoints share: ids, what each choice has been sent so far (logprobs,
    token ids), usage."""

    object = ""

    def __init__(self, rid: str, created: int, model: str, tokenizer, req: GenerationRequest,
                 n_choices: int):
        self.rid, self.created, self.model, self.tok, self.req = rid, created, model, tokenizer, req
        self.sent_lp = [0] * n_choices
        self.sent_ids = [0] * n_choices

    # how a stream is framed: SSE `data:` lines closed by `[DONE]` (another API's
    # renderer frames its own events)
    def frame(self, body) -> bytes:
        return sse(body)

    def failure(self, err: APIError) -> bytes:
        return sse_error(err)

    def end(self) -> bytes:
        return sse("[DONE]")

    def head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def new_logprobs(self, i: int, gen) -> list:
        items, self.sent_lp[i] = gen.logprobs[self.sent_lp[i]:], len(gen.logprobs)
        return items

    def new_ids(self, i: int, gen, choice: dict) -> dict:
        """`choice` with the token ids generated since its last chunk (return_token_ids)."""
        if self.req.return_token_ids:
            choice["token_ids"], self.sent_ids[i] = gen.token_ids[self.sent_ids[i]:], \
                len(gen.token_ids)
        return choice

    def usage(self, gens) -> dict:
        return self.head(self.object) | {"choices": [], "usage": usage(*counts(gens))}


class ChatRenderer(Renderer):
    object = "chat.completion.chunk"

    def __init__(self, rid, created, model, tokenizer, req: ChatRequest, n_choices: int,
                 capped: bool = False):
        super().__init__(rid, created, model, tokenizer, req, n_choices)
        self.capped = capped
        self.calls = [0] * n_choices            # tool-call deltas sent per choice

    def chunk(self, i: int, gen, delta: dict, finish=None) -> dict:
        logprobs = chat_logprobs(self.tok, self.new_logprobs(i, gen)) if self.req.logprobs \
            else None
        choice = self.new_ids(i, gen, {"index": i, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish})
        body = self.head(self.object) | {"choices": [choice]}
        if self.capped:
            body["context_capped"] = True
        return body

    def opening(self, gens) -> list[dict]:
        out = [self.chunk(i, g, {"role": "assistant", "content": ""}) for i, g in enumerate(gens)]
        if self.req.return_token_ids:           # vLLM: the prompt's ids in the first chunk
            out[0]["prompt_token_ids"] = list(gens[0].prompt)
        return out

    def event(self, i: int, gen, event) -> dict:
        if event.kind == "reasoning":
            return self.chunk(i, gen, {"reasoning_content": event.text, "reasoning": event.text})
        if event.kind == "tool" and (parsed := parse_tool_calls([event.text], self.req.tools)):
            deltas = []
            for call in parsed:
                deltas.append({"index": self.calls[i], **call})
                self.calls[i] += 1
            return self.chunk(i, gen, {"tool_calls": deltas})
        text = event.text if event.kind == "content" else tool_call_text(event.text)
        return self.chunk(i, gen, {"content": text})

    def closing(self, i: int, gen) -> dict:
        finish = "tool_calls" if self.calls[i] and gen.finish_reason == "stop" \
            else gen.finish_reason
        return self.chunk(i, gen, {}, finish)

    def whole(self, gens, results) -> dict:
        choices = [self.choice(i, gen, events) for i, (gen, events)
                   in enumerate(zip(gens, results))]
        body = chat_response(self.rid, self.created, self.model, choices,
                             usage(*counts(gens)))
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(gens[0].prompt)
        if self.capped:
            body["context_capped"] = True
        return body

    def choice(self, index: int, gen, events) -> dict:
        parts = joined(events)
        content, calls = parts["content"], []
        for block in parts["tools"]:
            parsed = parse_tool_calls([block], self.req.tools)
            if parsed:
                calls += parsed
            else:                                # malformed: the raw text, as content
                content += tool_call_text(block)
        finish = "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
        out = chat_choice(index, content if content or not calls else None, finish,
                          parts["reasoning"], calls,
                          chat_logprobs(self.tok, gen.logprobs) if self.req.logprobs else None)
        if self.req.return_token_ids:
            out["token_ids"] = list(gen.token_ids)
        return out


class CompletionRenderer(Renderer):
    """/v1/completions: choice k answers prompt k // n; `echo` puts the prompt first."""

    object = "text_completion"

    def __init__(self, rid, created, model, tokenizer, req: CompletionRequest, n_choices: int,
                 echoes: list[str]):
        super().__init__(rid, created, model, tokenizer, req, n_choices)
        self.echoes = echoes
        self.offset = [len(e) for e in echoes]   # text_offset of the next logprob

    def chunk(self, k: int, gen, text: str, finish=None, first=False) -> dict:
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = legacy_logprobs(self.tok, self.new_logprobs(k, gen), self.offset[k])
            self.offset[k] += sum(len(t) for t in logprobs["tokens"])
        choice = self.new_ids(k, gen, {"index": k, "text": text, "logprobs": logprobs,
                                       "finish_reason": finish})
        if first and self.req.return_token_ids:
            choice["prompt_token_ids"] = list(gen.prompt)
        return self.head(self.object) | {"choices": [choice]}

    def opening(self, gens) -> list[dict]:
        if not self.req.return_token_ids:
            return [self.chunk(k, g, e) for k, (g, e) in enumerate(zip(gens, self.echoes)) if e]
        return [self.chunk(k, g, e, first=True) for k, (g, e) in enumerate(zip(gens, self.echoes))]

    def event(self, k: int, gen, event) -> dict:
        return self.chunk(k, gen, event.text)

    def closing(self, k: int, gen) -> dict:
        return self.chunk(k, gen, "", gen.finish_reason)

    def whole(self, gens, results) -> dict:
        choices = []
        for k, (gen, events) in enumerate(zip(gens, results)):
            choice = {"index": k, "text": self.echoes[k] + joined(events)["content"],
                      "finish_reason": gen.finish_reason,
                      "logprobs": legacy_logprobs(self.tok, gen.logprobs, len(self.echoes[k]))
                      if self.req.logprobs is not None else None}
            if self.req.return_token_ids:
                choice["prompt_token_ids"] = list(gen.prompt)
                choice["token_ids"] = list(gen.token_ids)
            choices.append(choice)
        return self.head("text_completion") | {"choices": choices,
                                               "usage": usage(*counts(gens))}
