"""OpenAI's Responses API (`/v1/responses`: create, retrieve, input_items, delete,
cancel) as an edge of the chat path.

A body's `input` (a string, or items: messages, `function_call`, `function_call_output`,
`reasoning`) becomes chat turns, after the turns of the response it continues
(`previous_response_id`, from the ResponseStore), with `instructions` as the system turn;
function tools, `tool_choice` and `text.format` become chat's. From there it is chat's
way (template, context, admission, the worker, the emitter). `ResponsesRenderer`
(responses_renderer.py) writes the answer. A finished response with `store` (the
default) is kept with its conversation for follow-ups.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse

from .body import parse_json, read_body
from .errors import APIError
from .openai_api import SAMPLING_FIELDS, chat_request, session_header
from .response_store import ResponseStore
from .responses_renderer import ResponsesRenderer, new_id
from .tokenize_api import count_prompt

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
UNSUPPORTED = ("background", "conversation", "prompt")     # refused when set


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(slots=True)
class ResponsesRequest:
    """A create body, checked: its own turns and what the response object echoes."""

    data: dict                     # the chat body, `messages` still to be completed
    turns: list[dict]              # this request's input as chat turns
    instructions: str | None
    previous: str | None
    store: bool
    echo: dict = field(default_factory=dict)
    items: list[dict] = field(default_factory=list)     # the input as items, with ids


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in TEXT_PARTS or not isinstance(part.get(key), str):
            raise _bad(f"{where}[{j}]", f"{where}[{j}] must be a text part (input_text or "
                                        f"output_text); {kind!r} is not supported",
                       code="unsupported" if kind else None)
        texts.append(part[key])
    return "\n".join(texts)


def _item(item, i: int, turns: list[dict]) -> None:
    """One input item appended to `turns` as chat turns: function calls join the
    assistant turn they follow; reasoning items are not shown to the model again."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise _bad(where, f"{where} must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        if item.get("role") not in ROLES:
            raise _bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
        turns.append({"role": item["role"], "content": _text(item.get("content"),
                                                             f"{where}.content")})
    elif kind == "function_call":
        if not all(isinstance(item.get(k), str) and item[k] for k in ("call_id", "name")) \
                or not isinstance(item.get("arguments"), str):
            raise _bad(where, f"{where} (function_call) needs string call_id, name and "
                              "arguments")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = turns[-1] if turns else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _bad(f"{where}.call_id", f"{where}.call_id must be a string")
        turns.append({"role": "tool", "tool_call_id": item["call_id"], "where": where,
                      "content": _text(item.get("output"), f"{where}.output")})
    elif kind != "reasoning":
        raise _bad(f"{where}.type", f"{where}.type {kind!r} is not supported (message, "
                                    "function_call, function_call_output and reasoning "
                                    "items are)", code="unsupported")


ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
            "reasoning": "rs"}


def input_item(item) -> dict:
    """An input item (checked by _item) as input_items lists it: its id (the client's, or
    a new one), its type, "completed", a message's content as parts."""
    if isinstance(item, str):
        item = {"role": "user", "content": item}
    kind = item.get("type", "message")
    given = item.get("id")
    out = {"id": given if isinstance(given, str) and given else new_id(ITEM_IDS[kind]),
           "type": kind, **{k: v for k, v in item.items() if k not in ("id", "type")}}
    out.setdefault("status", "completed")
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        content = item.get("content")
        parts = [{"type": part, "text": content}] if isinstance(content, str) else content
        out["content"] = [p | {"annotations": p.get("annotations", [])}
                          if p.get("type") == "output_text" else p for p in parts]
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools[{i}].type", f"tools[{i}] must be a function tool; "
                                           f"{kind!r} tools are not supported",
                       code="unsupported")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "name": ...}')


