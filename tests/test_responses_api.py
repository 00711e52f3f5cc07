"""frontend/responses_api.py, responses_renderer.py and response_store.py alone: input items → chat turns, the
emitter's events → output items and typed events (streamed equals whole), and the store's
ttl and size bound (a fake clock)."""
import json
from types import SimpleNamespace

import pytest

from pantheon.frontend.emitter import Event
from pantheon.frontend.errors import APIError
from pantheon.frontend.limits import RequestLimits
from pantheon.frontend.response_store import ResponseStore
from pantheon.frontend.responses_api import chat_for, parse_responses_request
from pantheon.frontend.responses_renderer import ResponsesRenderer

TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parse(**body):
    return parse_responses_request(json.dumps(body).encode())


def test_items_become_chat_turns():
    rr = parse(instructions="Be brief.", tools=[TOOL], tool_choice="auto", temperature=0.5,
               max_output_tokens=9, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "cold"}])
    req = chat_for(rr, [], "s", RequestLimits())
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[2]["content"] == "Looking."
    assert req.messages[2]["tool_calls"][0]["id"] == "call_1"
    assert req.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "cold"}
    assert req.tools[0]["function"]["name"] == "get_weather" and req.max_tokens == 9
    assert req.sampling.temperature == 0.5 and req.session_id == "s"


def test_earlier_turns_answer_a_call():
    rr = parse(input=[{"type": "function_call_output", "call_id": "call_9", "output": "1"}])
    with pytest.raises(APIError) as info:
        chat_for(rr, [], None, RequestLimits())
    assert info.value.param == "input[0].call_id"
    earlier = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_9", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}]
    assert chat_for(rr, earlier, None, RequestLimits()).messages[-1]["role"] == "tool"


def test_text_format_and_names():
    rr = parse(input="x", text={"format": {"type": "json_schema", "name": "p",
                                           "schema": {"type": "object"}}})
    assert rr.data["response_format"]["json_schema"]["name"] == "p"
    with pytest.raises(APIError) as info:
        chat_for(parse(input="x", top_p=5), [], None, RequestLimits())
    assert info.value.param == "top_p"


class Tok:
    def encode(self, text, add_bos=None):
        return text.split()


def fake(finish="stop"):
    return SimpleNamespace(prompt=[1] * 10, cached_tokens=4, completion_tokens=7,
                           finish_reason=finish)


def renderer(done=None):
    req = chat_for(parse(input="x", tools=[TOOL]), [], None, RequestLimits())
    return ResponsesRenderer("resp_1", SimpleNamespace(name="m", tokenizer=Tok()), req,
                             {"store": True}, done)


EVENTS = [Event("reasoning", "Let me "), Event("reasoning", "think."),
          Event("content", "Sure"), Event("content", "."),
          Event("tool", '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'),
          Event("tool", "broken")]


def test_stream_equals_whole_and_events_are_typed():
    stored = []
    r, gen = renderer(lambda response, turn: stored.append((response, turn))), fake()
    events = [e for body in r.opening([gen]) for e in body]
    for event in EVENTS:
        events += r.event(0, gen, event)
    events += r.closing(0, gen)
    final = events[-1]["response"]
    whole = renderer().whole([fake()], [EVENTS])
    strip = lambda out: [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                         for item in out]
    assert strip(final["output"]) == strip(whole["output"])
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call",
                                                    "message"]
    assert final["output"][3]["content"][0]["text"] == "<tool_call>broken</tool_call>"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3   # "Let me think."
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 4
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count(
        "response.output_item.done") == 4
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") \
        == "Sure.<tool_call>broken</tool_call>"
    wire = r.frame(events[:2]).decode()
    assert '"sequence_number":0' in wire and '"sequence_number":1' in wire
    (response, turn), = stored
    assert turn["content"] == "Sure.<tool_call>broken</tool_call>"
    assert turn["tool_calls"][0]["function"]["name"] == "get_weather"
    assert renderer().whole([fake("length")], [[]])["status"] == "incomplete"


def test_store_ttl_and_size():
    now = [0.0]
    store = ResponseStore(ttl_s=10, max_bytes=400, clock=lambda: now[0])
    assert store.put("a", {"x": "a" * 100}, [], "s")
    now[0] = 5
    assert store.put("b", {"x": "b" * 100}, [], "s")
    assert store.get("a") is not None
    now[0] = 11                       # a expired, b not
    assert store.get("a") is None and store.get("b") is not None
    assert store.put("c", {"x": "c" * 150}, [], "s") and store.put("d", {"x": "d" * 150}, [], "s")
    assert store.get("b") is None and store.bytes <= 400      # the oldest went first
    assert not store.put("e", {"x": "e" * 500}, [], "s")      # bigger than the store
    assert store.delete("c") and not store.delete("c")
    assert list(store.entries) == ["d"]


def test_parallel_tool_calls_reaches_the_chat_request():
    req = chat_for(parse(input="x", tools=[TOOL], parallel_tool_calls=False), [], None,
                   RequestLimits())
    assert req.parallel_tool_calls is False
    call = '\n{"name": "get_weather", "arguments": {"city": "%s"}}\n'
    out = renderer().whole([fake()], [[Event("tool", call % "Oslo"), Event("tool", call % "Rome")]])
    assert [json.loads(i["arguments"])["city"] for i in out["output"]] == ["Oslo", "Rome"]


def test_reasoning_effort_reaches_the_template_args():
    req = chat_for(parse(input="hi", reasoning={"effort": "minimal"}), [], None,
                   RequestLimits())
    assert req.template_args == {"reasoning_effort": "minimal", "enable_thinking": False}
    with pytest.raises(APIError) as exc:
        chat_for(parse(input="hi", reasoning={"effort": "extreme"}), [], None, RequestLimits())
    assert exc.value.param == "reasoning.effort" and "reasoning.effort must" in exc.value.message
