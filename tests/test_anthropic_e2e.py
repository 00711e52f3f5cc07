"""Anthropic's Messages API end to end: the `anthropic` SDK against a real server on the
default model (create, stream, tools round trip, stop sequences, count_tokens, x-api-key),
and its bad inputs answered in Anthropic's error shape."""
import json

import anthropic
import httpx
import pytest

from conftest import AGENT_KEY
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
KEY = AGENT_KEY
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# this SDK release has no sampling arguments of its own: they travel in the body
T0 = {"temperature": 0}
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def server(agent_server):
    return agent_server


@pytest.fixture(scope="module")
def client(agent_server):
    server = agent_server
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def test_create_and_stream_agree(client):
    kw = dict(model="m", max_tokens=12, extra_body=T0, messages=HELLO,
              system=[{"type": "text", "text": "You are terse."}])
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.id.startswith("msg_") and whole.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.usage.output_tokens >= 1
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds
    assert kinds.index("content_block_stop") < kinds.index("message_delta")


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(server, client):
    """The prompt is the template's generation prompt followed by the prefill, left
    open: the reply equals a greedy completion of exactly those tokens, and holds only
    the continuation (streamed as whole)."""
    prefill = "The capital of France is"
    kw = dict(model="m", max_tokens=6, extra_body=T0, messages=HELLO + [
        {"role": "assistant", "content": [{"type": "text", "text": prefill}]}])
    whole = client.messages.create(**kw)
    text = whole.content[0].text
    with client.messages.stream(**kw) as stream:
        assert stream.get_final_message().content[0].text == text
    auth = {"Authorization": f"Bearer {KEY}"}

    def tokens(**body):
        r = httpx.post(server.url + "/tokenize", headers=auth, json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    ids = tokens(messages=HELLO) + tokens(prompt=prefill, add_special_tokens=False)
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == len(ids)
    assert client.messages.count_tokens(model="m", messages=kw["messages"]).input_tokens \
        == len(ids)
    done = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60, json={
        "prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    assert done["choices"][0]["text"] == text and not text.startswith(prefill)


def test_tool_use_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model="m", max_tokens=60, extra_body=T0, messages=messages,
                                   tools=[WEATHER], tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input["city"], str)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "18 C and sunny"}]}]
    second = client.messages.create(model="m", max_tokens=10, extra_body=T0,
                                    messages=messages, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]


def test_streamed_tool_use_sends_input_json(client):
    with client.messages.stream(model="m", max_tokens=60, extra_body=T0, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}]) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert deltas and "city" in json.loads("".join(deltas))
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].input == json.loads("".join(deltas))


def test_stop_sequence_is_named(client):
    reply = client.messages.create(model="m", max_tokens=60, extra_body=T0, messages=HELLO,
                                   stop_sequences=["zzz", "e"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "e"
    assert "e" not in "".join(b.text for b in reply.content)


def test_count_tokens_matches_usage(client):
    kw = dict(model="m", messages=HELLO, tools=[WEATHER])
    counted = client.messages.count_tokens(**kw).input_tokens
    reply = client.messages.create(max_tokens=1, **kw)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert counted > client.messages.count_tokens(model="m", messages=HELLO).input_tokens


def test_keys_bearer_and_x_api_key(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="m", max_tokens=2, messages=HELLO)
    assert info.value.body["type"] == "authentication_error" or \
        info.value.response.json()["error"]["type"] == "authentication_error"
    ok = httpx.post(server.url + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"},
                    json={"max_tokens": 2, "messages": HELLO}, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"


BAD = [
    ({"messages": HELLO}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]}, "image"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, "toolu_nope"),
    ({"max_tokens": 5, "temperature": "hot", "messages": HELLO}, "temperature"),
    ({"max_tokens": 0, "messages": HELLO}, "max_tokens"),
    ({"max_tokens": 5, "system": 3, "messages": HELLO}, "system"),
    ({"max_tokens": 5, "stop_sequences": "x", "messages": HELLO}, "stop_sequences"),
    ({"max_tokens": 5, "tools": [{"name": "f"}], "messages": HELLO}, "input_schema"),
    ({"max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER],
      "messages": HELLO}, "nope"),
    ({"max_tokens": 5, "thinking": {"type": "enabled"}, "messages": HELLO}, "budget_tokens"),
]


@pytest.mark.parametrize("body,named", BAD)
def test_bad_input_in_anthropics_shape(server, body, named):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json=body,
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert named in err["error"]["message"]


def test_sdk_raises_bad_request_and_the_server_lives_on(client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="m", messages=[{"role": "user", "content": 5}])
    assert client.messages.create(model="m", max_tokens=2, messages=HELLO).content


def test_langchain_chat_anthropic(server):
    from langchain_anthropic import ChatAnthropic
    llm = ChatAnthropic(model="m", base_url=server.url, api_key=KEY, max_tokens=8,
                        temperature=0, max_retries=0)
    reply = llm.invoke("What is the capital of France?")
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    chunks = list(llm.stream("What is the capital of France?"))
    assert "".join(c.content if isinstance(c.content, str) else "".join(
        p.get("text", "") for p in c.content) for c in chunks) == reply.content
