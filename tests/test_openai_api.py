import json

import pytest

from pantheon.common.protocol import Sampling

from pantheon.frontend.openai_api import (
    APIError, ChatRequest, chat_choice, chat_chunk, chat_response, completion_id, models_list,
    parse_chat_request, parse_completion_request, sse, sse_error, usage,
    usage_chunk,
)

USER = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    fields.setdefault("messages", USER)
    return json.dumps(fields).encode()


def raw(text: str) -> bytes:
    """A body with the user message and `text` spliced in as extra members (for NaN etc.)."""
    return ('{"messages": [{"role": "user", "content": "hi"}], ' + text + "}").encode()


# (case id, body, expected param, words the message must contain, expected status)
BAD = [
    ("not json", b"{nope", None, "not valid JSON", 400),
    ("empty body", b"", None, "not valid JSON", 400),
    ("bad utf-8", b'{"messages": "\xff"}', None, "not valid JSON", 400),
    ("deep nesting", b"[" * 100_000, None, "nests more than", 400),
    ("array body", b"[1, 2]", None, "JSON object", 400),
    ("messages missing", b'{"model": "m"}', "messages", "messages is required", 400),
    ("messages not list", body(messages="hi"), "messages", "non-empty list", 400),
    ("messages empty", body(messages=[]), "messages", "non-empty list", 400),
    ("message not object", body(messages=["hi"]), "messages[0]", "must be an object", 400),
    ("bad role", body(messages=USER * 2 + [{"role": "bot", "content": "x"}]),
     "messages[2].role", "messages[2].role must be one of", 400),
    ("missing role", body(messages=[{"content": "x"}]), "messages[0].role", "must be one of", 400),
    ("content number", body(messages=[{"role": "user", "content": 5}]),
     "messages[0].content", "string or a list of text content parts", 400),
    ("image part", body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[1].type", "only text content parts are supported", 400),
    ("part not object", body(messages=[{"role": "user", "content": ["a"]}]),
     "messages[0].content[0]", "content part object", 400),
    ("part text not str", body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     "messages[0].content[0].text", "must be a string", 400),
    ("user null content", body(messages=[{"role": "user", "content": None}]),
     "messages[0].content", "null only for an assistant", 400),
    ("assistant null no tools", body(messages=[{"role": "assistant"}]),
     "messages[0].content", "null only for an assistant", 400),
    ("tool content object", body(messages=[{"role": "tool", "content": {"a": 1}, "tool_call_id": 3}]),
     "messages[0].content", "string or a list", 400),
    ("tool_calls not list", body(messages=[{"role": "assistant", "content": None, "tool_calls": {}}]),
     "messages[0].tool_calls", "list of objects", 400),
    ("name not str", body(messages=[{"role": "user", "content": "x", "name": 1}]),
     "messages[0].name", "must be a string", 400),
    ("model not str", body(model=3), "model", "model must be a string", 400),
    ("temperature str", body(temperature="hot"), "temperature", "temperature must be a number", 400),
    ("temperature bool", body(temperature=True), "temperature", "temperature must be a number", 400),
    ("temperature high", body(temperature=2.5), "temperature", "[0, 2]", 400),
    ("temperature negative", body(temperature=-0.1), "temperature", "[0, 2]", 400),
    ("temperature NaN", raw('"temperature": NaN'), "temperature", "temperature must be", 400),
    ("top_p Infinity", raw('"top_p": Infinity'), "top_p", "top_p must be", 400),
    ("top_p zero", body(top_p=0), "top_p", "(0, 1]", 400),
    ("top_p above one", body(top_p=1.01), "top_p", "(0, 1]", 400),
    ("top_k float", body(top_k=2.0), "top_k", "top_k must be an integer", 400),
    ("top_k -2", body(top_k=-2), "top_k", ">= -1", 400),
    ("min_p high", body(min_p=1.5), "min_p", "[0, 1]", 400),
    ("presence low", body(presence_penalty=-2.5), "presence_penalty", "[-2, 2]", 400),
    ("frequency high", body(frequency_penalty=3), "frequency_penalty", "[-2, 2]", 400),
    ("frequency -Infinity", raw('"frequency_penalty": -Infinity'), "frequency_penalty", "must be", 400),
    ("repetition zero", body(repetition_penalty=0), "repetition_penalty", "(0, 10]", 400),
    ("repetition huge", body(repetition_penalty=11), "repetition_penalty", "(0, 10]", 400),
    ("max_tokens zero", body(max_tokens=0), "max_tokens", "integer >= 1", 400),
    ("max_tokens float", body(max_tokens=10.0), "max_tokens", "integer >= 1", 400),
    ("max_tokens bool", body(max_tokens=True), "max_tokens", "integer >= 1", 400),
    ("max_completion_tokens str", body(max_completion_tokens="5"), "max_completion_tokens",
     "integer >= 1", 400),
    ("seed float", body(seed=1.5), "seed", "seed must be an integer", 400),
    ("seed too big", body(seed=2**63), "seed", "absolute value", 400),
    ("logit_bias list", body(logit_bias=[1]), "logit_bias", "must be an object", 400),
    ("logit_bias word key", body(logit_bias={"abc": 1}), "logit_bias", "not a token id", 400),
    ("logit_bias negative key", body(logit_bias={"-1": 1}), "logit_bias", "not a token id", 400),
    ("logit_bias value range", body(logit_bias={"5": 101}), "logit_bias", "[-100, 100]", 400),
    ("logit_bias value str", body(logit_bias={"5": "1"}), "logit_bias", "[-100, 100]", 400),
    ("logit_bias NaN", raw('"logit_bias": {"5": NaN}'), "logit_bias", "[-100, 100]", 400),
    ("n too many", body(n=17), "n", "integer in [1, 16]", 400),
    ("n zero", body(n=0), "n", "integer in [1, 16]", 400),
    ("top_logprobs without logprobs", body(top_logprobs=2), "top_logprobs", "needs logprobs",
     400),
    ("top_logprobs too many", body(logprobs=True, top_logprobs=21), "top_logprobs",
     "[0, 20]", 400),
    ("logprobs not bool", body(logprobs=3), "logprobs", "boolean", 400),
    ("response_format not object", body(response_format="json"), "response_format", "object",
     400),
    ("stop number", body(stop=5), "stop", "stop must be", 400),
    ("stop list of numbers", body(stop=["a", 1]), "stop", "list of non-empty strings", 400),
    ("stop empty string", body(stop=""), "stop", "non-empty", 400),
    ("stop too many", body(stop=[str(i) for i in range(17)]), "stop", "at most 16", 400),
    ("stream str", body(stream="yes"), "stream", "stream must be a boolean", 400),
    ("stream_options without stream", body(stream_options={"include_usage": True}),
     "stream_options", "only allowed when stream is true", 400),
    ("stream_options not object", body(stream=True, stream_options=True),
     "stream_options", "must be an object", 400),
    ("include_usage not bool", body(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage", "must be a boolean", 400),
    ("session_id not str", body(session_id=5), "session_id", "session_id must be a string", 400),
    ("user not str", body(user=["u"]), "user", "user must be a string", 400),
    ("tools not list", body(tools={"type": "function"}), "tools", "tools must be a list", 400),
    ("tool wrong type", body(tools=[{"type": "retrieval"}]), "tools", "tools must be a list", 400),
    ("tool no name", body(tools=[{"type": "function", "function": {"description": "d"}}]),
     "tools", "tools must be a list", 400),
]


@pytest.mark.parametrize("case, data, param, words, status", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(case, data, param, words, status):
    with pytest.raises(APIError) as info:
        parse_chat_request(data)
    err = info.value
    assert err.status == status
    assert err.param == param
    assert words in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_n_logprobs_and_response_format_are_kept():
    req = parse_chat_request(body(n=3, logprobs=True, top_logprobs=5,
                                  response_format={"type": "json_object"}))
    assert (req.n, req.logprobs, req.top_logprobs) == (3, True, 5)
    assert req.response_format == {"type": "json_object"}


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]), ([1, 2, 3], [[1, 2, 3]]), (["a", "b"], ["a", "b"]),
    ([[1], [2, 3]], [[1], [2, 3]])])
