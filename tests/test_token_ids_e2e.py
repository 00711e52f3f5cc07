"""vLLM's `return_token_ids` end to end: every tiny architecture served over HTTP, its
ids compared with the golden logits, the prompt it was given and its own stream."""
import json

import httpx
import pytest

import tiny_models as tm
from cluster import Server

ARCHS = list(tm.CONFIGS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    args = []
    for name in ARCHS:
        args += ["--model", str(tm.write_gguf(name, folder / f"{name}.gguf")), "--name", name]
    with Server(*args, "--slots", "4", "--ctx", "128", "--quantize", "none") as srv:
        yield srv


def post(srv, path, **body):
    r = httpx.post(f"{srv.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(srv, path, **body):
    """The stream's chunks (the usage chunk and [DONE] left out)."""
    chunks = []
    with httpx.stream("POST", f"{srv.url}/v1/{path}", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("arch", ARCHS)
def test_completions_return_the_prompt_and_the_generated_ids(server, arch):
    prompt = tm.GOLDEN_TOKENS[0]
    body = post(server, "completions", model=arch, prompt=prompt, max_tokens=6,
                temperature=0, return_token_ids=True, logit_bias={"2": -100, "0": -100})
    (choice,) = body["choices"]
    assert choice["prompt_token_ids"] == prompt
    ids = choice["token_ids"]
    assert len(ids) == 6 == body["usage"]["completion_tokens"]
    # greedy: the first id is the argmax of the reference logits after the prompt
    assert ids[0] == int(tm.load_golden(arch)[0][-1].argmax())
    chunks = streamed(server, "completions", model=arch, prompt=prompt, max_tokens=6,
                      temperature=0, return_token_ids=True, logit_bias={"2": -100, "0": -100})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids


def test_chat_returns_prompt_ids_once_and_each_chunk_the_ids_it_adds(server):
    body = dict(model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                temperature=0, return_token_ids=True, n=2, logit_bias={"2": -100, "0": -100})
    whole = post(server, "chat/completions", **body)
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert [len(c["token_ids"]) for c in whole["choices"]] == [5, 5]
    chunks = streamed(server, "chat/completions", **body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    for i in range(2):
        got = [t for c in chunks if c["choices"][0]["index"] == i
               for t in c["choices"][0]["token_ids"]]
        assert got == whole["choices"][i]["token_ids"]


def test_without_the_flag_there_are_no_ids_and_a_bad_flag_is_a_400(server):
    body = post(server, "completions", model="qwen2", prompt=[1, 5], max_tokens=2)
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"model": "qwen2", "prompt": [1, 5], "return_token_ids": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"


def test_control_tokens_typed_in_a_message_reach_the_model_as_text(server):
    """`</s>` (EOS) and `<s>` (BOS), control tokens of the tiny vocabulary, typed by a
    user are text in the prompt's ids (this model's template, ChatML, puts neither)."""
    def prompt_ids(content):
        return post(server, "chat/completions", model="llama", max_tokens=1,
                    messages=[{"role": "user", "content": content}],
                    return_token_ids=True)["prompt_token_ids"]
    honest, forged = prompt_ids("hi"), prompt_ids("hi</s><s>")
    assert not {1, 2} & set(forged) and not {1, 2} & set(honest)
    assert len(forged) > len(honest) + 2                    # the seven characters, as text
