"""Tool calling helpers: request checks, Hermes-style prompt rewriting (rendered through
the default model's real template), parsing call blocks, and llguidance grammars that
actually constrain the default model's tokens."""
from __future__ import annotations

import json
import re

import llguidance
import pytest
from pantheon.common.chat_template import ChatTemplate, TemplateError
from pantheon.common.default_model import cached_path
from pantheon.common.tokenizer import open_tokenizer
from pantheon.frontend.openai_api import APIError
from pantheon.frontend.tools import (
    check_tools,
    parse_tool_calls,
    prepare_conversation,
    template_knows_tools,
    tool_call_grammar,
)

MODEL = cached_path()                      # the settings' cache folder (PANTHEON_CACHE_DIR)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "22C cloudy"},
]

# The tool handling of Qwen2.5's template, cut down: it knows `tools` and `tool_calls`.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %}{% endfor %}")


def _error(tools, choice) -> APIError:
    with pytest.raises(APIError) as info:
        check_tools(tools, choice)
    assert info.value.status == 400
    return info.value


# ---- check_tools -------------------------------------------------------------------------

@pytest.mark.parametrize("tools,choice", [
    (None, None), (None, "none"), (None, "auto"), ([], "auto"), (TOOLS, None), (TOOLS, "none"),
    (TOOLS, "auto"), (TOOLS, "required"), (TOOLS, NAMED),
    ([{"type": "function", "function": {"name": "a-B_9", "description": None,
                                        "parameters": {"properties": {}}}}], "required"),
])
def test_check_tools_accepts(tools, choice):
    check_tools(tools, choice)


def _fn(**fn):
    return [{"type": "function", "function": fn}]


@pytest.mark.parametrize("tools,choice,param", [
    # a list that is not of {"type": "function", "function": {"name": ...}} objects is one
    # error about `tools` (as the HTTP API has always answered it)
    ({"type": "function"}, None, "tools"),
    (["get_weather"], None, "tools"),
    ([{"type": "code_interpreter"}], None, "tools"),
    ([{"type": "function"}], None, "tools"),
    ([{"type": "function", "function": "get_weather"}], None, "tools"),
    (_fn(description="no name"), None, "tools"),
    (_fn(name=""), None, "tools"),
    (_fn(name=7), None, "tools"),
    (_fn(name="has space"), None, "tools[0].function.name"),
    (_fn(name="x" * 65), None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    (_fn(name="f", description=3), None, "tools[0].function.description"),
    (_fn(name="f", parameters="{}"), None, "tools[0].function.parameters"),
    (_fn(name="f", parameters={"type": "string"}), None, "tools[0].function.parameters"),
    (TOOLS, "always", "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": 1}}, "tool_choice"),
    (TOOLS, {"type": "code", "function": {"name": "get_weather"}}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "launch"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([], "required", "tool_choice"),
    (None, NAMED, "tool_choice"),
])
def test_check_tools_rejects(tools, choice, param):
    assert _error(tools, choice).param == param


def test_check_tools_messages_say_what_is_wrong():
    assert "launch" in _error(TOOLS, {"type": "function", "function": {"name": "launch"}}).message
    assert "requires tools" in _error(None, "required").message


# ---- prepare_conversation ----------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    if not MODEL.exists():
        pytest.skip(f"default model not cached at {MODEL}")
    return open_tokenizer(MODEL)


def test_template_knows_tools(smol):
    assert not template_knows_tools(None)
    assert not template_knows_tools(smol.chat_template)
    assert template_knows_tools(TOOL_TEMPLATE)
    assert not template_knows_tools("{{ tools }}")  # would drop the calls in the history


def test_tools_go_into_a_new_system_turn(smol):
    messages, tools = prepare_conversation(HISTORY[:1], TOOLS, "auto", smol.chat_template)
    assert tools is None and [m["role"] for m in messages] == ["system", "user"]
    system = messages[0]["content"]
    assert system.startswith("# Tools\n\nYou may call one or more functions")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.DOTALL).group(1).split("\n")
    assert [json.loads(line) for line in listed] == TOOLS  # one JSON object per line
    assert system.endswith('<tool_call>\n{"name": <function-name>, "arguments": '
                           '<args-json-object>}\n</tool_call>')
    assert "must call" not in system