def test_completion_prompts(prompt, prompts):
    req = parse_completion_request(json.dumps({"prompt": prompt, "echo": True,
                                               "logprobs": 2}).encode())
    assert req.prompts == prompts and req.echo and req.logprobs == 2 and req.max_tokens == 16


@pytest.mark.parametrize("extra, param", [
    ({"prompt": None}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [["x"]]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "suffix": "b"}, "suffix"), ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"), ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens")])
def test_bad_completion_requests(extra, param):
    with pytest.raises(APIError) as info:
        parse_completion_request(json.dumps(extra).encode())
    assert info.value.status == 400 and info.value.param == param


def test_minimal_request_defaults():
    req = parse_chat_request(body())
    assert req == ChatRequest(model=None, messages=USER, max_tokens=None)
    assert req.sampling == Sampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                    repetition_penalty=1.0, presence_penalty=0.0,
                                    frequency_penalty=0.0, logit_bias={}, seed=None)
    assert req.return_token_ids is False


def test_full_request_normalized():
    req = parse_chat_request(body(
        model="smol", temperature=0, top_p=0.9, top_k=-1, min_p=0.05, presence_penalty=1,
        frequency_penalty=-1.5, repetition_penalty=1.1, seed=-(2**63 - 1), n=1,
        logit_bias={"15": -100, "007": 2.5}, stop="END", stream=True,
        stream_options={"include_usage": True}, user="u1", max_tokens=50,
        max_completion_tokens=20, some_future_field={"x": 1}, tool_choice="auto"))
    assert req.model == "smol"
    assert req.max_tokens == 20                       # max_completion_tokens wins
    assert req.sampling.top_k == 0                    # -1 means off
    assert req.stop == ["END"]
    assert req.sampling.logit_bias == {15: -100.0, 7: 2.5}
    assert req.stream and req.include_usage
    assert req.user == "u1" and req.tool_choice == "auto"
    sampling = req.sampling                            # the wire's own type, validated once
    assert isinstance(sampling, Sampling)
    assert sampling.temperature == 0.0 and isinstance(sampling.temperature, float)
    assert isinstance(sampling.presence_penalty, float)
    assert sampling.seed == -(2**63 - 1)
    assert sampling.check(vocab_size=100) is sampling


