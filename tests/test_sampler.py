"""The sampler over `xp` (here NumPy) against a plain per-row NumPy reference of the
semantics its docstring documents, option by option, with fixed seeds."""
from collections import Counter

import numpy as np
import pytest

from pantheon.worker.sampler import Sampler, SamplingParams, SequenceSampler

V = 50
F32 = np.float32


def logits_row(seed=0, n=V):
    return np.random.default_rng(seed).normal(0, 2, n).astype(np.float32)


def pick(seq, row):
    """One row through the batched sampler; the token is recorded in `seq`."""
    return Sampler(np).sample(row[None].copy(), [seq])[0][0]


def draws(params, n=200, seed_logits=0):
    s = SequenceSampler(params, prompt=[])
    row = logits_row(seed_logits)
    return [pick(s, row) for _ in range(n)]


class Reference:
    """The documented semantics for one row, the plainest NumPy way: a full stable sort for
    top_k / top_p, probabilities over the whole vocabulary, `Generator.choice` to draw."""

    def __init__(self, params: SamplingParams, prompt: list[int]):
        self.p = params
        n = params.repeat_last_n
        self.recent = list(prompt[-n:]) if n else []
        self.generated = Counter()
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)

    def adjust(self, row):
        p, x = self.p, row.astype(F32, copy=True)
        for t, b in p.logit_bias.items():
            x[t] += F32(b)
        if p.repetition_penalty != 1.0:
            pen = F32(p.repetition_penalty)
            for t in set(self.recent):
                x[t] = x[t] / pen if x[t] > 0 else x[t] * pen
        if p.presence_penalty or p.frequency_penalty:
            for t, c in self.generated.items():
                x[t] -= F32(p.frequency_penalty) * F32(c) + F32(p.presence_penalty)
        return x

    def pick(self, row, allowed=None):
        p, x = self.p, self.adjust(row)
        if allowed is not None:
            x[~allowed] = -np.inf
        if p.temperature == 0 or p.top_k == 1:
            token = int(np.argmax(x))
        else:
            token = self.draw(x / F32(p.temperature))
        self.generated[token] += 1
        if p.repeat_last_n:
            self.recent = (self.recent + [token])[-p.repeat_last_n:]
        return token

    def draw(self, x):
        p, n = self.p, x.size
        e = np.exp(x - x.max())
        kept = np.argsort(-x, kind="stable")                  # most likely first, ties by id
        if 0 < p.top_k < n:
            kept = kept[:p.top_k]
        if p.top_p < 1:
            mass = e[kept].astype(np.float64)
            kept = kept[:np.searchsorted(np.cumsum(mass) / mass.sum(), p.top_p) + 1]
        keep = np.zeros(n, bool)
        keep[kept] = True
        if p.min_p > 0:
            keep &= e >= F32(p.min_p) * e[keep].max()
        w = np.where(keep, e, 0).astype(np.float64)
        return int(self.rng.choice(n, p=w / w.sum()))


def ref_logprobs(row, token, top):
    """What the scheduler reported before sampling moved to the die."""
    shifted = row - row.max()
    logz = float(np.log(np.exp(shifted).sum()))
    ids = np.argsort(-row, kind="stable")[:top]
    return [float(shifted[token]) - logz, [[int(i), float(shifted[i]) - logz] for i in ids]]


OPTIONS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(top_k=5),
    "top_k_1": dict(top_k=1, temperature=1.3),
    "top_k_past_vocab": dict(top_k=10_000),
    "top_p": dict(top_p=0.8),
    "top_p_tight": dict(top_p=0.05),
    "top_k_top_p": dict(top_k=10, top_p=0.5, temperature=0.9),
    "min_p": dict(min_p=0.1),
    "everything_filters": dict(top_k=20, top_p=0.9, min_p=0.05, temperature=1.2),
    "repetition": dict(repetition_penalty=1.3, repeat_last_n=8),
    "repetition_greedy": dict(temperature=0, repetition_penalty=1.5),
    "presence_frequency": dict(presence_penalty=0.5, frequency_penalty=0.3),
    "penalties_greedy": dict(temperature=0, presence_penalty=0.4, frequency_penalty=0.6),
    "logit_bias": dict(logit_bias={3: 4.0, 7: -100.0, 11: 1.5}),
    "all": dict(temperature=0.8, top_k=30, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
                presence_penalty=0.2, frequency_penalty=0.1, logit_bias={5: 2.0}),
}


