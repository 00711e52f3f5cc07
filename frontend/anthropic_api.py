"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as
an edge of the chat path.

A Messages body is validated here, in Anthropic's terms (its field names in every error),
then translated into the one internal `ChatRequest`: the system prompt becomes a system
turn, `tool_use` blocks an assistant turn's `tool_calls`, `tool_result` blocks `tool`
turns, `tools` / `tool_choice` OpenAI's function tools. From there it is chat's way
(template, context, admission, the worker, the emitter); a final assistant message is
a prefill (rendered after the generation prompt, left open: the reply continues it and
holds only the continuation), and `thinking` reaches the template as `enable_thinking`
when it reads it (Qwen3's). Only the answer differs:
`MessagesRenderer` turns the emitter's events (reasoning, content, tool blocks) into
content blocks (`thinking`, `text`, `tool_use`) and, streamed, into Anthropic's event
sequence. Errors take Anthropic's shape: `{"type": "error", "error": {type, message}}`.
"""
from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from .body import parse_json, read_body
from .errors import APIError
from .openai_api import Renderer, chat_request, session_header
from .tokenize_api import count_prompt
from .tools import parse_tool_calls, tool_call_text

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING = ("enabled", "disabled", "adaptive")


def error_body(err: APIError) -> dict:
    """An APIError in Anthropic's error shape (the status stays the same)."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                           else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _text_blocks(value, where: str) -> str:
    """A string, or a list of text blocks joined with newlines (system, tool_result)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            raise _bad(f"{where}[{j}]", f"{where}[{j}] must be a text block "
                                        '({"type": "text", "text": ...})')
        texts.append(block["text"])
    return "\n".join(texts)


def _turns(m, i: int, known: set[str]) -> list[dict]:
    """One Anthropic message → chat turns. `known`: the tool_use ids seen so far (a
    tool_result must answer one of them); this message's tool_use ids are added."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(where, f"{where} must be an object")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role", f'{where}.role must be "user" or "assistant"')
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"{where}.content must be a string or a list of "
                                       "content blocks")
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue                 # past reasoning is not shown to the model again
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not block["id"] \
                    or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise _bad(at, f"{at} must have a string id and name and an object input")
            known.add(block["id"])
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"],
                "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            ref = block.get("tool_use_id")
            if not isinstance(ref, str) or ref not in known:
                raise _bad(f"{at}.tool_use_id", f"{at}.tool_use_id {ref!r} answers no "
                                                "tool_use block of an earlier assistant turn")
            result = _text_blocks(block.get("content", ""), f"{at}.content")
            if block.get("is_error") is True:
                result = f"Error: {result}"
            if texts:                 # text before a result stays before it
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": ref, "content": result})
        elif kind in ("text", "tool_use", "tool_result"):
            raise _bad(at, f"{at} is not a valid {kind} block for a {role} message")
        else:
            raise _bad(f"{at}.type", f"{at}.type {kind!r} is not supported (text, tool_use "
                                     "and tool_result blocks are)", code="unsupported")
    if role == "assistant":
        return [{"role": "assistant", "content": "\n".join(texts) if texts or not calls
                 else None, **({"tool_calls": calls} if calls else {})}]
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list of tool definitions")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise _bad(f"tools[{i}]", f"tools[{i}] must be a custom tool ({{name, description, "
                                      "input_schema}); server tools are not supported")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"tools[{i}].input_schema", f"tools[{i}].input_schema must be a JSON "
                                                   "schema object")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'tool_choice must be {"type": "auto"}, {"type": "any"}, '
                              '{"type": "none"} or {"type": "tool", "name": ...}')


def _parallel(choice) -> bool | None:
    """tool_choice.disable_parallel_tool_use, as chat's parallel_tool_calls."""
    flag = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise _bad("tool_choice.disable_parallel_tool_use",
                   "tool_choice.disable_parallel_tool_use must be a boolean")
    return None if flag is None else not flag


