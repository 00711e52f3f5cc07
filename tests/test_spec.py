"""Speculative decoding (worker/spec.py, its part of worker/scheduler.py): proposals,
the measured length, and exactness — greedy output token for token the same as without
speculation for every family, and sampled output of the same law."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import tiny_models as tm
from pantheon.common.default_model import cached_path
from pantheon.common.speculation import parse
from pantheon.common.model_file import ModelFileError
from pantheon.worker.engine import load_engine
from pantheon.worker.sampler import SamplingParams
from pantheon.worker.scheduler import Request
from pantheon.worker.spec import Adaptive, NgramProposer, SpecConfig, SpecPacer

NGRAM = SpecConfig("ngram", 3, 8)


# -- proposals and lengths -------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_most_recent_match():
    prop = NgramProposer(3)
    seq = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3]
    assert prop.propose(seq, 4) == [7, 8, 4, 1]            # the later of the two matches
    assert prop.propose(seq, 1) == [7]
    assert prop.propose([1, 2, 3, 4], 4) == []              # nothing repeats
    assert prop.propose([4, 6, 4], 3) == [6, 4]              # shorter n-grams as a fallback
    # a predicted output goes first: where the last tokens occur in it, what follows
    assert prop.propose(seq, 3, prediction=[0, 2, 3, 42, 43]) == [42, 43]


def test_length_follows_acceptance_and_price():
    seq = Adaptive(prior=0.9)
    assert seq.length(None, 8) == 8                          # price unknown: measure it
    assert seq.length(0.5, 8) == 6                           # 0.9^6 > 0.5 > 0.9^7
    assert seq.length(0.95, 8) == 0                          # not worth a token
    for _ in range(10):
        seq.record(1, 0)                                     # nothing passes any more
    assert seq.length(0.1, 8) == 0
    pacer = SpecPacer()
    assert not pacer.measured(1) and pacer.price(1) is None
    pacer.record(0.010, 1, 0, 0)                             # a decode step of one
    pacer.record(0.014, 1, 4, 0)                             # + 4 verified tokens: 1 ms each
    pacer.record(0.020, 4, 0, 0)
    assert pacer.price(1) == pytest.approx(0.1)
    assert pacer.price(4) == pytest.approx(0.2)              # dearer as the batch fills
    pacer.record(0.5, 1, 0, 100)                             # a step with a prompt: ignored
    assert pacer.price(1) == pytest.approx(0.1)


@pytest.mark.parametrize("value, field", [
    ("eagle", "spec.kind"), ({"kind": "draft"}, "spec.draft"), ({"kind": "ngram", "k": 17}, "spec.k"),
    ({"kind": "ngram", "k": 0}, "spec.k"), ({"kind": "ngram", "n": 0}, "spec.n"),
    ({"kind": "ngram", "x": 1}, "spec.x"), (3, "spec")])
def test_bad_settings_name_their_field(value, field):
    with pytest.raises(ValueError) as err:
        parse(value)
    assert str(err.value).split(" ")[0] == field


# -- exactness -------------------------------------------------------------------------
class Eager(SpecPacer):
    """Every proposal at its full length: verification runs on every step it can."""

    def measured(self, batch):
        return True

    def price(self, batch):
        return None


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    out = {name: tm.write_gguf(name, folder / f"{name}.gguf")
           for name in ("llama", "qwen2", "qwen3", "gemma3", "qwen35")}
    out["smollm2"] = cached_path()
    return out


def run(path, reqs, spec, slots=4, ctx=200, pacer=Eager):
    """{request id: (tokens, finish)} and the scheduler's speculation totals."""
    engine = load_engine(path, n_slots=slots, ctx=ctx, spec=spec)
    sched = engine.scheduler
    if sched.speculator is not None:       # (None: a model whose state cannot be cut)
        sched.speculator.pacer = pacer()
    got = {r.id: ([], None) for r in reqs}
    waiting = list(reqs)
    while waiting or sched.active():
        while waiting and sched.free_slots():
            sched.add(waiting.pop(0))
        for out in sched.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.tokens, out.finish)
    return got, sched.speculator.totals if sched.speculator else [0, 0, 0]


def repetitive(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    base = np.random.default_rng(seed).integers(3, vocab, 12).tolist()
    return (base * 8)[:n]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "qwen35", "smollm2"])
