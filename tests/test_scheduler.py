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


# -- prefix reuse ----------------------------------------------------------------------
from pantheon.worker.prefix_cache import PrefixCache  # noqa: E402


class HistoryModel:
    """A fake whose next token depends on the whole KV history of the slot.

    It keeps the token at every KV position, like a real cache, so a wrongly
    reused or restored state changes the output. Also a fake KV store.
    """

    def __init__(self, n_slots):
        self.kv = [[] for _ in range(n_slots)]
        self.fed = 0                      # prompt tokens actually computed

    def __call__(self, tokens, spans):
        rows, offset = [], 0
        for s in spans:
            part = tokens[offset:offset + s.n].tolist()
            offset += s.n
            self.kv[s.slot][s.start:] = part
            self.fed += s.n
            if s.logits:
                row = np.zeros(V, np.float32)
                row[(sum(self.kv[s.slot]) * 7 + 3) % V] = 1.0
                rows.append(row)
        return np.stack(rows) if rows else np.zeros((0, V), np.float32)

    def save(self, slot, n):
        return list(self.kv[slot][:n]), 8 * n

    def restore(self, slot, state):
        self.kv[slot][:len(state)] = state
        return len(state)

    def copy_prefix(self, src, dst, n):
        self.kv[dst] = list(self.kv[src][:n])


def run(sched, req):
    sched.add(req)
    tokens, out = [], None
    while sched.active():
        for out in sched.step():
            tokens += out.tokens
    return tokens, out


def fresh(prompt, max_tokens=4):
    model = HistoryModel(1)
    return run(Scheduler(model, 1, ctx=256), Request("x", prompt, GREEDY, max_tokens))[0]


def test_session_turn_reuses_its_slot_and_skips_the_history():
    model = HistoryModel(2)
    sched = Scheduler(model, 2, ctx=256, kv=model, cache=PrefixCache(1 << 20))
    turn1 = list(range(40))
    reply, out = run(sched, Request("a", turn1, GREEDY, 4, session_id="s"))
    assert out.cached_tokens == 0
    run(sched, Request("b", [9] * 30, GREEDY, 2))            # someone else, other slot
    turn2 = turn1 + reply + [5, 6, 7]
    model.fed = 0
    got, out = run(sched, Request("c", turn2, GREEDY, 4, session_id="s"))
    assert out.cached_tokens == len(turn1) + len(reply) - 1   # the last reply token never fed
    assert model.fed == len(turn2) - out.cached_tokens + 3    # the rest, then 3 decode feeds
    assert got == fresh(turn2)


def test_shared_prefix_is_reused_without_a_session():
    model = HistoryModel(2)
    sched = Scheduler(model, 2, ctx=256, kv=model, cache=PrefixCache(1 << 20))
    system = list(range(100, 150))
    run(sched, Request("a", system + [1, 2, 3], GREEDY, 2))
    got, out = run(sched, Request("b", system + [4, 5], GREEDY, 3))
    assert out.cached_tokens == len(system)
    assert got == fresh(system + [4, 5], 3)


def test_evicted_state_goes_to_the_host_cache_and_comes_back():
    model = HistoryModel(1)                                  # one slot: every turn evicts
    cache = PrefixCache(1 << 20)
    sched = Scheduler(model, 1, ctx=256, kv=model, cache=cache)
    conv_a = list(range(50))
    reply_a, _ = run(sched, Request("a1", conv_a, GREEDY, 3, session_id="A"))
    run(sched, Request("b1", list(range(200, 260)), GREEDY, 3, session_id="B"))
    assert cache.stats()["entries"] == 1                      # A's state moved to the host
    turn2 = conv_a + reply_a + [7]
    got, out = run(sched, Request("a2", turn2, GREEDY, 3, session_id="A"))
    assert out.cached_tokens == len(conv_a) + len(reply_a) - 1
    assert cache.hits == 1 and got == fresh(turn2, 3)


def test_cache_miss_and_lru_eviction_under_budget():
    model = HistoryModel(1)
    cache = PrefixCache(budget_bytes=8 * 40 * 2)             # room for two 40-token states
    sched = Scheduler(model, 1, ctx=256, kv=model, cache=cache)
    convs = [[k * 1000 + i for i in range(39)] for k in range(1, 5)]
    for i, conv in enumerate(convs):
        run(sched, Request(f"r{i}", conv, GREEDY, 1))
    assert len(cache.entries) == 2 and cache.used <= cache.budget
    _, out = run(sched, Request("old", convs[0] + [1], GREEDY, 1))      # evicted: a miss
    assert out.cached_tokens == 0
    # the slot's own state (convs[3]) went to the host when "old" took the slot: a hit
    _, out = run(sched, Request("new", convs[3] + [1], GREEDY, 1))
    assert out.cached_tokens == 39