def run_both(param_list, steps, vocab, rows_for_step, masks=None):
    """Both samplers over the same per-step logits; returns (ours, reference) tokens."""
    prompt = list(range(0, 3 * vocab // 4, 7))
    seqs = [SequenceSampler(p, prompt) for p in param_list]
    refs = [Reference(p, prompt) for p in param_list]
    sampler, ours, theirs = Sampler(np), [], []
    for step in range(steps):
        logits = rows_for_step(step)
        allowed = masks(step) if masks else None
        for seq, words in zip(seqs, allowed[1] if masks else [None] * len(seqs)):
            seq.constraint = None if words is None else FixedGrammar(words)
        ours.append([t for t, _ in sampler.sample(logits.copy(), seqs)])
        theirs.append([r.pick(logits[i], None if not masks else allowed[0][i])
                       for i, r in enumerate(refs)])
    return ours, theirs


def random_rows(vocab, n_rows, scale=2.0, ties=False):
    def rows(step):
        x = np.random.default_rng(1000 + step).normal(0, scale, (n_rows, vocab))
        return (np.round(x * 2) / 2 if ties else x).astype(F32)
    return rows


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_matches_the_reference(name):
    params = [SamplingParams(**OPTIONS[name], seed=s) for s in range(4)]
    ours, theirs = run_both(params, steps=60, vocab=300, rows_for_step=random_rows(300, 4))
    assert ours == theirs


def test_a_batch_mixing_every_option_matches_the_reference():
    params = [SamplingParams(**kw, seed=i) for i, kw in enumerate(OPTIONS.values())]
    ours, theirs = run_both(params, steps=40, vocab=500,
                            rows_for_step=random_rows(500, len(params)))
    assert ours == theirs


@pytest.mark.parametrize("kw", [dict(top_k=7), dict(top_p=0.6), dict(top_k=40, top_p=0.9),
                                dict(top_k=3, temperature=0.5), dict(min_p=0.3)])
def test_ties_at_the_cut_go_to_the_lowest_ids(kw):
    """Logits on a 0.5 grid: many exact ties, often across the top_k / top_p cut, and tie
    groups wider than the first candidate set (the candidates then grow)."""
    params = [SamplingParams(**kw, seed=s) for s in range(3)]
    ours, theirs = run_both(params, steps=40, vocab=600,
                            rows_for_step=random_rows(600, 3, scale=1.0, ties=True))
    assert ours == theirs


def test_a_nucleus_wider_than_the_first_candidates():
    """Flat logits over 5,000 tokens: a top_p 0.95 nucleus holds thousands of them."""
    params = [SamplingParams(top_p=0.95, seed=s) for s in range(3)] + \
        [SamplingParams(top_k=2000, top_p=0.9, seed=9)]
    ours, theirs = run_both(params, steps=10, vocab=5000,
                            rows_for_step=random_rows(5000, 4, scale=0.3))
    assert ours == theirs


def peaked_rows(vocab, n_rows):
    """One token far ahead of a wide flat tail: the tail holds most of the mass, yet each
    of its tokens is below the first candidate floor (e^-9.2 of the top), and for some rows
    below the second (e^-27.6)."""
    def rows(step):
        rng = np.random.default_rng(step)
        x = rng.normal(0, 0.1, (n_rows, vocab)).astype(F32)
        x[np.arange(n_rows), rng.integers(0, vocab, n_rows)] = [10.0, 30.0, 10.0, 40.0][:n_rows]
        return x
    return rows


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_k=20_000),
                                dict(top_k=20_000, top_p=0.8), dict(top_k=30_000, min_p=1e-5)])
def test_candidates_widen_until_the_prefix_fits(kw):
    params = [SamplingParams(**kw, seed=s) for s in range(4)]
    rows = peaked_rows(40_000, 4)
    ours, theirs = run_both(params, steps=8, vocab=40_000, rows_for_step=rows)
    assert ours == theirs
    tails = sum(t != int(rows(step)[i].argmax()) for step, ts in enumerate(ours)
                for i, t in enumerate(ts))
    assert tails >= 4                                   # the tails were drawn from


@pytest.mark.parametrize("vocab", [Sampler.LONG, Sampler.LONG + 1003])
def test_long_rows_draw_block_by_block(vocab):
    """Rows longer than a few blocks: the draw finds its block, then its token; a vocabulary
    that is no multiple of the block is padded with zero weights."""
    params = [SamplingParams(seed=s) for s in range(3)] + [SamplingParams(temperature=1.5,
                                                                          seed=3)]
    ours, theirs = run_both(params, steps=40, vocab=vocab, rows_for_step=random_rows(vocab, 4))
    assert ours == theirs


