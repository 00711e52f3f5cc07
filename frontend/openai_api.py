"""The pure part of the OpenAI chat-completions API: request validation, error objects and
response / server-sent-event shapes. No I/O here; the HTTP app calls these.

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

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_N = 16
SEED_LIMIT = 2**63 - 1


class APIError(Exception):
    """An error that becomes an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(slots=True, kw_only=True)
class GenerationRequest:
    """What both endpoints share: sampling, stop strings, streaming, routing."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    session_id: str | None = None
    n: int = 1
    response_format: dict | None = None


@dataclass(slots=True, kw_only=True)
class ChatRequest(GenerationRequest):
    """A validated, normalized chat-completions request."""

    messages: list[dict]
    max_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: object = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(slots=True, kw_only=True)
class CompletionRequest(GenerationRequest):
    """A /v1/completions body, normalized: one entry of `prompts` per prompt."""

    prompts: list                       # each a str or a list of token ids
    max_tokens: int = 16
    echo: bool = False
    logprobs: int | None = None         # None: off; N: the chosen token's and the top N


# name: (integers only, accepts the value, what it must be). Booleans are never numbers.
_NUMERIC = {
    "temperature": (False, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
    "top_p": (False, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (True, lambda v: v >= -1, "an integer >= -1 (0 or -1 = off)"),
    "min_p": (False, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "presence_penalty": (False, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (False, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (False, lambda v: 0 < v <= 10, "a number in (0, 10]"),
    "max_tokens": (True, lambda v: v >= 1, "an integer >= 1"),
    "max_completion_tokens": (True, lambda v: v >= 1, "an integer >= 1"),
    "seed": (True, lambda v: abs(v) <= SEED_LIMIT, f"an integer with absolute value <= {SEED_LIMIT}"),
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
    out = {}
    for key, bias in value.items():
        if not _TOKEN_ID.fullmatch(key):
            raise _bad("logit_bias", f"logit_bias key {_show(key)} is not a token id "
                                     "(an integer >= 0)")
        if not _is_number(bias, False) or not -100 <= bias <= 100:
            raise _bad("logit_bias", f"logit_bias[{key}] must be a number in [-100, 100], "
                                     f"got {_show(bias)}")
        out[int(key)] = float(bias)
    return out


def _tools(value) -> list[dict] | None:
    if value is None or value == []:
        return None
    ok = isinstance(value, list) and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in value)
    if not ok:
        raise _bad("tools", 'tools must be a list of {"type": "function", '
                            '"function": {"name": ...}} objects')
    return value


def _optional(body: dict, name: str, kind: type, what: str, prefix: str = ""):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise _bad(prefix + name, f"{prefix}{name} must be {what}, got {_show(value)}")
    return value


def _json_object(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError
        raise _bad(None, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _bad(None, "request body must be a JSON object")
    return data


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
    response_format = _optional(data, "response_format", dict, "an object")
    return dict(model=_optional(data, "model", str, "a string"),
                logit_bias=_logit_bias(data.get("logit_bias")), stop=_stop(data.get("stop")),
                stream=stream, include_usage=include_usage, n=numbers["n"] or 1,
                user=_optional(data, "user", str, "a string"),
                session_id=session_id if session_id is not None else (session_header or None),
                response_format=response_format, **sampling), numbers


def parse_completion_request(body: bytes, session_header: str | None = None) -> CompletionRequest:
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
    return CompletionRequest(prompts=prompts, max_tokens=numbers["max_tokens"] or 16,
                             echo=_optional(data, "echo", bool, "a boolean") or False,
                             logprobs=logprobs, **fields)


def _token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        _is_number(t, True) and t >= 0 for t in value)


def parse_chat_request(body: bytes, session_header: str | None = None) -> ChatRequest:
    """Validate a /v1/chat/completions body; raises `APIError(400)` naming the bad field."""
    data = _json_object(body)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of message objects"
                   if messages is not None else "messages is required")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    fields, numbers = _common(data, session_header)
    logprobs = _optional(data, "logprobs", bool, "a boolean") or False
    if numbers["top_logprobs"] is not None and not logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    max_tokens = numbers["max_completion_tokens"] or numbers["max_tokens"]
    return ChatRequest(messages=messages, max_tokens=max_tokens,
                       tools=_tools(data.get("tools")), tool_choice=data.get("tool_choice"),
                       logprobs=logprobs, top_logprobs=numbers["top_logprobs"] or 0, **fields)


def to_sampling(req: GenerationRequest) -> dict:
    """The sampling fields, named as the worker's `SamplingParams` names them."""
    return {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p,
            "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "logit_bias": dict(req.logit_bias), "seed": req.seed}


# ---- responses -------------------------------------------------------------------------

def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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
