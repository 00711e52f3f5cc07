import numpy as np
import pytest

from pantheon.worker.sampler import SamplingParams, SequenceSampler

V = 50


def logits_row(seed=0):
    return np.random.default_rng(seed).normal(0, 2, V).astype(np.float32)


def draws(params, n=200, seed_logits=0):
    s = SequenceSampler(params, prompt=[])
    row = logits_row(seed_logits)
    return [s.choose(s.adjust(row)) for _ in range(n)]


def test_greedy_is_argmax():
    row = logits_row()
    assert SequenceSampler(SamplingParams(temperature=0), []).sample(row) == int(row.argmax())
    assert SequenceSampler(SamplingParams(temperature=1.3, top_k=1), []).sample(row) == int(row.argmax())


def test_seed_reproduces_and_differs():
    p = SamplingParams(temperature=1.0, seed=7)
    assert draws(p) == draws(SamplingParams(temperature=1.0, seed=7))
    assert draws(p) != draws(SamplingParams(temperature=1.0, seed=8))


def test_top_k_limits_candidates():
    row = logits_row()
    allowed = set(np.argsort(-row)[:3].tolist())
    assert set(draws(SamplingParams(top_k=3, seed=1), 300)) <= allowed


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_nucleus_matches_full_sort(top_p):
    row = logits_row(3)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    want = set(order[:int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1].tolist())
    s = SequenceSampler(SamplingParams(top_p=top_p), [])
    ids, kept = s.nucleus(None, probs)
    assert set(ids.tolist()) == want
    assert kept.sum() >= top_p - 1e-6


def test_min_p_drops_unlikely():
    row = logits_row(4)
    probs = np.exp(row - row.max())
    allowed = set(np.flatnonzero(probs >= 0.3).tolist())
    assert set(draws(SamplingParams(min_p=0.3, seed=2), 300, 4)) <= allowed


def test_logit_bias_forces_and_bans():
    row = logits_row()
    forced = SequenceSampler(SamplingParams(temperature=0, logit_bias={7: 100.0}), [])
    assert forced.sample(row) == 7
    top = int(row.argmax())
    banned = SequenceSampler(SamplingParams(temperature=0, logit_bias={top: -100.0}), [])
    assert banned.sample(row) != top


def test_repetition_penalty_uses_recent_window():
    row = np.zeros(V, np.float32)
    row[5], row[6] = 2.0, 1.5
    p = SamplingParams(temperature=0, repetition_penalty=2.0, repeat_last_n=2)
    assert SequenceSampler(p, prompt=[5, 9]).sample(row) == 6        # 5 is penalized
    assert SequenceSampler(p, prompt=[5, 9, 9]).sample(row) == 5     # 5 left the window


def test_presence_and_frequency_penalties():
    row = np.zeros(V, np.float32)
    row[1], row[2] = 1.0, 0.8
    # frequency grows with each use: 1 (1.0 → 0.7), 2 (0.8 → 0.5), 1 (0.7 → 0.4), 2
    s = SequenceSampler(SamplingParams(temperature=0, frequency_penalty=0.3), [])
    assert [s.sample(row) for _ in range(4)] == [1, 2, 1, 2]
    # presence is paid once: 1 (→ 0.5), 2 (→ 0.3), then 1 stays ahead at 0.5
    s2 = SequenceSampler(SamplingParams(temperature=0, presence_penalty=0.5), [])
    assert [s2.sample(row) for _ in range(4)] == [1, 2, 1, 1]


def test_batch_rows_are_independent_of_neighbours():
    rows = np.stack([logits_row(i) for i in range(3)])
    alone = [SequenceSampler(SamplingParams(seed=i), []).sample(rows[i]) for i in range(3)]
    samplers = [SequenceSampler(SamplingParams(seed=i), []) for i in range(3)]
    together = [s.sample(row) for s, row in zip(samplers, rows)]
    assert alone == together


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=2.0), "min_p"), (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={V + 1: 1.0}), "logit_bias"),
])
def test_invalid_params_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad).check(V)
