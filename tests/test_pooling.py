"""Embedding requests in the scheduler, with a fake model whose hidden state at a position
is the one-hot of the token there: pooled over the whole prompt across chunks, no decode,
beside generating requests."""
import numpy as np
import pytest

from pantheon.worker.sampler import SamplingParams
from pantheon.worker.scheduler import Request, Scheduler

V = 8


class PoolingFake:
    """Logits for (last token + 1) % V; each pooled span's vector is the sum (mean) or the
    last of the one-hots of its tokens."""

    def __init__(self):
        self.spans, self.last = [], []

    def __call__(self, tokens, spans):
        self.spans.append(list(spans))
        rows, offset, self.last = [], 0, []
        for i, s in enumerate(spans):
            mine = tokens[offset:offset + s.n]
            offset += s.n
            if s.logits:
                row = np.zeros(V, np.float32)
                row[(mine[-1] + 1) % V] = 1.0
                rows.append(row)
            if s.pool:
                hot = np.eye(V, dtype=np.float32)[mine]
                self.last.append((i, hot.sum(0) if s.pool == "mean" else hot[-1]))
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)

    def pooled(self):
        return self.last


def run(sched, limit=100):
    outs = {}
    for _ in range(limit):
        if not sched.active():
            break
        for out in sched.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


@pytest.mark.parametrize("pooling,want", [("mean", [0, .5, .25, .25, 0, 0, 0, 0]),
                                          ("last", [0, 0, 0, 1, 0, 0, 0, 0])])
def test_pooled_across_chunks_beside_a_generation(pooling, want):
    fake = PoolingFake()
    sched = Scheduler(fake, n_slots=2, ctx=32, prefill_chunk=3, pooled=fake.pooled)
    sched.add(Request("g", [1, 2], SamplingParams(temperature=0), max_tokens=3))
    sched.add(Request("e", [1, 2, 1, 3], max_tokens=1, pooling=pooling))
    outs = run(sched)
    (embedded,) = outs["e"]
    assert embedded.finish == "stop" and embedded.tokens == [] and embedded.completion_tokens == 0
    assert np.allclose(embedded.embedding, want)
    assert [t for o in outs["g"] for t in o.tokens] == [3, 4, 5]
    assert not any(s.logits for step in fake.spans for s in step if s.pool)
    assert sched.free_slots() == 2


def test_mean_pooling_reuses_no_warm_prefix():
    fake = PoolingFake()
    sched = Scheduler(fake, n_slots=1, ctx=32, pooled=fake.pooled)
    sched.add(Request("a", [1, 2, 3], max_tokens=1, pooling="mean"))
    run(sched)
    sched.add(Request("b", [1, 2, 3, 4], max_tokens=1, pooling="mean"))
    (out,) = run(sched)["b"]
    assert out.cached_tokens == 0 and np.allclose(out.embedding, [0, .25, .25, .25, .25, 0, 0, 0])
    sched.add(Request("c", [1, 2, 3, 4, 5], max_tokens=1, pooling="last"))
    (out,) = run(sched)["c"]
    assert out.cached_tokens == 4 and np.allclose(out.embedding, np.eye(V)[5])


def test_pooling_needs_a_model_that_pools():
    sched = Scheduler(PoolingFake(), n_slots=1, ctx=32)
    with pytest.raises(ValueError):
        sched.add(Request("a", [1, 2], pooling="mean"))


def test_the_wire_carries_pooling_and_the_embedding():
    from pantheon.common import limits as lim
    from pantheon.common import protocol as p
    gen = p.Generate("r", "m", [1, 2], p.Sampling(), 1, pooling="mean")
    assert p.decode(p.encode(gen)) == gen
    out = p.Outputs([p.Tokens("r", [], "stop", 2, 0, 0, [], [0.25, -1.5, 3.0])])
    assert p.decode(p.encode(out), lim.FROM_WORKER) == out
    with pytest.raises(p.ProtocolError):            # bounded like every string field
        p.decode(p.encode(p.Generate("r", "m", [1], p.Sampling(), 1, pooling="x" * 9)))
    with pytest.raises(p.ProtocolError):            # floats, nothing else
        p.decode(p.encode(p.Tokens("r", [], "stop", embedding=["a"])))