def test_long_masked_rows_skip_empty_blocks():
    vocab, n_tokens = Sampler.LONG + 256, Sampler.LONG + 100

    def masks(step):
        rng = np.random.default_rng(step)
        allowed = [rng.random(n_tokens) < 0.002 for _ in range(3)]
        full = [np.concatenate([a, np.zeros(vocab - n_tokens, bool)]) for a in allowed]
        return full, [pack(a) for a in allowed]
    params = [SamplingParams(seed=0), SamplingParams(temperature=0.5, seed=1),
              SamplingParams(top_k=100, seed=2)]
    ours, theirs = run_both(params, 30, vocab, random_rows(vocab, 3), masks)
    assert ours == theirs


# -- grammar masks from packed bitsets ---------------------------------------------------

class FixedGrammar:
    """A constraint stand-in whose allowed set is given as llguidance's packed words."""

    def __init__(self, words):
        self.words = words

    def bitmask(self):
        return self.words

    def accept(self, token):
        pass


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [n] → int32 words, bit k of word w = token 32w + k (llguidance's layout)."""
    n_words = (allowed.size + 31) // 32
    bits = np.zeros(n_words * 32, bool)
    bits[:allowed.size] = allowed
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


@pytest.mark.parametrize("n_tokens, vocab", [(100, 100), (100, 128), (100, 200), (130, 96),
                                             (64, 64)])
def test_mask_from_bitsets_is_exact(n_tokens, vocab):
    """A padded vocabulary larger than the tokenizer's: the ids past it are never allowed,
    whether or not they lie inside the last packed word; a smaller one is cut."""
    rng = np.random.default_rng(n_tokens + vocab)
    allowed = [rng.random(n_tokens) < f for f in (0.5, 0.05, 1.0)]
    logits = rng.normal(0, 2, (4, vocab)).astype(F32)
    seqs = [SequenceSampler(SamplingParams(temperature=0), [], FixedGrammar(pack(a)))
            for a in allowed] + [SequenceSampler(SamplingParams(temperature=0), [])]
    got = logits.copy()
    Sampler(np).mask(got, seqs)
    for i, a in enumerate(allowed):
        full = np.zeros(vocab, bool)
        full[:min(vocab, n_tokens)] = a[:vocab]
        np.testing.assert_array_equal(got[i], np.where(full, logits[i], -np.inf))
    np.testing.assert_array_equal(got[3], logits[3])                 # unconstrained row


def test_masked_rows_match_the_reference():
    vocab, n_tokens = 300, 260

    def masks(step):
        rng = np.random.default_rng(step)
        allowed = [rng.random(n_tokens) < 0.1 for _ in range(4)]
        full = [np.concatenate([a, np.zeros(vocab - n_tokens, bool)]) for a in allowed]
        return full, [pack(a) for a in allowed]
    params = [SamplingParams(temperature=0, seed=0), SamplingParams(top_k=50, seed=1),
              SamplingParams(top_p=0.9, seed=2), SamplingParams(min_p=0.2, seed=3)]
    ours, theirs = run_both(params, 30, vocab, random_rows(vocab, 4), masks)
    assert ours == theirs


# -- logprobs ----------------------------------------------------------------------------

def test_logprobs_are_the_raw_distributions():
    """The chosen token's logprob and the top N, under the model's own distribution, equal
    what the host computed before, whatever biases, penalties and masks chose."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 3, (4, 1000)).astype(F32)
    tops = [0, 1, 5, 20]
    params = [SamplingParams(temperature=0), SamplingParams(top_k=40, seed=1),
              SamplingParams(temperature=0, logit_bias={17: 50.0}),
              SamplingParams(presence_penalty=1.0, repetition_penalty=1.3, seed=2)]
    seqs = [SequenceSampler(p, [1, 2, 3], logprobs=n) for p, n in zip(params, tops)]
    seqs[0].constraint = FixedGrammar(pack(rng.random(1000) < 0.3))
    out = Sampler(np).sample(logits.copy(), seqs)
    assert out[2][0] == 17
    for (token, entry), row, top in zip(out, logits, tops):
        assert entry == ref_logprobs(row, token, top)


def test_rows_without_logprobs_get_none():
    seqs = [SequenceSampler(SamplingParams(temperature=0), [], logprobs=-1),
            SequenceSampler(SamplingParams(temperature=0), [], logprobs=0)]
    out = Sampler(np).sample(np.stack([logits_row(1), logits_row(2)]), seqs)
    assert out[0][1] is None and out[1][1][1] == [] and out[1][1][0] <= 0


# -- the behaviours, one by one ----------------------------------------------------------

def test_greedy_is_argmax():
    row = logits_row()
    assert pick(SequenceSampler(SamplingParams(temperature=0), []), row) == int(row.argmax())
    assert pick(SequenceSampler(SamplingParams(temperature=1.3, top_k=1), []), row) == int(row.argmax())


def test_greedy_ties_go_to_the_lowest_id():
    row = np.zeros(V, F32)
    row[[9, 4, 30]] = 1.0
    assert pick(SequenceSampler(SamplingParams(temperature=0), []), row) == 4


def test_seed_reproduces_and_differs():
    p = SamplingParams(temperature=1.0, seed=7)
    assert draws(p) == draws(SamplingParams(temperature=1.0, seed=7))
    assert draws(p) != draws(SamplingParams(temperature=1.0, seed=8))


def test_a_negative_seed_is_a_seed():
    p = SamplingParams(temperature=1.0, seed=-(2**63 - 1))
    assert draws(p) == draws(SamplingParams(temperature=1.0, seed=2**64 - (2**63 - 1)))


def test_top_k_limits_candidates():
    row = logits_row()
    allowed = set(np.argsort(-row)[:3].tolist())
    assert set(draws(SamplingParams(top_k=3, seed=1), 300)) <= allowed


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_draws_stay_in_the_nucleus(top_p):
    row = logits_row(3)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    want = set(order[:int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1].tolist())
    got = set(draws(SamplingParams(top_p=top_p, seed=4), 400, 3))
    assert got <= want
    if len(want) <= 3:
        assert got == want


def test_min_p_drops_unlikely():
    row = logits_row(4)
    probs = np.exp(row - row.max())
    allowed = set(np.flatnonzero(probs >= 0.3).tolist())
    assert set(draws(SamplingParams(min_p=0.3, seed=2), 300, 4)) <= allowed


def test_logit_bias_forces_and_bans():
    row = logits_row()
    forced = SequenceSampler(SamplingParams(temperature=0, logit_bias={7: 100.0}), [])
    assert pick(forced, row) == 7
    top = int(row.argmax())
    banned = SequenceSampler(SamplingParams(temperature=0, logit_bias={top: -100.0}), [])
    assert pick(banned, row) != top


def test_repetition_penalty_uses_recent_window():
    row = np.zeros(V, np.float32)
    row[5], row[6] = 2.0, 1.5
    p = SamplingParams(temperature=0, repetition_penalty=2.0, repeat_last_n=2)
    assert pick(SequenceSampler(p, prompt=[5, 9]), row) == 6        # 5 is penalized
    assert pick(SequenceSampler(p, prompt=[5, 9, 9]), row) == 5     # 5 left the window


def test_presence_and_frequency_penalties():
    row = np.zeros(V, np.float32)
    row[1], row[2] = 1.0, 0.8
    # frequency grows with each use: 1 (1.0 → 0.7), 2 (0.8 → 0.5), 1 (0.7 → 0.4), 2
    s = SequenceSampler(SamplingParams(temperature=0, frequency_penalty=0.3), [])
    assert [pick(s, row) for _ in range(4)] == [1, 2, 1, 2]
    # presence is paid once: 1 (→ 0.5), 2 (→ 0.3), then 1 stays ahead at 0.5
    s2 = SequenceSampler(SamplingParams(temperature=0, presence_penalty=0.5), [])
    assert [pick(s2, row) for _ in range(4)] == [1, 2, 1, 1]


def test_a_seeded_row_is_independent_of_its_neighbours():
    """Alone, or in a batch beside other seeds and other options: the same tokens."""
    steps = [np.stack([logits_row(100 * t + i) for i in range(4)]) for t in range(30)]
    mine = SamplingParams(top_p=0.9, temperature=0.9, seed=42)
    alone = SequenceSampler(mine, [])
    solo = [pick(alone, rows[0]) for rows in steps]
    batch = [SequenceSampler(mine, []), SequenceSampler(SamplingParams(seed=1), []),
             SequenceSampler(SamplingParams(temperature=0), []),
             SequenceSampler(SamplingParams(top_k=3, min_p=0.2, seed=3), [])]
    sampler = Sampler(np)
    together = [sampler.sample(rows.copy(), batch)[0][0] for rows in steps]
    assert solo == together


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=2.0), "min_p"), (dict(top_k=-2), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={V + 1: 1.0}), "logit_bias"),
])
def test_invalid_params_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad).check(V)
