"""/v1/embeddings end to end with the openai SDK on the default model (mean pooling):
shapes, normalisation, determinism, dimensions, base64, token-id input, that a sentence
is nearer its paraphrase than an unrelated one, and the bad inputs."""
import base64

import httpx
import numpy as np
import pytest

from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
TEXTS = ["The cat sat on the mat.", "A cat was sitting on the rug.",
         "Stock markets fell sharply on Tuesday."]


def test_shapes_norms_and_meaning(agent_server):
    client = agent_server.client()
    reply = client.embeddings.create(model="m", input=TEXTS)
    vectors = np.array([d.embedding for d in reply.data])
    assert [d.index for d in reply.data] == [0, 1, 2] and vectors.shape == (3, 576)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2] and sims[0, 1] > sims[1, 2]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 3
    alone = client.embeddings.create(model="m", input=TEXTS[0]).data[0].embedding
    # batched or not, the same up to the kernels' rounding (a batch's rows take other paths)
    assert np.dot(alone, vectors[0]) > 0.9999
    ids = httpx.post(agent_server.url + "/tokenize", headers=agent_server.headers(),
                     json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model="m", input=[ids]).data[0].embedding
    assert np.dot(by_ids, alone) > 0.9999


def test_dimensions_and_base64(agent_server):
    r = httpx.post(agent_server.url + "/v1/embeddings", headers=agent_server.headers(),
                   json={"input": TEXTS[:1], "dimensions": 8, "encoding_format": "base64"})
    data = r.json()["data"][0]["embedding"]
    short = np.frombuffer(base64.b64decode(data), dtype="<f4")
    assert short.shape == (8,) and abs(np.linalg.norm(short) - 1) < 1e-5
    full = agent_server.client().embeddings.create(model="m", input=TEXTS[:1]).data[0].embedding
    cut = np.array(full[:8])
    assert np.allclose(short, cut / np.linalg.norm(cut), atol=1e-3)   # renormalised prefix


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": ""}, "input[0]"),
    ({"input": ["ok", 5]}, "input[1]"),
    ({"input": ["ok", "word " * 1200]}, "input[1]"),
    ({"input": [[1, 2, 10 ** 6]]}, "input[0]"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 100000}, "dimensions"),
])
def test_bad_input(agent_server, body, param):
    r = httpx.post(agent_server.url + "/v1/embeddings", headers=agent_server.headers(),
                   json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
