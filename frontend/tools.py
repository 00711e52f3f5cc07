"""OpenAI tool calling in the Hermes / Qwen convention, as pure functions.

Most open models that were trained on tool use (Qwen2.5/3, Hermes, ...) read tool
signatures as JSON inside `<tools></tools>` in the system turn, write calls as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` and read results inside
`<tool_response></tool_response>` in a user turn. When the model's own template handles
tools we let it; otherwise we rewrite the conversation into that convention before the
template sees it, so any template (even one that knows nothing of tools and would choke on
`content: None`) renders it. Parsing the model's call blocks back into OpenAI `tool_calls`
and the llguidance grammar that forces calls for `tool_choice` "required" or a named
function live here too, so the HTTP layer only wires them in.
"""
from __future__ import annotations

import json
import re
import secrets

from .emitter import END_TOOL, TOOL
from .errors import APIError

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
# The exact separators Qwen's template renders calls with (`tojson` = json.dumps defaults):
# the grammar forces them so constrained output looks like the model's training data and
# cannot wander off into unbounded whitespace.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML tags:"
                "\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def check_tools(tools, tool_choice) -> None:
    """Reject malformed `tools` / `tool_choice` with a 400 naming the field, so nothing past
    the edge (prompt rewriting, grammar building) has to defend against odd shapes."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function"
                and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) and t["function"]["name"]
                for t in tools):
            raise _bad("tools", 'tools must be a list of {"type": "function", '
                                '"function": {"name": ...}} objects')
        for i, tool in enumerate(tools):
            where, fn = f"tools[{i}]", tool["function"]
            name = fn["name"]
            if not _NAME.fullmatch(name):
                raise _bad(f"{where}.function.name", f"{where}.function.name must be 1-64 "
                                                     "characters of a-z, A-Z, 0-9, _ or -")
            if name in names:  # a call names its function; two of one name are ambiguous
                raise _bad(f"{where}.function.name", f"duplicate function name {name!r}")
            names.append(name)
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise _bad(f"{where}.function.description",
                           f"{where}.function.description must be a string")
            params = fn.get("parameters")
            if params is not None and (not isinstance(params, dict)
                                       or params.get("type", "object") != "object"):
                raise _bad(f"{where}.function.parameters", f"{where}.function.parameters must "
                                                           "be a JSON schema of an object")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        wanted = None
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)
          and isinstance(tool_choice["function"].get("name"), str)):
        wanted = tool_choice["function"]["name"]
    else:
        raise _bad("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                  '{"type": "function", "function": {"name": ...}}')
    if not names:
        raise _bad("tool_choice", "tool_choice requires tools")
    if wanted is not None and wanted not in names:
        raise _bad("tool_choice", f"tool_choice names function {wanted!r}, which is not "
                                  "among tools")


def template_knows_tools(source: str | None) -> bool:
    """Whether a Jinja chat template renders tools and tool calls itself. Templates that
    do mention both variables; ones that mention neither would drop them silently."""
    return bool(source) and re.search(r"\btools\b", source) is not None \
        and re.search(r"\btool_calls\b", source) is not None


def _choice_name(tool_choice) -> str | None:
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def _tools_block(tools: list[dict], tool_choice) -> str:
    lines = [json.dumps({"type": "function", "function": t["function"]}, ensure_ascii=False)
             for t in tools]
    text = TOOLS_HEADER + "\n".join(lines) + TOOLS_FOOTER
    if tool_choice == "required":
        text += "\n\nYou must call at least one function."
    elif (name := _choice_name(tool_choice)) is not None:
        text += f'\n\nYou must call the function "{name}".'
    return text


def _text(content) -> str:
    """Content as a string: the edge (openai_api) already flattened text parts into one
    string; an assistant turn with only tool calls has None."""
    return content or ""


def tool_call_text(inner: str) -> str:
    """A `<tool_call>` block around `inner`, as the Hermes convention writes it (the
    history of past calls, and a malformed block handed back as plain content)."""
    return f"{TOOL}{inner}{END_TOOL}"


def _call_block(call: dict) -> str:
    """One OpenAI tool call as Qwen's template writes it: arguments shown as an object."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # keep the string: the history says what it says
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return tool_call_text(f"\n{body}\n")


def prepare_conversation(messages: list[dict], tools: list[dict] | None, tool_choice,
                         template_source: str | None) -> tuple[list[dict], list[dict] | None]:
    """(messages to render, tools to hand the template). A template that knows tools gets
    both unchanged (tools hidden for tool_choice "none"). Any other template gets plain
    system/user/assistant turns in the Hermes convention: signatures (and a tool_choice
    instruction) in the system turn, past calls as `<tool_call>` text, results as a user
    turn of `<tool_response>` blocks, and no content None. `tools` is then None, because
    they are already in the prompt. `tools`/`tool_choice` must have passed `check_tools`."""
    if tool_choice == "none" or not tools:
        tools = None
    if template_knows_tools(template_source):
        return list(messages), tools
    out: list[dict] = []
    after_tool = False  # consecutive tool results share one user turn, as in Qwen's template
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        content = _text(m.get("content"))
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"] if isinstance(c, dict))
            content = f"{content}\n{blocks}" if content else blocks
        rest = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        out.append({**rest, "content": content})
    if tools:
        block = _tools_block(tools, tool_choice)
        if out and out[0].get("role") == "system":  # Qwen's order: system text, then tools
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _one_call(block: str, names: set[str] | None) -> dict | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args = call.get("arguments", call.get("parameters", {}))  # some models say "parameters"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(blocks: list[str], tools: list[dict] | None) -> list[dict] | None:
    """The inner texts of the model's `<tool_call>` blocks -> OpenAI `tool_calls`, or None
    if there are none or any block is malformed (bad JSON, no string name, a name not in
    `tools`, arguments not an object): the caller then returns the raw text as content,
    since half-parsed calls would be worse than honest text."""
    names = {t["function"]["name"] for t in tools} if tools else None
    calls = [_one_call(b, names) for b in blocks]
    return calls if calls and all(c is not None for c in calls) else None


def _call_schema(fn: dict) -> dict:
    """The JSON schema of one call to `fn`. The parameters' `$defs` move to the root,
    because their `#/$defs/...` references resolve against the root document."""
    params = dict(fn.get("parameters") or {"type": "object"})
    params.setdefault("type", "object")
    root = {"type": "object", "properties": {"name": {"const": fn["name"]}},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": _JSON_STYLE}
    for key in ("$defs", "definitions"):
        if key in params:
            root[key] = params.pop(key)
    root["properties"]["arguments"] = params
    return root


def tool_call_grammar(tools: list[dict] | None, tool_choice) -> str | None:
    """An llguidance Lark grammar forcing the output to be one `<tool_call>` block: of
    any of the tools for "required" (one call per turn: a small model, allowed more,
    tends to repeat the same call until max_tokens), of the named function for a named
    choice; None when nothing is forced ("auto",
    "none"). Each function is its own `%json` alternative, so the name picks the schema
    its arguments must satisfy. The caller should check the result with
    `llguidance.LLMatcher.validate_grammar` (a schema llguidance cannot compile is a 400)."""
    name = _choice_name(tool_choice)
    if not tools or (tool_choice != "required" and name is None):
        return None
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not fns:
        return None
    rules = [f"fn{i}: %json {json.dumps(_call_schema(fn))}" for i, fn in enumerate(fns)]
    start = "start: call"
    return "\n".join([start, 'call: "<tool_call>\\n" body "\\n</tool_call>"',
                      "body: " + " | ".join(f"fn{i}" for i in range(len(fns))), *rules]) + "\n"
