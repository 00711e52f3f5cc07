"""The scheduler with a fake model: scripted tokens, no weights."""
import numpy as np
import pytest

from pantheon.worker.sampler import SamplingParams
from pantheon.worker.scheduler import Request, Scheduler, SlotState

V = 16
GREEDY = SamplingParams(temperature=0)


class FakeModel:
    """Logits that make greedy pick (last fed token + 1) % V; records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, tokens, spans):
        self.calls.append((tokens.tolist(), list(spans)))
        rows, offset = [], 0
        for s in spans:
            offset += s.n
            if s.logits:
                row = np.zeros(V, np.float32)
                row[(tokens[offset - 1] + 1) % V] = 1.0
                rows.append(row)
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)


def drain(sched, limit=200):
    got = {}
    finish = {}
    for _ in range(limit):
        if not sched.active():
            break
        for out in sched.step():
            got.setdefault(out.request_id, []).extend(out.tokens)
            if out.finish:
                finish[out.request_id] = out.finish
    return got, finish


def test_one_request_runs_to_length():
    model = FakeModel()
    sched = Scheduler(model, n_slots=2, ctx=64)
    sched.add(Request("a", [1, 2, 3], GREEDY, max_tokens=4))
    got, finish = drain(sched)
    assert got == {"a": [4, 5, 6, 7]} and finish == {"a": "length"}
    assert sched.free_slots() == 2


def test_stop_token_finishes_with_stop():
    sched = Scheduler(FakeModel(), n_slots=1, ctx=64)
    sched.add(Request("a", [1], GREEDY, max_tokens=50, stop_ids=frozenset({5})))
    got, finish = drain(sched)
    assert got["a"] == [2, 3, 4, 5] and finish["a"] == "stop"


def test_context_end_finishes_with_length():
    sched = Scheduler(FakeModel(), n_slots=1, ctx=6)
    sched.add(Request("a", [1, 2, 3], GREEDY, max_tokens=50))
    got, finish = drain(sched)
    assert len(got["a"]) == 3 and finish["a"] == "length"


def test_chunked_prefill_interleaves_with_decode():
    model = FakeModel()
    sched = Scheduler(model, n_slots=2, ctx=64, prefill_chunk=4)
    sched.add(Request("a", [1], GREEDY, max_tokens=20))
    sched.step()                                   # a is now decoding
    sched.add(Request("b", list(range(10)), GREEDY, max_tokens=2))
    model.calls.clear()
    for _ in range(3):
        sched.step()
    # every step: a's one decode token rides beside at most a 4-token chunk of b
    sizes = [[s.n for s in spans] for _, spans in model.calls]
    assert sizes == [[1, 4], [1, 4], [1, 2]]
    assert [s.logits for s in model.calls[0][1]] == [True, False]
    assert [s.start for s in model.calls[1][1]] == [2, 4]


def test_join_and_leave_between_steps():
    sched = Scheduler(FakeModel(), n_slots=2, ctx=64)
    sched.add(Request("a", [0], GREEDY, max_tokens=2))
    sched.add(Request("b", [8], GREEDY, max_tokens=5))
    sched.step(), sched.step()                     # a finishes on its second token
    assert sched.active() == 1 and sched.free_slots() == 1
    sched.add(Request("c", [3], GREEDY, max_tokens=1))
    got, finish = drain(sched)
    assert got["c"] == [4] and finish == {"b": "length", "c": "length"}


def test_slot_full_and_bad_requests_are_refused():
    sched = Scheduler(FakeModel(), n_slots=1, ctx=8)
    with pytest.raises(ValueError, match="empty"):
        sched.add(Request("x", [], GREEDY))
    with pytest.raises(ValueError, match="context"):
        sched.add(Request("x", list(range(8)), GREEDY))
    sched.add(Request("a", [1], GREEDY))
    with pytest.raises(ValueError, match="already"):
        sched.add(Request("a", [1], GREEDY))
    with pytest.raises(RuntimeError, match="no free slot"):
        sched.add(Request("b", [1], GREEDY))


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])
def test_abort_mid_prefill_and_mid_decode_frees_the_slot(steps_before_abort):
    sched = Scheduler(FakeModel(), n_slots=1, ctx=64, prefill_chunk=2)
    sched.add(Request("a", [1, 2, 3, 4, 5], GREEDY, max_tokens=50))
    for _ in range(steps_before_abort):
        sched.step()
    out = sched.abort("a")
    assert out.finish == "abort"
    assert sched.slots[0].state is SlotState.IDLE and sched.active() == 0
    assert sched.step() == [] and sched.abort("a") is None
    sched.add(Request("b", [9], GREEDY, max_tokens=1))      # the slot is reusable
    assert drain(sched)[0] == {"b": [10]}