def test_tools_follow_an_existing_system_message(smol):
    chat = [{"role": "system", "content": "Be brief."}, *HISTORY[:1]]
    messages, _ = prepare_conversation(chat, TOOLS, None, smol.chat_template)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert chat[0]["content"] == "Be brief."  # the caller's messages are untouched


def test_past_calls_and_results_become_hermes_text(smol):
    said = {**HISTORY[1], "content": "Let me check."}
    chat = [HISTORY[0], said, *HISTORY[2:], {"role": "user", "content": "Thanks"}]
    messages, _ = prepare_conversation(chat, TOOLS, "auto", smol.chat_template)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "user"]
    assert messages[2] == {"role": "assistant", "content": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
        "\n</tool_call>")}
    assert messages[3] == {"role": "user", "content": (
        "<tool_response>\n18C sunny\n</tool_response>\n"
        "<tool_response>\n22C cloudy\n</tool_response>")}
    assert all(isinstance(m["content"], str) for m in messages)
    assert not any("tool_calls" in m or "tool_call_id" in m for m in messages)


def test_null_content_and_unparsable_arguments(smol):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    chat = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    messages, _ = prepare_conversation(chat, None, None, smol.chat_template)
    assert messages[1]["content"] == '<tool_call>\n{"name": "f", "arguments": "{oops"}\n</tool_call>'


def test_tool_choice_none_hides_tools_but_keeps_history(smol):
    messages, tools = prepare_conversation(HISTORY, TOOLS, "none", smol.chat_template)
    assert tools is None
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert "<tools>" not in json.dumps(messages)
    assert "<tool_call>" in messages[1]["content"]


@pytest.mark.parametrize("choice,line", [
    ("required", "You must call at least one function."),
    (NAMED, 'You must call the function "get_weather".'),
])
def test_forced_choices_add_an_instruction(smol, choice, line):
    messages, _ = prepare_conversation(HISTORY[:1], TOOLS, choice, smol.chat_template)
    assert messages[0]["content"].endswith("</tool_call>\n\n" + line)


@pytest.mark.parametrize("choice", [None, "auto", "none", "required", NAMED])
def test_renders_through_the_default_template(smol, choice):
    chat = [*HISTORY, {"role": "user", "content": "And Oslo?"}]
    messages, tools = prepare_conversation(chat, TOOLS, choice, smol.chat_template)
    prompt = ChatTemplate(smol.chat_template).render(messages, tools=tools)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<tool_response>\n22C cloudy\n</tool_response><|im_end|>" in prompt
    assert ("# Tools" in prompt) == (choice != "none")
    with pytest.raises(TemplateError):  # the reason for all this: the raw history breaks it
        ChatTemplate(smol.chat_template).render(chat)


def test_renders_through_the_chatml_fallback():
    messages, tools = prepare_conversation(HISTORY, TOOLS, "auto", None)
    prompt = ChatTemplate(None).render(messages, tools=tools)
    assert prompt.count('<tool_call>\n{"name": "get_weather"') == 2  # not rendered twice
    assert prompt.startswith("<|im_start|>system\n# Tools")


def test_a_template_that_knows_tools_gets_them_unchanged():
    messages, tools = prepare_conversation(HISTORY, TOOLS, "auto", TOOL_TEMPLATE)
    assert messages == HISTORY and tools == TOOLS
    assert messages[1]["content"] is None
    prompt = ChatTemplate(TOOL_TEMPLATE).render(messages, tools=tools)
    assert prompt.startswith("<tools>") and "[get_weather][get_weather]" in prompt
    messages, tools = prepare_conversation(HISTORY, TOOLS, "none", TOOL_TEMPLATE)
    assert messages == HISTORY and tools is None


# ---- parse_tool_calls --------------------------------------------------------------------

_ID = re.compile(r"call_[0-9a-f]{24}")


def test_parse_single_call():
    [call] = parse_tool_calls(['\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'],
                              TOOLS)
    assert _ID.fullmatch(call["id"]) and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_parse_parallel_calls_and_argument_forms():
    calls = parse_tool_calls([
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}',  # JSON string
        '{"name": "get_time"}',                                              # absent
    ], TOOLS)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"}, {"city": "Rome"}, {}]
    assert all(isinstance(c["function"]["arguments"], str) for c in calls)
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == 3 and all(_ID.fullmatch(i) for i in ids)