def test_reuse_never_skips_the_last_prompt_token():
    model = HistoryModel(1)
    sched = Scheduler(model, 1, ctx=256, kv=model, cache=PrefixCache(1 << 20))
    prompt = list(range(30))
    first, _ = run(sched, Request("a", prompt, GREEDY, 1))
    again, out = run(sched, Request("b", prompt, GREEDY, 1))          # a retried request
    assert out.cached_tokens == len(prompt) - 1 and again == first


# -- pacing prompt chunks beside running decodes ---------------------------------------
from pantheon.worker.scheduler import PrefillPacer  # noqa: E402


class TimedModel(FakeModel):
    """A step costs 10 time units plus 1 per prompt token, on a fake clock."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def __call__(self, tokens, spans):
        self.now += 10 + sum(s.n for s in spans if s.n > 1)
        return super().__call__(tokens, spans)


def test_pacer_shrinks_prompt_chunks_while_streams_decode():
    model = TimedModel()
    sched = Scheduler(model, 2, ctx=512, prefill_chunk=128, clock=lambda: model.now,
                      pacer=PrefillPacer(128, min_chunk=4, stall=1.5))
    sched.add(Request("a", list(range(100)), GREEDY, max_tokens=200))
    for _ in range(4):
        sched.step()                                  # a's prompt, then decode-only steps
    sched.add(Request("b", list(range(300)), GREEDY, max_tokens=1))
    model.calls.clear()
    for _ in range(6):
        sched.step()
    chunks = [n for _, spans in model.calls for n in [s.n for s in spans if s.n > 1]]
    # a mixed step (10 + chunk) stays within 1 + 1.5 decode steps (25), yet not tiny;
    # "b" alone (nothing decoding) would have taken 128 at once
    assert len(chunks) == 6 and all(10 <= n <= 15 for n in chunks), chunks


def test_pacer_uses_full_chunks_when_nothing_decodes():
    pacer = PrefillPacer(128, min_chunk=16, stall=1.5)
    pacer.record(0.05, n_decode=8, n_prompt=0)
    pacer.record(0.05 + 0.002 * 64, n_decode=8, n_prompt=64)
    assert pacer.budget(decoding=True) == int(1.5 * 0.05 / 0.002)
    assert pacer.budget(decoding=False) == 128
    pacer.record(10.0, n_decode=8, n_prompt=1)        # a hiccup moves the average, boundedly
    assert pacer.budget(decoding=True) >= 16


def test_a_prompt_that_fits_one_chunk_goes_whole_beside_decodes():
    model = TimedModel()
    sched = Scheduler(model, 2, ctx=512, prefill_chunk=128, clock=lambda: model.now,
                      pacer=PrefillPacer(128, min_chunk=4, stall=1.0))
    sched.add(Request("a", list(range(100)), GREEDY, max_tokens=200))
    for _ in range(4):
        sched.step()
    sched.pacer.token_s = 1.0                         # pacing would allow only 10 tokens
    sched.add(Request("b", list(range(120)), GREEDY, max_tokens=1))
    model.calls.clear()
    sched.step()
    assert [s.n for s in model.calls[0][1]] == [1, 120]


def test_logprobs_are_the_models_own_distribution():
    from pantheon.worker.sampler import Sampler, SequenceSampler
    logits = np.array([1.0, 3.0, 2.0, -1.0], np.float32)
    seq = SequenceSampler(SamplingParams(temperature=0, logit_bias={2: 5.0}), [], logprobs=2)
    [(token, (lp, top))] = Sampler(np).sample(logits[None].copy(), [seq])
    ref = logits - np.log(np.exp(logits).sum())
    assert token == 2 and abs(lp - ref[2]) < 1e-6            # the bias chose it, not the model
    assert [t[0] for t in top] == [1, 2] and abs(top[0][1] - ref[1]) < 1e-6
    sched = Scheduler(FakeModel(), 1, ctx=64)
    sched.add(Request("a", [3], GREEDY, max_tokens=2, logprobs=1))
    out = sched.step()[0]
    assert out.tokens == [4] and out.logprobs[0][1][0][0] == 4 and out.logprobs[0][0] < 0


def test_parallel_requests_with_one_prompt_prefill_it_once():
    """n > 1: the later copies wait for the first one's prefill, then copy its KV."""
    model = HistoryModel(3)
    sched = Scheduler(model, 3, ctx=256, prefill_chunk=16, kv=model)
    prompt = list(range(100, 160))
    for i in range(3):
        sched.add(Request(f"r{i}", prompt, SamplingParams(temperature=0), 4))
    assert [s.state for s in sched.slots].count(SlotState.WAIT) == 2
    got, cached = {}, {}
    while sched.active():
        for out in sched.step():
            got.setdefault(out.request_id, []).extend(out.tokens)
            cached[out.request_id] = out.cached_tokens
    assert model.fed == 60 + 2 * 1 + 3 * 3      # one prefill, two last tokens, 3x3 decodes
    assert cached == {"r0": 0, "r1": 59, "r2": 59}
    assert got["r0"] == got["r1"] == got["r2"] == fresh(prompt)


