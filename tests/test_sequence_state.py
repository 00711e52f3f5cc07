"""worker/sequence_state.py, and the scheduler over a state that cannot be cut.

A fake recurrent model keeps one running hash per slot in a RecurrentState (the
shape of a delta-rule layer's state: fixed size, valid at one length): a state
resumed at any other length raises, a wrongly resumed one changes the reply. Forks
(n > 1), session turns, retries and the host prefix cache must all give the reply
of a fresh slot.
"""
from __future__ import annotations

import numpy as np
import pytest

from pantheon.worker.prefix_cache import PrefixCache
from pantheon.worker.sampler import SamplingParams
from pantheon.worker.scheduler import Request, Scheduler
from pantheon.worker.sequence_state import KVState, RecurrentState, SequenceState, StateError

V = 97
GREEDY = SamplingParams(temperature=0)


class RecurrentModel:
    def __init__(self, n_slots: int):
        self.layer = RecurrentState(n_slots, {"h": (2,)}, np, dtype=np.int64)
        self.state = SequenceState([self.layer], n_slots, 256)
        self.fed = 0

    def __call__(self, tokens, spans):
        rows, offset = [], 0
        for s in spans:
            self.layer.begin(s.slot, s.start)
            h = self.layer.arrays["h"][s.slot]
            for t in tokens[offset:offset + s.n]:
                h[0] = (h[0] * 31 + int(t) + 1) % 1_000_003
                h[1] += 1
            self.layer.absorbed(s.slot, s.n)
            offset += s.n
            self.fed += s.n
            if s.logits:
                row = np.zeros(V, np.float32)
                row[int(h[0]) % V] = 1.0
                rows.append(row)
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)


def run(sched, *reqs):
    for r in reqs:
        sched.add(r)
    outs, last = {r.id: [] for r in reqs}, {}
    while sched.active():
        for o in sched.step():
            outs[o.request_id] += o.tokens
            last[o.request_id] = o
    return outs, last


def fresh(prompt, n=6):
    model = RecurrentModel(1)
    return run(Scheduler(model, 1, ctx=256), Request("x", prompt, GREEDY, n))[0]["x"]


PROMPT = list(range(3, 33))                  # 30 tokens


def scheduler(n_slots, cache=None, chunk=64):
    model = RecurrentModel(n_slots)
    return model, Scheduler(model, n_slots, ctx=256, prefill_chunk=chunk, kv=model.state,
                            cache=cache)


@pytest.mark.parametrize("chunk", [64, 7])
def test_forks_copy_the_state_at_the_fork_length(chunk):
    model, sched = scheduler(3, chunk=chunk)
    assert not model.state.truncatable
    outs, last = run(sched, *(Request(str(i), PROMPT, GREEDY, 6) for i in range(3)))
    assert all(o == fresh(PROMPT) for o in outs.values())
    assert sorted(o.cached_tokens for o in last.values()) == [0, 29, 29]
    assert model.fed == len(PROMPT) + 2 + 3 * 5          # one prefill, two last tokens, decodes


def test_a_session_turn_resumes_and_a_retry_starts_over():
    model, sched = scheduler(1)
    reply = run(sched, Request("a", PROMPT, GREEDY, 4, session_id="s"))[0]["a"]
    turn = PROMPT + reply + [40, 41]
    outs, last = run(sched, Request("b", turn, GREEDY, 6, session_id="s"))
    assert outs["b"] == fresh(turn) and last["b"].cached_tokens == len(PROMPT) + 3
    # the slot now holds more than the prompt: a cut would be needed, so nothing is reused
    outs, last = run(sched, Request("c", PROMPT, GREEDY, 6))
    assert outs["c"] == fresh(PROMPT) and last["c"].cached_tokens == 0