def test_greedy_output_is_the_same_with_speculation(paths, family):
    """Five requests on four slots (one waits), two of them the same prompt (n > 1: a
    fork), stop ids and budgets that end runs part way."""
    greedy = SamplingParams(temperature=0)
    vocab = 300 if family != "smollm2" else 49000
    reqs = [Request(f"r{i}", repetitive(30 + 3 * (i % 4), i % 4, vocab), greedy,
                    max_tokens=[40, 7, 40, 23, 40][i]) for i in range(5)]
    plain, _ = run(paths[family], reqs, None)
    # a stop id met in the middle of what r0 generates
    stop = plain["r0"][0][len(plain["r0"][0]) // 2]
    reqs.append(Request("stop", reqs[0].prompt, greedy, 40, frozenset({stop})))
    plain |= run(paths[family], reqs[-1:], None)[0]
    spec, totals = run(paths[family], reqs, NGRAM)
    assert spec == plain
    assert plain["stop"][1] == "stop" and plain["r1"] == (plain["r1"][0], "length")
    if family == "qwen35":
        assert totals == [0, 0, 0]                      # its state cannot be cut: none
    else:
        assert totals[1] > 0                            # proposals were verified


def test_every_budget_gives_a_prefix_of_the_same_output(paths):
    """max_tokens cutting an accepted run anywhere: gemma3's tiny model repeats itself,
    so its runs are long."""
    prompt = repetitive(40, 3)
    full, totals = run(paths["gemma3"], [Request("a", prompt, SamplingParams(temperature=0),
                                                 max_tokens=40)], NGRAM)
    assert totals[2] > 10                                # long accepted runs
    reqs = [Request(f"m{m}", prompt, SamplingParams(temperature=0), max_tokens=m)
            for m in range(1, 13)]
    got, _ = run(paths["gemma3"], reqs, NGRAM, slots=8)
    for m in range(1, 13):
        assert got[f"m{m}"] == (full["a"][0][:m], "length")


def test_logprobs_are_those_of_the_plain_run(paths):
    req = Request("a", repetitive(40, 3), SamplingParams(temperature=0), 20, logprobs=2)
    engine = load_engine(paths["gemma3"], n_slots=2, ctx=200, spec=NGRAM)
    engine.scheduler.speculator.pacer = Eager()
    plain = load_engine(paths["gemma3"], n_slots=2, ctx=200)
    outs = []
    for e in (engine, plain):
        e.scheduler.add(req)
        got = []
        while e.scheduler.active():
            for o in e.scheduler.step():
                got += o.logprobs
        outs.append(got)
    assert len(outs[0]) == len(outs[1]) == 20
    for a, b in zip(*outs):
        assert a[0] == pytest.approx(b[0], abs=1e-4)
        assert [t for t, _ in a[1]] == [t for t, _ in b[1]]


class Contrary(NgramProposer):
    """Proposes the tokens a sampled run is least sure of: often wrong, sometimes right."""

    def propose(self, tokens, k, prediction=None, done=0):
        rng = np.random.default_rng(len(tokens) * 7919 + tokens[-1])
        return rng.integers(3, 12, size=k).tolist()


@pytest.mark.parametrize("proposer", ["contrary", "draft"])
def test_sampled_output_keeps_its_law(paths, proposer):
    """Over many seeds, the tokens emitted with speculation (a proposer that is mostly
    wrong: random tokens, or a draft model of other weights) follow the same law as
    without: a chi-square test at a 0.1% false alarm; and since each emitted token costs
    one draw either way, each seed gives the same output."""
    params = [SamplingParams(temperature=1.0, top_k=6, seed=s) for s in range(240)]
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5]
    reqs = [Request(f"s{i}", prompt, p, max_tokens=4) for i, p in enumerate(params)]
    plain, _ = run(paths["llama"], reqs, None, slots=8)
    spec = NGRAM if proposer == "contrary" else SpecConfig("draft", 3, 3, str(paths["qwen2"]))
    engine = load_engine(paths["llama"], n_slots=8, ctx=200, spec=spec)
    sched = engine.scheduler
    sched.speculator.pacer = Eager()
    if proposer == "contrary":
        sched.speculator.proposer = Contrary(3)
    spec = {}
    waiting = list(reqs)
    while waiting or sched.active():
        while waiting and sched.free_slots():
            sched.add(waiting.pop(0))
        for out in sched.step():
            spec.setdefault(out.request_id, []).extend(out.tokens)
    proposed, accepted = sched.speculator.totals[1:]
    assert proposed > 400 and accepted < proposed / 2           # mostly rejected
    assert accepted > 0 or proposer == "draft"     # the other weights' draft: all of them
    assert {k: v for k, v in spec.items()} == {k: v[0] for k, v in plain.items()}
    # the law, on seeds of their own: tokens at every position, binned (top 5 + rest)
    other = [Request(f"o{i}", prompt, SamplingParams(temperature=1.0, top_k=6, seed=10_000 + i),
                     max_tokens=4) for i in range(240)]
    fresh, _ = run(paths["llama"], other, None, slots=8)
    a = Counter(t for v in spec.values() for t in v)
    b = Counter(t for v, _ in fresh.values() for t in v)
    top = [t for t, _ in (a + b).most_common(5)]
    bins_a = [a[t] for t in top] + [sum(a.values()) - sum(a[t] for t in top)]
    bins_b = [b[t] for t in top] + [sum(b.values()) - sum(b[t] for t in top)]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(bins_a, bins_b) if x + y)
    assert chi2 < 20.515          # chi-square, 5 degrees of freedom, 0.999 quantile