def _format(text):
    """`text.format` → chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
        raise _bad("text", 'text must be an object such as {"format": {"type": "text"}}')
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", "text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt["schema"],
            "strict": fmt.get("strict")}}
    raise _bad("text.format.type", 'text.format.type must be "text", "json_object" or '
                                   '"json_schema"')


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """A create body → ResponsesRequest; 400 naming the field (a preparer thread)."""
    data = parse_json(body)
    for name in UNSUPPORTED:
        if data.get(name) not in (None, False):
            raise _bad(name, f"{name} is not supported", code="unsupported")
    raw = data.get("input")
    if isinstance(raw, str):
        turns = [{"role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        turns = []
        for i, item in enumerate(raw):
            _item(item, i, turns)
    else:
        raise _bad("input", "input is required: a string or a non-empty list of items"
                   if raw is None else "input must be a string or a non-empty list of items")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", "instructions must be a string")
    previous = data.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("previous_response_id", "previous_response_id must be a string")
    store = data.get("store", True)
    if not isinstance(store, bool):
        raise _bad("store", "store must be a boolean")
    reasoning = data.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise _bad("reasoning", "reasoning must be an object")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata", "metadata must be an object")
    max_tokens = data.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(
            max_tokens, bool) or max_tokens < 1):
        raise _bad("max_output_tokens", "max_output_tokens must be an integer >= 1")
    chat = {"model": data.get("model"), "stream": data.get("stream"), "max_tokens": max_tokens,
            "tools": _tools(data.get("tools")), "tool_choice": _tool_choice(data.get("tool_choice")),
            "response_format": _format(data.get("text")), "user": data.get("user"),
            "parallel_tool_calls": data.get("parallel_tool_calls"),
            "reasoning_effort": (reasoning or {}).get("effort"),
            **{k: data[k] for k in SAMPLING_FIELDS if k in data}}
    echo = {"instructions": instructions, "max_output_tokens": max_tokens,
            "previous_response_id": previous, "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice", "auto"),
            "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "temperature": data.get("temperature"), "top_p": data.get("top_p"),
            "text": data.get("text") or {"format": {"type": "text"}},
            "reasoning": reasoning or {"effort": None, "summary": None},
            "store": store, "metadata": metadata or {}, "truncation": "disabled",
            "background": False}
    items = [input_item(item) for item in (raw if isinstance(raw, list) else [raw])]
    return ResponsesRequest(chat, turns, instructions, previous, store, echo, items=items)


def chat_for(rr: ResponsesRequest, earlier: list[dict], session: str | None, limits):
    """The ChatRequest of a create: instructions, the turns it continues, its own; a
    function_call_output must answer a function_call among them (a preparer thread)."""
    turns = ([{"role": "system", "content": rr.instructions}] if rr.instructions else []) \
        + earlier + rr.turns
    calls: set[str] = set()
    for turn in turns:
        calls.update(c["id"] for c in turn.get("tool_calls") or [])
        if turn["role"] == "tool" and turn["tool_call_id"] not in calls:
            where = turn.get("where", "input")
            raise _bad(f"{where}.call_id", f"{where}.call_id {turn['tool_call_id']!r} "
                                           "answers no earlier function_call")
    try:
        return chat_request({**rr.data, "messages": turns}, session, limits)
    except APIError as exc:                     # chat's names where the Responses' differ
        if exc.param == "max_tokens":
            exc.param = "max_output_tokens"
        elif exc.param == "response_format":
            exc.param = "text.format"
        elif exc.param == "reasoning_effort":
            exc.message = exc.message.replace("reasoning_effort", "reasoning.effort", 1)
            exc.param = "reasoning.effort"
        raise


def page(items: list[dict], query) -> dict:
    """One page of a list: `order` asc or desc (the default, OpenAI's), `limit` 1-100
    (default 20), `after` the id of the item the page follows."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _bad("order", f"order must be asc or desc, not {order!r}")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise _bad("limit", f"limit must be an integer in [1, 100], not {limit!r}")
    ordered = items if order == "asc" else items[::-1]
    start, after = 0, query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise _bad("after", f"after {after!r} is no input item of this response")
        start = ids.index(after) + 1
    data = ordered[start:start + int(limit)]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + len(data) < len(ordered)}