def test_content_parts_flattened_and_roles():
    req = parse_chat_request(body(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "ann"},
    ]))
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "a\nb", "name": "ann"}]


def test_tool_round_trip_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = parse_chat_request(body(tools=tools, messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "tool", "content": [{"type": "text", "text": "43"}]},   # no tool_call_id: fine
    ]))
    assert req.messages[1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert req.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert req.messages[3] == {"role": "tool", "content": "43"}
    assert req.tools == tools


def test_stop_list_and_nulls_mean_absent():
    req = parse_chat_request(body(stop=["a", "b"], temperature=None, stream=None,
                                  stream_options=None, tools=[], seed=None, model=None))
    assert req.stop == ["a", "b"] and req.sampling.temperature == 1.0 and req.stream is False
    assert req.tools is None and req.sampling.seed is None


def test_ints_accepted_where_floats_expected():
    req = parse_chat_request(body(temperature=2, top_p=1, min_p=0))
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.min_p) == (2.0, 1.0, 0.0)


def test_session_id_body_then_header():
    assert parse_chat_request(body(session_id="b"), session_header="h").session_id == "b"
    assert parse_chat_request(body(), session_header="h").session_id == "h"
    assert parse_chat_request(body(), session_header=None).session_id is None
    assert parse_chat_request(body(), session_header="").session_id is None


def test_api_error_body_has_four_keys():
    err = APIError(404, "no such model", type="not_found_error", param="model",
                   code="model_not_found", headers={"Retry-After": "1"})
    assert err.body() == {"error": {"message": "no such model", "type": "not_found_error",
                                    "param": "model", "code": "model_not_found"}}
    assert set(APIError(500, "x").body()["error"]) == {"message", "type", "param", "code"}
    assert str(err) == "no such model" and err.status == 404 and err.headers == {"Retry-After": "1"}


def test_completion_id_unique():
    a, b = completion_id(), completion_id()
    assert a.startswith("chatcmpl-") and len(a) == len("chatcmpl-") + 32 and a != b