# -- a draft model -----------------------------------------------------------------------
@pytest.mark.parametrize("draft, agrees", [("llama", True), ("qwen2", False)])
def test_a_draft_model_gives_the_same_greedy_output(paths, draft, agrees):
    """The target as its own draft agrees on every token; another model's weights on few.
    Either way the output is the target's; the draft's bytes count in the replica's."""
    greedy = SamplingParams(temperature=0)
    reqs = [Request(f"r{i}", repetitive(30 + i, i), greedy, max_tokens=[30, 9, 30, 17, 30][i])
            for i in range(5)]
    plain, _ = run(paths["llama"], reqs, None)
    spec, totals = run(paths["llama"], reqs, SpecConfig("draft", 3, 6, str(paths[draft])))
    assert spec == plain
    assert totals[1] > 50 and (totals[2] == totals[1] if agrees else totals[2] < totals[1] / 2)
    engine = load_engine(paths["llama"], n_slots=2, ctx=64,
                         spec=SpecConfig("draft", 3, 6, str(paths[draft])))
    alone = load_engine(paths["llama"], n_slots=2, ctx=64)
    assert engine.weight_bytes > alone.weight_bytes and engine.state_bytes > alone.state_bytes


def test_a_draft_that_cannot_serve_is_refused_at_load(paths, tmp_path):
    with pytest.raises(ModelFileError, match="recurrent layers cannot be rolled back"):
        load_engine(paths["llama"], n_slots=1, ctx=32,
                    spec=SpecConfig("draft", 3, 4, str(paths["qwen35"])))
    with pytest.raises(ModelFileError, match="vocabulary .49152 tokens. is not the target's"):
        load_engine(paths["llama"], n_slots=1, ctx=32,
                    spec=SpecConfig("draft", 3, 4, str(paths["smollm2"])))


class Mute(NgramProposer):
    def propose(self, tokens, k, prediction=None, done=0):
        return []


def test_a_grammar_checks_proposals_and_forces_some(paths):
    """A JSON schema's fixed keys are proposed for free (with a proposer that proposes
    nothing, they are all that is verified) and pass; prompt lookup's proposals are cut
    where the grammar refuses them. The same output as without, either way."""
    from pantheon.common.grammar import grammar_for_response_format
    from pantheon.common.tokenizer import open_tokenizer
    from pantheon.worker.constraint import ConstraintFactory
    tok = open_tokenizer(paths["smollm2"])
    factory = ConstraintFactory(tok)
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
    grammar = grammar_for_response_format({"type": "json_schema", "json_schema": {
        "name": "place", "schema": schema}})
    prompt = tok.encode("<|im_start|>user\nWhere is the Eiffel tower? Answer in JSON with "
                        "city and country.<|im_end|>\n<|im_start|>assistant\n")
    outs, totals = [], []
    for spec, proposer in ((None, None), (NGRAM, None), (NGRAM, Mute(3))):
        engine = load_engine(paths["smollm2"], n_slots=1, ctx=256, spec=spec)
        sched = engine.scheduler
        if proposer is not None:
            sched.speculator.proposer = proposer
        if sched.speculator is not None:
            sched.speculator.pacer = Eager()
        sched.add(Request("g", prompt, SamplingParams(temperature=0), 40, frozenset({2}),
                          constraint=factory.make(grammar)))
        got = []
        while sched.active():
            for out in sched.step():
                got += out.tokens
        outs.append(got)
        totals.append(sched.speculator.totals if sched.speculator else None)
    assert outs[0] == outs[1] == outs[2]
    assert "country" in tok.decode(outs[0])
    assert totals[2][2] == totals[2][1] == 2           # "city", "country": forced, passed
