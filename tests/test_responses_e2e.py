"""OpenAI's Responses API end to end: the openai SDK's `responses` against a real server on
the default model (plain, streamed, a function call round trip, previous_response_id with
a warm prefix, json_schema output, retrieve / delete / cancel, the store's ttl), and its
bad inputs in OpenAI's error shape."""
import json
import httpx
import openai
import pytest

from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


@pytest.fixture
def server(agent_server):
    return agent_server


@pytest.fixture(scope="module")
def client(agent_server):
    return agent_server.client()


def test_create_and_stream_agree(client):
    kw = dict(model="m", input="What is the capital of France?", instructions="Be terse.",
              max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.output[0].type == "message" and whole.usage.output_tokens >= 1
    assert whole.instructions == "Be terse."
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text


def test_function_call_round_trip(client):
    first = client.responses.create(model="m", input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id.startswith("call_")
    # the whole conversation sent again, as a stateless client does
    second = client.responses.create(
        model="m", tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=10,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "18 C and sunny"}])
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]
    # and continued from the stored response instead
    third = client.responses.create(
        model="m", previous_response_id=first.id, temperature=0, max_output_tokens=10,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "18 C and sunny"}])
    assert third.output_text and third.previous_response_id == first.id


def test_streamed_function_call(client):
    events = list(client.responses.create(
        model="m", input="Weather in Rome?", tools=[WEATHER], stream=True, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments and "city" in json.loads(done.arguments)
    final = events[-1].response
    assert final.output[-1].type == "function_call" and final.output[-1].name == "get_weather"
    after = client.responses.create(      # a streamed response is stored as a whole one is
        model="m", previous_response_id=final.id, max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": final.output[-1].call_id,
                "output": "cold"}])
    assert after.status in ("completed", "incomplete") and after.output_text


def test_previous_response_id_reuses_the_prefix(client):
    first = client.responses.create(model="m", input="My name is Ada. Say hello.",
                                    instructions="You are a friendly assistant.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model="m", previous_response_id=first.id,
                                     instructions="You are a friendly assistant.",
                                     input="What is my name?", max_output_tokens=8,
                                     temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 4
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_input_items_are_listed_a_page_at_a_time(client):
    given = [{"role": "user", "content": "My name is Ada."},
             {"type": "message", "role": "assistant", "id": "msg_given",
              "content": [{"type": "output_text", "text": "Hello Ada."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Who am I?"}]}]
    first = client.responses.create(model="m", input=given, max_output_tokens=1)
    page = client.responses.input_items.list(first.id)          # newest first, as OpenAI
    assert [(i.type, i.role) for i in page.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert page.data[1].id == "msg_given" and page.data[1].content[0].text == "Hello Ada."
    assert page.data[2].content[0].type == "input_text"
    assert page.data[2].content[0].text == "My name is Ada." and not page.has_more
    ids = [i.id for i in page.data]
    assert len(set(ids)) == 3 and ids[0].startswith("msg_")
    pager = client.responses.input_items.list(first.id, limit=1, order="asc")
    assert [i.id for i in pager] == ids[::-1]                   # page by page, via after
    later = client.responses.input_items.list(first.id, after=ids[0])
    assert [i.id for i in later.data] == ids[1:]
    # a follow-up lists its own input only
    second = client.responses.create(model="m", previous_response_id=first.id,
                                     input="And now?", max_output_tokens=1)
    (item,) = client.responses.input_items.list(second.id).data
    assert item.content[0].text == "And now?"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(first.id, limit=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.responses.create(
        model="m", input="Describe a person as JSON.", max_output_tokens=80, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}})
    value = json.loads(reply.output_text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_retrieve_delete_and_store_false(client, server):
    kept = client.responses.create(model="m", input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(model="m", input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="m", input="Hi", previous_response_id=unkept.id)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel(kept.id)


def test_cancel_a_running_response(client, server):
    stream = client.responses.create(model="m", input="Count from one to a thousand.",
                                     max_output_tokens=900, stream=True,
                                     extra_body={"ignore_eos": True})
    events = [next(iter(stream))]
    rid = events[0].response.id
    assert client.responses.retrieve(rid).status == "in_progress"
    assert client.responses.cancel(rid).status == "cancelled"
    events += list(stream)
    assert events[-1].type == "error" and events[-1].code == "response_cancelled"
    assert len([e for e in events if e.type == "response.output_text.delta"]) < 900
    with pytest.raises(openai.NotFoundError):    # not stored: it did not finish
        client.responses.cancel(rid)


BAD = [
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
     "input[0].call_id"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, 400, "temperature"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "background": True}, 400, "background"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input(server, body, status, param):
    r = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers(),
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