def _thinking(value) -> bool:
    """Whether reasoning is shown as thinking blocks (it is unless disabled)."""
    if value is None:
        return True
    if not isinstance(value, dict) or value.get("type") not in THINKING:
        raise _bad("thinking", 'thinking must be {"type": "enabled", "budget_tokens": N}, '
                               '{"type": "adaptive"} or {"type": "disabled"}')
    budget = value.get("budget_tokens")
    if value["type"] == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool)
                                       or budget < 1):
        raise _bad("thinking.budget_tokens", "thinking.budget_tokens must be an integer >= 1")
    return value["type"] != "disabled"


def parse_messages_request(body: bytes, session: str | None, limits,
                           counting: bool = False):
    """(ChatRequest, show thinking) for a Messages body; 400 naming the Anthropic field.
    `counting`: a count_tokens body (no max_tokens)."""
    data = parse_json(body)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of messages"
                   if messages is not None else "messages: field required")
    limits.messages(messages)
    max_tokens = data.get("max_tokens")
    if not counting and max_tokens is None:
        raise _bad("max_tokens", "max_tokens: field required")
    stops = data.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(
            isinstance(s, str) and s for s in stops)):
        raise _bad("stop_sequences", "stop_sequences must be a list of non-empty strings")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata", "metadata must be an object")
    turns: list[dict] = []
    if data.get("system") is not None:
        system = _text_blocks(data["system"], "system")
        if system:
            turns.append({"role": "system", "content": system})
    known: set[str] = set()
    for i, m in enumerate(messages):
        turns += _turns(m, i, known)
    chat = {"model": data.get("model"), "messages": turns, "stream": data.get("stream"),
            "max_tokens": None if counting else max_tokens, "stop": stops or None,
            "tools": _tools(data.get("tools")), "tool_choice": _tool_choice(data.get("tool_choice")),
            "user": (metadata or {}).get("user_id"),
            "parallel_tool_calls": _parallel(data.get("tool_choice"))}
    for name in ("temperature", "top_p", "top_k"):
        chat[name] = data.get(name)
    if turns[-1]["role"] == "assistant" and not turns[-1].get("tool_calls"):
        chat["continue_final_message"] = True     # a prefill: the reply continues it
    thinking = _thinking(data.get("thinking"))
    if data.get("thinking") is not None:           # Qwen3-style templates read it
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    try:
        req = chat_request(chat, session, limits)
    except APIError as exc:          # chat's names where Anthropic's differ
        rename = {"stop": "stop_sequences", "user": "metadata.user_id"}
        if exc.param in rename:
            exc.message = exc.message.replace(exc.param, rename[exc.param], 1)
            exc.param = rename[exc.param]
        raise
    return req, thinking