def test_a_waiting_copy_computes_its_prompt_when_the_source_is_aborted():
    model = HistoryModel(2)
    sched = Scheduler(model, 2, ctx=256, prefill_chunk=16, kv=model)
    prompt = list(range(200, 250))
    sched.add(Request("a", prompt, GREEDY, 3))
    sched.add(Request("b", prompt, GREEDY, 3))
    sched.step()
    sched.abort("a")
    got, out = [], None
    while sched.active():
        for out in sched.step():
            got += out.tokens
    assert out.request_id == "b" and got == fresh(prompt, 3)


def test_warm_states_serve_only_their_own_salt():
    """A slot's history and the host cache's states are scoped by salt (one per API key):
    another scope's identical prompt is computed afresh, sessions included."""
    model = HistoryModel(1)                                  # one slot: every turn evicts
    cache = PrefixCache(1 << 20)
    sched = Scheduler(model, 1, ctx=256, kv=model, cache=cache)
    secret = list(range(60))
    run(sched, Request("a1", secret + [1], GREEDY, 1, session_id="s", salt="alice"))
    _, out = run(sched, Request("b1", secret + [1], GREEDY, 1, session_id="s", salt="bob"))
    assert out.cached_tokens == 0                            # the slot is alice's: no hit
    assert cache.stats()["entries"] == 1                     # alice's state went to the host
    _, out = run(sched, Request("b2", secret + [2], GREEDY, 1, salt="bob"))
    assert out.cached_tokens == 60                           # bob's own slot state
    _, out = run(sched, Request("c1", secret + [3], GREEDY, 1, salt="carol"))
    assert out.cached_tokens == 0                            # neither the slot nor the host
    _, out = run(sched, Request("a2", secret + [4], GREEDY, 1, salt="alice"))
    assert out.cached_tokens == 60 and cache.hits >= 1       # alice's, back from the host


class BrokenGrammar:
    """A constraint whose every step fails the way llguidance's lexer limit does: a long
    message that quotes the grammar."""

    def bitmask(self):
        return np.full(1, -1, np.int32)

    def accept(self, token):
        raise ValueError("lexer error: too many expressions constructed\n<state>...</state>"
                         "<grammar>SECRET SCHEMA</grammar>")

    def finished(self):
        return False


def test_a_failing_grammar_ends_its_request_alone():
    sched = Scheduler(FakeModel(), n_slots=3, ctx=64)
    sched.add(Request("a", [1], GREEDY, max_tokens=5))
    sched.add(Request("bad", [2], GREEDY, max_tokens=5, constraint=BrokenGrammar()))
    sched.add(Request("c", [3], GREEDY, max_tokens=5))
    outs = {}
    while sched.active():
        for out in sched.step():
            outs.setdefault(out.request_id, []).append(out)
    assert [o.finish for o in outs["bad"]] == ["error"] and outs["bad"][0].tokens == []
    assert outs["bad"][0].error.startswith("lexer error") and "SECRET" not in outs["bad"][0].error
    for rid, first in (("a", 2), ("c", 4)):
        tokens = [t for o in outs[rid] for t in o.tokens]
        assert tokens == list(range(first, first + 5)) and outs[rid][-1].finish == "length"
    assert sched.free_slots() == 3