class ResponsesService:
    """The routes. Creation rides chat's ChatService; the store keeps what follows up."""

    def __init__(self, chat, store: ResponseStore):
        self.chat, self.store = chat, store

    def earlier(self, previous: str | None):
        """(turns, session) of the response a create continues; 404 if it is gone."""
        if previous is None:
            return [], None
        found = self.store.get(previous)
        if found is None:
            raise APIError(404, f"Previous response with id {previous!r} not found (it was "
                                "never stored, was deleted, or expired).",
                           param="previous_response_id", code="previous_response_not_found")
        return found.turns, found.session

    async def __call__(self, scope, receive, send) -> None:
        """POST /v1/responses."""
        request = Request(scope, receive)
        chat = self.chat
        body = await read_body(request, chat.max_body_bytes)
        deadline = chat.preparer.deadline()
        rr = await chat.preparer.run(deadline, parse_responses_request, body, size=len(body))
        turns, session = self.earlier(rr.previous)
        rid = new_id("resp")
        session = session or session_header(request.headers) or rid
        req = await chat.preparer.run(deadline, chat_for, rr, turns, session, chat.limits,
                                      size=len(body))
        history = req.messages[1:] if rr.instructions else req.messages   # not carried on

        def finished(response: dict, turn: dict) -> None:
            self.store.running.pop(rid, None)
            if rr.store:
                self.store.put(rid, response, history + [turn], session, items=rr.items)
        job = await chat.job(request, req, deadline, len(body),
                             lambda model, req, capped:
                             ResponsesRenderer(rid, model, req, rr.echo, finished))
        self.store.running[rid] = (job.renderer.response("in_progress"), job, rr.items)
        try:
            await chat.lifecycle.run(request, send, job)
        finally:
            self.store.running.pop(rid, None)

    async def input_tokens(self, request: Request) -> JSONResponse:
        """POST /v1/responses/input_tokens: a create body's prompt tokens, as it would
        be rendered (previous_response_id included)."""
        chat = self.chat
        body = await read_body(request, chat.max_body_bytes)
        deadline = chat.preparer.deadline()
        rr = await chat.preparer.run(deadline, parse_responses_request, body, size=len(body))
        turns, _ = self.earlier(rr.previous)
        req = await chat.preparer.run(deadline, chat_for, rr, turns, None, chat.limits,
                                      size=len(body))
        model = await chat.registry.want(req.model)          # a catalog model loads
        count = await chat.preparer.run(deadline, count_prompt, model, req, size=len(body))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    def found(self, request: Request):
        """(response, its Job while it runs else None, its input items); 404 if unknown."""
        rid = request.path_params["id"]
        stored = self.store.get(rid)
        if stored is None:
            running = self.store.running.get(rid)
            if running is not None:
                return running
            raise APIError(404, f"Response with id {rid!r} not found.", param="response_id",
                           code="response_not_found")
        return stored.response, None, stored.items

    async def retrieve(self, request: Request) -> JSONResponse:
        return JSONResponse(self.found(request)[0])

    async def input_items(self, request: Request) -> JSONResponse:
        """GET /v1/responses/{id}/input_items: the response's own input items, a page
        at a time as OpenAI pages lists (`after` an item id, `limit`, `order`)."""
        items = self.found(request)[2]
        return JSONResponse(page(items, request.query_params))

    async def delete(self, request: Request) -> JSONResponse:
        rid = request.path_params["id"]
        if not self.store.delete(rid):
            raise APIError(404, f"Response with id {rid!r} not found.", param="response_id",
                           code="response_not_found")
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: Request) -> JSONResponse:
        """A response still running ends now (its client gets a 409 or an `error` event);
        a finished one cannot be cancelled."""
        response, job, _ = self.found(request)
        if job is None:
            raise APIError(400, f"response {response['id']!r} is {response['status']}: only "
                                "a response in progress can be cancelled",
                           param="response_id", code="response_not_running")
        for gen in job.gens:
            gen.fail(APIError(409, "the response was cancelled", code="response_cancelled"))
        return JSONResponse(response | {"status": "cancelled"})