def _usage(gen) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
    cached = gen.cached_tokens
    return {"input_tokens": len(gen.prompt) - cached, "output_tokens": gen.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _event(name: str, **data) -> tuple[str, dict]:
    return name, {"type": name, **data}


class MessagesRenderer(Renderer):
    """The emitter's events as Anthropic content blocks. Streamed, each body is a list of
    (event name, data) pairs; one content block is open at a time, closed when an event
    of another kind arrives (a tool call is a whole block at once: the emitter hands a
    tool block over when it closes)."""

    def __init__(self, model, req, thinking: bool = True):
        super().__init__(f"msg_{uuid.uuid4().hex}", int(time.time()), model.name,
                         model.tokenizer, req, 1)
        self.thinking = thinking
        self.open: str | None = None     # the kind of the open block, streaming
        self.index = -1                  # its index
        self.calls = 0                   # tool_use blocks sent

    def frame(self, events) -> bytes:
        return b"".join(f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
                        .encode("utf-8") for name, data in events)

    def failure(self, err: APIError) -> bytes:
        return self.frame([("error", error_body(err))])

    def end(self) -> bytes:
        return b""                       # message_stop was the last event

    def message(self, content: list, gen, stop_reason, stop_sequence, usage) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage}

    def stop_reason(self, gen, calls: int) -> tuple[str, str | None]:
        if gen.finish_reason == "length":
            return "max_tokens", None
        if gen.emitter.stop_string is not None:
            return "stop_sequence", gen.emitter.stop_string
        return ("tool_use" if calls else "end_turn"), None

    def tool_blocks(self, text: str) -> list[dict] | None:
        calls = parse_tool_calls([text], self.req.tools)
        return [{"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                 "name": call["function"]["name"],
                 "input": json.loads(call["function"]["arguments"])}
                for call in calls] if calls else None

    # -- streamed ----------------------------------------------------------

    def opening(self, gens) -> list:
        usage = {"input_tokens": len(gens[0].prompt), "output_tokens": 0}
        return [[_event("message_start", message=self.message([], gens[0], None, None, usage)),
                 _event("ping")]]

    def close_block(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def block(self, kind: str, start: dict, delta: dict) -> list:
        """A delta of a `kind` block, opening one (and closing another) if need be."""
        out = []
        if self.open != kind:
            out = self.close_block()
            self.open, self.index = kind, self.index + 1
            out.append(_event("content_block_start", index=self.index, content_block=start))
        return out + [_event("content_block_delta", index=self.index, delta=delta)]

    def event(self, i: int, gen, event) -> list:
        if event.kind == "reasoning":
            if not self.thinking:
                return []
            return self.block("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                              {"type": "thinking_delta", "thinking": event.text})
        text = event.text
        if event.kind == "tool":
            blocks = self.tool_blocks(event.text)
            if blocks:
                out = self.close_block()
                for b in blocks:
                    self.index += 1
                    self.calls += 1
                    out += [_event("content_block_start", index=self.index,
                                   content_block=b | {"input": {}}),
                            _event("content_block_delta", index=self.index, delta={
                                "type": "input_json_delta",
                                "partial_json": json.dumps(b["input"], ensure_ascii=False)}),
                            _event("content_block_stop", index=self.index)]
                return out
            text = tool_call_text(event.text)    # malformed: the raw text, as text
        return self.block("text", {"type": "text", "text": ""},
                          {"type": "text_delta", "text": text})

    def closing(self, i: int, gen) -> list:
        reason, sequence = self.stop_reason(gen, self.calls)
        return self.close_block() + [
            _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                   usage=_usage(gen)),
            _event("message_stop")]

    # -- whole -------------------------------------------------------------

    def whole(self, gens, results) -> dict:
        gen, content, calls = gens[0], [], 0
        for event in results[0]:
            if event.kind == "reasoning" and not self.thinking:
                continue
            if event.kind == "tool" and (blocks := self.tool_blocks(event.text)):
                content += blocks
                calls += len(blocks)
                continue
            kind, key = ("thinking", "thinking") if event.kind == "reasoning" else ("text", "text")
            text = tool_call_text(event.text) if event.kind == "tool" else event.text
            if content and content[-1]["type"] == kind:
                content[-1][key] += text
            else:
                content.append({"type": kind, key: text} | (
                    {"signature": ""} if kind == "thinking" else {}))
        reason, sequence = self.stop_reason(gen, calls)
        return self.message(content, gen, reason, sequence, _usage(gen))


class MessagesService:
    """The two routes. They ride chat's ChatService (its template, context fitting,
    lifecycle); what is refused is answered in Anthropic's error shape."""

    def __init__(self, chat):
        self.chat = chat

    async def parse(self, request: Request, counting: bool = False):
        body = await read_body(request, self.chat.max_body_bytes)
        deadline = self.chat.preparer.deadline()
        req, thinking = await self.chat.preparer.run(
            deadline, parse_messages_request, body, session_header(request.headers),
            self.chat.limits, counting, size=len(body))
        return req, thinking, deadline, len(body)

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            req, thinking, deadline, size = await self.parse(request)
            job = await self.chat.job(request, req, deadline, size,
                                      lambda model, req, capped:
                                      MessagesRenderer(model, req, thinking))
            await self.chat.lifecycle.run(request, tracked, job)
        except APIError as exc:
            if started:
                raise
            await JSONResponse(error_body(exc), status_code=exc.status,
                               headers=exc.headers)(scope, receive, send)

    async def count_tokens(self, request: Request) -> JSONResponse:
        """{"input_tokens": N}: the prompt as /v1/messages would render it."""
        try:
            req, _, deadline, size = await self.parse(request, counting=True)
            model = await self.chat.registry.want(req.model)     # a catalog model loads
            count = await self.chat.preparer.run(deadline, count_prompt, model, req, size=size)
        except APIError as exc:
            return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
        return JSONResponse({"input_tokens": count})

