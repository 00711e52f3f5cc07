"""/tokenize, /detokenize and the prompt counters end to end on the default model: a
conversation's count equals chat's prompt_tokens, a round trip gives the text back, bad
inputs are 400s naming the field."""
import httpx
import pytest

from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
HELLO = [{"role": "user", "content": "Hello there"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def post(server, path, body):
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=30)


def test_prompt_round_trip(agent_server):
    r = post(agent_server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) == 2
    assert "".join(body["token_strs"]) == "Hello world" and body["max_model_len"] == 1024
    back = post(agent_server, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_conversation_count_equals_chats_prompt_tokens(agent_server, tools):
    extra = {"tools": tools} if tools else {}
    counted = post(agent_server, "/tokenize", {"messages": HELLO, **extra}).json()
    chat = agent_server.client().chat.completions.create(model="m", messages=HELLO,
                                                         max_tokens=1, **extra)
    assert counted["count"] == chat.usage.prompt_tokens
    responses = post(agent_server, "/v1/responses/input_tokens",
                     {"input": "Hello there", **({"tools": [
                         {"type": "function", **WEATHER["function"]}]} if tools else {})})
    assert responses.json() == {"object": "response.input_tokens",
                                "input_tokens": counted["count"]}
    bare = post(agent_server, "/tokenize", {"messages": HELLO, "add_generation_prompt": False})
    assert bare.json()["count"] < counted["count"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"prompt": "x", "messages": HELLO}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_input(agent_server, path, body, param):
    r = post(agent_server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
