"""Tool calls, structured output, context capping, logprobs, n > 1 and /v1/completions,
end to end on the default model with the openai SDK."""
import json

import httpx
import openai
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    with Server("--slots", "8", "--ctx", "512") as srv:
        yield srv


def test_tools_round_trip_with_the_sdk(server):
    client = server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                           tool_choice="required", temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                            tool_choice="none", temperature=0, max_tokens=40)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_named_tool_choice_streams_tool_call_deltas(server):
    chunks = list(server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Rome?"}], stream=True,
        temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(server, stream):
    kw = dict(model="m", messages=[{"role": "user", "content": "Describe a person as JSON."}],
              response_format={"type": "json_schema",
                               "json_schema": {"name": "person", "schema": SCHEMA}},
              temperature=0.7, seed=3, max_tokens=100)
    client = server.client()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kw) if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str)
    assert isinstance(value["age"], int)


def test_json_object_and_invalid_schema(server):
    client = server.client()
    r = client.chat.completions.create(
        model="m", max_tokens=80, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a person as JSON with the keys name "
                                              "and age."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="m", messages=QUESTION, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


def test_long_conversation_is_capped_keeping_system_and_last_turn(server):
    history = [{"role": "system", "content": "You answer in one word."}]
    for i in range(12):
        history += [{"role": "user", "content": f"Tell me fact {i} " + "about the sea " * 12},
                    {"role": "assistant", "content": "The sea is wide. " * 6}]
    history.append({"role": "user", "content": "What is the capital of France?"})
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": history, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["context_capped"] is True and body["usage"]["prompt_tokens"] < 512


def test_a_single_turn_too_long_even_capped_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "word " * 700}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in r.json()["error"]["message"]


def test_logprobs_and_top_logprobs(server):
    r = server.client().chat.completions.create(model="m", messages=QUESTION, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content).startswith("The capital of France")
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4   # greedy = top-1


def test_n_choices_run_in_parallel(server):
    r = server.client().chat.completions.create(model="m", messages=QUESTION, n=3, seed=7,
                                                max_tokens=12, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1          # distinct seeds
    assert r.usage.completion_tokens > 3 and r.usage.prompt_tokens == 37
    chunks = list(server.client().chat.completions.create(
        model="m", messages=QUESTION, n=2, temperature=0, stream=True, max_tokens=8))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == texts[1] == "The capital of France is Paris."


def test_legacy_completions(server):
    client = server.client()
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=3,
                                  temperature=0, echo=True, logprobs=2)
    text = r.choices[0].text
    assert text.startswith("The capital of France is") and len(text) > 24
    assert r.object == "text_completion" and r.usage.completion_tokens == 3
    assert len(r.choices[0].logprobs.tokens) == 3
    ids = server.client().completions.create(model="m", prompt=[504, 3575, 282], max_tokens=2,
                                             temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.choices[0].text
    stream = list(client.completions.create(model="m", prompt="One, two, three,",
                                            max_tokens=20, temperature=0, stream=True,
                                            stop=[" six"]))
    joined = "".join(c.choices[0].text for c in stream if c.choices)
    assert " six" not in joined and stream[-1].choices[0].finish_reason in ("stop", "length")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


THINK_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")


def test_a_template_that_opens_think_starts_the_reply_as_reasoning(tmp_path):
    import tiny_models as tm
    path = tm.write_gguf("qwen2", tmp_path / "thinker.gguf", chat_template=THINK_TEMPLATE)
    with Server("--model", str(path), "--name", "thinker", "--slots", "2",
                "--ctx", "128") as srv:
        client = srv.client()
        kw = dict(model="thinker", messages=[{"role": "user", "content": "hi"}],
                  max_tokens=12, temperature=0, logit_bias={"2": -100, "0": -100})
        message = client.chat.completions.create(**kw).choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert reasoning and message.model_extra["reasoning"] == reasoning
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw)
                  if c.choices]
        streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        assert streamed == reasoning and not any(d.content for d in deltas[1:])