def test_the_host_cache_restores_only_whole_states():
    model, sched = scheduler(1, cache=PrefixCache(1 << 20))
    reply = run(sched, Request("a", PROMPT, GREEDY, 4, session_id="s"))[0]["a"]
    run(sched, Request("other", [50] * 20, GREEDY, 3))     # evicts the session to the host
    assert sched.cache.stats()["entries"] == 1
    turn = PROMPT + reply + [7]
    outs, last = run(sched, Request("b", turn, GREEDY, 5, session_id="s"))
    assert outs["b"] == fresh(turn, 5) and last["b"].cached_tokens == len(PROMPT) + 3
    outs, last = run(sched, Request("c", PROMPT[:20] + [9, 9], GREEDY, 5))   # a cut: refused
    assert outs["c"] == fresh(PROMPT[:20] + [9, 9], 5) and last["c"].cached_tokens == 0


def test_recurrent_state_refuses_other_lengths_and_kv_state_cuts_anywhere():
    layer = RecurrentState(2, {"s": (2, 3), "conv": (3, 4)}, np)
    state = SequenceState([layer, KVState(2, 1, 8, 4, np, np.float32)], 2, 8)
    layer.begin(0, 0)
    layer.arrays["s"][0] = 1.5
    layer.absorbed(0, 5)
    with pytest.raises(StateError, match="5 positions, not 4"):
        state.save(0, 4)
    with pytest.raises(StateError):
        state.copy_prefix(0, 1, 3)
    with pytest.raises(StateError):
        layer.begin(0, 3)
    saved, nbytes = state.save(0, 5)
    assert nbytes == (6 + 12) * 4 + 2 * 5 * 4 * 4
    state.copy_prefix(0, 1, 5)
    assert layer.length[1] == 5 and (layer.arrays["s"][1] == 1.5).all()
    layer.begin(0, 0)                                       # a new sequence clears the slot
    assert (layer.arrays["s"][0] == 0).all() and layer.length[0] == 0
    assert state.restore(0, saved) == 5 and (layer.arrays["s"][0] == 1.5).all()
    assert state.nbytes == layer.nbytes + 2 * 2 * 8 * 4 * 4


def test_the_host_cache_prefers_a_whole_state_to_a_longer_cut():
    """Two stored states: one shares more of the prompt but would need a cut, the other is
    shorter and whole. Only the whole one can be resumed, so it is the one chosen."""
    cache = PrefixCache(1 << 20)
    model, sched = scheduler(1, cache=cache)
    reply = run(sched, Request("a", PROMPT[:20], GREEDY, 3))[0]["a"]
    held = PROMPT[:20] + reply[:2]                         # what "a" left: 22 tokens
    run(sched, Request("c", [50] * 20, GREEDY, 3))         # "a" goes to the host
    outs, last = run(sched, Request("b", held + [60] * 10, GREEDY, 3))
    assert last["b"].cached_tokens == 22                   # "a" came back, then grew
    run(sched, Request("e", [51] * 20, GREEDY, 3))         # "b" goes to the host
    assert {len(e.tokens) for e in cache.entries.values()} >= {22, 34}
    prompt = held + [60] * 5 + [70]                        # 27 shared with "b": a cut
    outs, last = run(sched, Request("d", prompt, GREEDY, 5))
    assert last["d"].cached_tokens == 22 and outs["d"] == fresh(prompt, 5)


def test_a_failed_step_leaves_nothing_to_resume():
    """A step that fails after the state moved on: the slot's history no longer describes
    its state, so the session's next turn starts over instead of resuming it."""
    model, sched = scheduler(1)
    reply = run(sched, Request("a", PROMPT, GREEDY, 3, session_id="s"))[0]["a"]

    def fail_after_the_state_moved(tokens, spans):
        model(tokens, spans)
        raise RuntimeError("the device went away")
    sched.forward = fail_after_the_state_moved
    sched.add(Request("b", PROMPT + reply + [1, 2, 3], GREEDY, 3, session_id="s"))
    with pytest.raises(RuntimeError):
        sched.step()
    sched.abort("b")
    sched.forward = model
    turn = PROMPT + reply + [1, 2, 3, 4]
    outs, last = run(sched, Request("c", turn, GREEDY, 3, session_id="s"))
    assert last["c"].cached_tokens == 0 and outs["c"] == fresh(turn, 3)
