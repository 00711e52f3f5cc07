"""frontend/anthropic_api.py alone: a Messages body → the chat request it becomes, and the
emitter's events → Anthropic's content blocks and stream events (a fake generation)."""
import json
from types import SimpleNamespace

import pytest

from pantheon.frontend.anthropic_api import MessagesRenderer, error_body, parse_messages_request
from pantheon.frontend.emitter import Emitter, Event
from pantheon.frontend.errors import APIError
from pantheon.frontend.limits import RequestLimits

TOOL = {"name": "get_weather", "input_schema": {"type": "object",
                                                "properties": {"city": {"type": "string"}}}}


def parse(**body):
    return parse_messages_request(json.dumps({"max_tokens": 8, **body}).encode(), None,
                                  RequestLimits())


def test_conversation_becomes_chat_turns():
    req, thinking = parse(system=[{"type": "text", "text": "Be brief."}], tools=[TOOL],
                          tool_choice={"type": "any"}, stop_sequences=["END"], top_k=5,
                          messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]}])
    assert thinking
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "user"]
    call = req.messages[2]["tool_calls"][0]
    assert req.messages[2]["content"] == "Let me look."
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {
        "city": "Paris"}
    assert req.messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert req.tool_choice == "required" and req.tools[0]["function"]["name"] == "get_weather"
    assert req.stop == ["END"] and req.sampling.top_k == 5 and req.max_tokens == 8


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": ["x", ""]},
     "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "messages[0].content[0]"),
])
def test_bad_bodies_name_the_anthropic_field(body, param):
    with pytest.raises(APIError) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == param


def test_error_shape():
    assert error_body(APIError(429, "busy")) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "busy"}}
    assert error_body(APIError(500, "x"))["error"]["type"] == "api_error"


def fake(finish="stop", stop_string=None):
    emitter = Emitter()
    emitter.stop_string = stop_string
    return SimpleNamespace(prompt=[1] * 10, cached_tokens=4, completion_tokens=7,
                           finish_reason=finish, emitter=emitter)


def renderer(thinking=True):
    req, _ = parse(messages=[{"role": "user", "content": "x"}], tools=[TOOL])
    model = SimpleNamespace(name="m", tokenizer=None)
    return MessagesRenderer(model, req, thinking)


EVENTS = [Event("reasoning", "Think"), Event("reasoning", "ing."), Event("content", "Sure."),
          Event("tool", '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')]


def test_stream_event_sequence():
    r, gen = renderer(), fake()
    frames = [r.opening([gen])[0]] + [r.event(0, gen, e) for e in EVENTS] + [r.closing(0, gen)]
    events = [e for frame in frames for e in frame]
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"]
    assert [d["index"] for n, d in events if n == "content_block_start"] == [0, 1, 2]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"] == {"input_tokens": 6, "output_tokens": 7,
                              "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}
    wire = r.frame(events[:1]).decode()
    assert wire.startswith("event: message_start\ndata: {") and wire.endswith("}\n\n")


def test_whole_message_blocks():
    body = renderer().whole([fake()], [EVENTS])
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][0]["thinking"] == "Thinking."
    assert body["content"][2]["input"] == {"city": "Oslo"}
    assert body["content"][2]["id"].startswith("toolu_") and body["stop_reason"] == "tool_use"
    hidden = renderer(thinking=False).whole([fake("stop", "END")], [EVENTS[:3]])
    assert [b["type"] for b in hidden["content"]] == ["text"]
    assert hidden["stop_reason"] == "stop_sequence" and hidden["stop_sequence"] == "END"
    assert renderer().whole([fake("length")], [[]])["stop_reason"] == "max_tokens"


def test_malformed_tool_block_is_text():
    r, gen = renderer(), fake()
    events = r.event(0, gen, Event("tool", "not json"))
    assert events[-1][1]["delta"] == {"type": "text_delta",
                                      "text": "<tool_call>not json</tool_call>"}


def test_disable_parallel_tool_use():
    one, _ = parse(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                   tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    many, _ = parse(messages=[{"role": "user", "content": "x"}], tools=[TOOL])
    assert one.parallel_tool_calls is False and many.parallel_tool_calls is True


def test_two_calls_in_one_turn_are_two_tool_use_blocks():
    call = '\n{"name": "get_weather", "arguments": {"city": "%s"}}\n'
    body = renderer().whole([fake()], [[Event("tool", call % "Oslo"),
                                        Event("tool", call % "Rome")]])
    assert [b["input"]["city"] for b in body["content"]] == ["Oslo", "Rome"]
    assert body["content"][0]["id"] != body["content"][1]["id"]


def test_a_final_assistant_message_is_a_prefill_and_thinking_reaches_the_template():
    req, _ = parse(messages=[{"role": "user", "content": "Count"},
                             {"role": "assistant", "content": [{"type": "text", "text": "1, 2,"}]}])
    assert req.prefill == "1, 2," and [m["role"] for m in req.messages] == ["user"]
    assert req.template_args == {}                     # thinking absent: the template's default
    req, _ = parse(messages=[{"role": "user", "content": "Weather?"}, {
        "role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                          "name": "get_weather", "input": {}}]}],
                   tools=[TOOL])
    assert req.prefill is None                         # a tool call is a finished turn
    for thinking, flag in (({"type": "disabled"}, False),
                           ({"type": "enabled", "budget_tokens": 64}, True)):
        req, shown = parse(messages=[{"role": "user", "content": "Hi"}], thinking=thinking)
        assert req.template_args == {"enable_thinking": flag} and shown is flag