def test_chat_response_shape():
    r = chat_response("chatcmpl-1", 100, "smol", [chat_choice(0, "hello", "stop")],
                      usage(7, 3, 4))
    assert r == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 100, "model": "smol",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 4}}}
    with_reasoning = chat_response("i", 1, "m", [chat_choice(0, None, "length", "hmm")],
                                   usage(1, 1, 0))
    assert with_reasoning["choices"][0]["message"] == {
        "role": "assistant", "content": None, "reasoning_content": "hmm", "reasoning": "hmm"}
    assert with_reasoning["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chunk_shapes():
    c = chat_chunk("i", 5, "m", {"role": "assistant", "content": ""})
    assert c == {"id": "i", "object": "chat.completion.chunk", "created": 5, "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]}
    assert chat_chunk("i", 5, "m", {}, "stop")["choices"][0]["finish_reason"] == "stop"
    assert chat_chunk("i", 5, "m", {}, index=2)["choices"][0]["index"] == 2
    u = usage_chunk("i", 5, "m", 10, 2, cached_tokens=8)
    assert u["object"] == "chat.completion.chunk" and u["choices"] == []
    assert u["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                          "prompt_tokens_details": {"cached_tokens": 8}}


def test_sse_framing():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": 1, "b": [1, 2]}) == b'data: {"a":1,"b":[1,2]}\n\n'
    assert sse({"t": "héllo ✓"}) == 'data: {"t":"héllo ✓"}\n\n'.encode("utf-8")
    assert sse({"t": "a\nb"}).count(b"\n") == 2            # newlines inside JSON stay escaped


def test_sse_error():
    err = APIError(500, "worker died", type="server_error")
    event = sse_error(err)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == err.body()
    inner = {"message": "m", "type": "server_error", "param": None, "code": None}
    assert json.loads(sse_error(inner)[6:]) == {"error": inner}
    assert json.loads(sse_error({"error": inner})[6:]) == {"error": inner}


def test_models_list():
    assert models_list(["a", "b"], 9) == {"object": "list", "data": [
        {"id": "a", "object": "model", "created": 9, "owned_by": "pantheon"},
        {"id": "b", "object": "model", "created": 9, "owned_by": "pantheon"}]}
    assert models_list([], 9, owned_by="x") == {"object": "list", "data": []}


def test_usage_counts_each_prompt_once_and_its_cached_tokens_with_it():
    """n choices share their prompt (prefilled once): prompt and cached tokens per prompt,
    completion tokens per choice; cached never exceeds prompt."""
    from types import SimpleNamespace
    from pantheon.frontend.openai_api import counts
    a, b = [1] * 30, [2] * 10
    gens = [SimpleNamespace(prompt=a, completion_tokens=3, cached_tokens=29),
            SimpleNamespace(prompt=a, completion_tokens=4, cached_tokens=30),
            SimpleNamespace(prompt=b, completion_tokens=1, cached_tokens=0),
            SimpleNamespace(prompt=b, completion_tokens=2, cached_tokens=10)]
    assert counts(gens) == (40, 10, 29, None)
    assert counts(gens[:2]) == (30, 7, 29, None)



def test_parallel_tool_calls_is_a_boolean_defaulting_to_true():
    from pantheon.frontend.openai_api import chat_request
    messages = [{"role": "user", "content": "hi"}]
    assert chat_request({"messages": messages}).parallel_tool_calls is True
    assert chat_request({"messages": messages, "parallel_tool_calls": False}) \
        .parallel_tool_calls is False
    with pytest.raises(APIError) as info:
        chat_request({"messages": messages, "parallel_tool_calls": "no"})
    assert info.value.param == "parallel_tool_calls"


def test_reasoning_effort_and_template_kwargs_become_template_args():
    assert parse_chat_request(body()).template_args == {}
    req = parse_chat_request(body(reasoning_effort="none"))
    assert req.template_args == {"reasoning_effort": "none", "enable_thinking": False}
    req = parse_chat_request(body(reasoning_effort="high",
                                  chat_template_kwargs={"enable_thinking": False, "x": 1}))
    assert req.template_args == {"reasoning_effort": "high", "enable_thinking": False, "x": 1}
    for bad, param in (({"reasoning_effort": "max"}, "reasoning_effort"),
                       ({"chat_template_kwargs": []}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                       ({"continue_final_message": True}, "continue_final_message")):
        with pytest.raises(APIError) as exc:
            parse_chat_request(body(**bad))
        assert exc.value.status == 400 and exc.value.param == param, bad


def test_continue_final_message_makes_the_last_assistant_turn_a_prefill():
    req = parse_chat_request(body(messages=USER + [{"role": "assistant", "content": "Well,"}],
                                  continue_final_message=True))
    assert req.prefill == "Well," and req.messages == USER