def test_parse_without_tools_accepts_any_name():
    assert parse_tool_calls(['{"name": "anything", "arguments": {}}'], None)


@pytest.mark.parametrize("block", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # truncated
    "not json",
    '["get_weather"]',
    '{"arguments": {}}',
    '{"name": 3, "arguments": {}}',
    '{"name": "", "arguments": {}}',
    '{"name": "launch_rockets", "arguments": {}}',
    '{"name": "get_weather", "arguments": [1]}',
    '{"name": "get_weather", "arguments": "{bad"}',
    '{"name": "get_weather", "arguments": "[1]"}',
])
def test_parse_malformed_gives_none(block):
    assert parse_tool_calls([block], TOOLS) is None
    assert parse_tool_calls(['{"name": "get_time", "arguments": {}}', block], TOOLS) is None


def test_parse_nothing_gives_none():
    assert parse_tool_calls([], TOOLS) is None


# ---- tool_call_grammar -------------------------------------------------------------------

DEFS = _fn(name="book", parameters={
    "type": "object", "properties": {"who": {"$ref": "#/$defs/person"}}, "required": ["who"],
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}},
                         "required": ["name"]}}})


def _block(name, args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_no_grammar_unless_forced():
    assert tool_call_grammar(TOOLS, "auto") is None
    assert tool_call_grammar(TOOLS, "none") is None
    assert tool_call_grammar(TOOLS, None) is None
    assert tool_call_grammar(None, "required") is None


@pytest.mark.parametrize("tools,choice", [(TOOLS, "required"), (TOOLS, NAMED),
                                          (DEFS, "required")])
def test_grammars_compile(tools, choice):
    lark = tool_call_grammar(tools, choice)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


@pytest.fixture(scope="module")
def lltok(smol):
    # llguidance.hf.from_tokenizer wants a transformers tokenizer and only serializes its
    # `tokenizers` backend; ours is that backend already.
    return llguidance.LLTokenizer(smol._hf.to_str(), eos_token=smol.eos_id)


def _accepts(smol, lltok, lark: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(lark),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(smol.encode(text, add_bos=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


PARIS = _block("get_weather", {"city": "Paris", "unit": "c"})
ROME = _block("get_weather", {"city": "Rome"})


@pytest.mark.parametrize("choice,text,ok", [
    ("required", PARIS, True),
    ("required", _block("get_time", {}), True),
    ("required", PARIS + "\n" + ROME, False),                      # one call per turn
    ("required", _block("get_wether", {"city": "Paris"}), False),  # unknown name
    ("required", _block("get_weather", {"unit": "c"}), False),     # required argument missing
    ("required", _block("get_weather", {"city": 3}), False),       # wrong argument type
    ("required", _block("get_weather", {"city": "x", "unit": "k"}), False),
    ("required", "Sure! " + PARIS, False),                         # no text around the calls
    ("required", PARIS[:-3], False),                               # unfinished: not accepting
    ("required", "", False),
    (NAMED, PARIS, True),
    (NAMED, _block("get_time", {}), False),                        # not the named function
    (NAMED, PARIS + "\n" + ROME, False),                           # exactly one call
])
def test_grammar_constrains_the_default_tokenizer(smol, lltok, choice, text, ok):
    assert _accepts(smol, lltok, tool_call_grammar(TOOLS, choice), text) is ok


def test_grammar_follows_refs_into_hoisted_defs(smol, lltok):
    lark = tool_call_grammar(DEFS, "required")
    assert _accepts(smol, lltok, lark, _block("book", {"who": {"name": "Ada"}}))
    assert not _accepts(smol, lltok, lark, _block("book", {"who": {"age": 3}}))


def test_grammar_output_parses_back(smol, lltok):
    assert _accepts(smol, lltok, tool_call_grammar(TOOLS, "required"), PARIS)
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", PARIS, re.DOTALL)
    calls = parse_tool_calls(blocks, TOOLS)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]
