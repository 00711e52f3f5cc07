"""Qwen3.5's mixers (worker/arch/qwen35_ops.py): the gated delta rule, its chunked and
recurrent forms, the causal conv, partial rope."""
from __future__ import annotations

import numpy as np
import pytest

from pantheon.worker.arch import qwen35_ops as ops

F32 = np.float32


class _Cfg:
    rotary_dim, rope_theta = 8, 10000000.0


CFG = _Cfg()


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


# --- the ops alone ------------------------------------------------------------------------

def naive_rule(q, k, v, g, beta, state):
    """The gated delta rule in float64, one head and one token at a time."""
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(v.shape[0]):
        for h in range(v.shape[1]):
            s[h] *= np.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] += np.outer(k[t, h], u)
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def random_rule_inputs(n, H=3, dk=8, dv=12, seed=0):
    rng = np.random.default_rng(seed)
    q = ops.l2_normalize(rng.standard_normal((n, H, dk)).astype(F32)) * F32(dk ** -0.5)
    k = ops.l2_normalize(rng.standard_normal((n, H, dk)).astype(F32))
    v = rng.standard_normal((n, H, dv)).astype(F32)
    g = -rng.uniform(0.0, 1.5, (n, H)).astype(F32)
    beta = rng.uniform(0.0, 1.0, (n, H)).astype(F32)
    state = rng.standard_normal((H, dk, dv)).astype(F32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 2, 3, 17, 63, 64, 65, 130])
def test_chunked_and_recurrent_rule_agree(n):
    """d_k != d_v and a non-zero starting state, against a float64 loop."""
    args = random_rule_inputs(n, seed=n)
    want_o, want_s = naive_rule(*args)
    for fn in (ops.gated_delta_rule_recurrent, ops.gated_delta_rule_chunked, ops.gated_delta_rule):
        o, s = fn(*args)
        assert o.dtype == F32 and s.dtype == F32 and s.shape == (3, 8, 12)
        assert max_diff(o, want_o) < 1e-4 and max_diff(s, want_s) < 1e-4, fn.__name__
    # the input state is left as it was
    assert max_diff(args[5], random_rule_inputs(n, seed=n)[5]) == 0.0


def test_rule_over_any_split_of_the_tokens():
    q, k, v, g, beta, s0 = random_rule_inputs(100, seed=7)
    whole_o, whole_s = ops.gated_delta_rule_chunked(q, k, v, g, beta, s0)
    s, rows, pos = s0, [], 0
    for n in (5, 64, 1, 30):
        o, s = ops.gated_delta_rule_chunked(q[pos:pos + n], k[pos:pos + n], v[pos:pos + n],
                                            g[pos:pos + n], beta[pos:pos + n], s)
        rows.append(o)
        pos += n
    assert max_diff(np.concatenate(rows), whole_o) < 1e-5 and max_diff(s, whole_s) < 1e-5


def test_unit_lower_inverse():
    rng = np.random.default_rng(3)
    for L in (1, 2, 8, 64):
        a = np.tril(rng.uniform(-1, 1, (2, 3, L, L)), -1).astype(F32)
        got = ops.unit_lower_inverse(a)
        want = np.linalg.inv(a.astype(np.float64) + np.eye(L))
        assert max_diff(got, want) < 1e-4 * max(1.0, float(np.abs(want).max()))
    with pytest.raises(ValueError, match="power of two"):
        ops.unit_lower_inverse(np.zeros((3, 3), F32))


def test_conv_streams_across_chunks_and_steps():
    rng = np.random.default_rng(5)
    C, K, n = 10, 4, 23
    x = rng.standard_normal((n, C)).astype(F32)
    kernel = rng.standard_normal((C, K)).astype(F32)
    zero = np.zeros((K - 1, C), F32)
    whole, tail = ops.causal_conv1d_silu(x, kernel, zero)
    padded = np.concatenate([zero, x])
    want = np.stack([(padded[t:t + K] * kernel.T).sum(0) for t in range(n)])
    assert max_diff(whole, want * (1 / (1 + np.exp(-want)))) < 1e-5
    assert max_diff(tail, x[-(K - 1):]) == 0.0
    rows, t = [], zero
    for lo, hi in ((0, 1), (1, 3), (3, 20), (20, 23)):
        y, t = ops.causal_conv1d_silu(x[lo:hi], kernel, t)
        rows.append(y)
    assert max_diff(np.concatenate(rows), whole) < 1e-6 and max_diff(t, tail) == 0.0
    t, rows = zero[None], []
    for i in range(n):
        y, t = ops.causal_conv1d_silu_step(x[i:i + 1], kernel, t)
        rows.append(y[0])
    assert max_diff(np.stack(rows), whole) < 1e-6 and max_diff(t[0], tail) == 0.0


def test_partial_rope_leaves_the_other_dims():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 2, 32)).astype(F32)
    cos, sin = ops.rope_tables(np.arange(3, 8), CFG)
    y = ops.partial_rope(x, cos, sin)
    assert cos.shape == (5, 4) and y.dtype == F32
    assert np.array_equal(y[..., 8:], x[..., 8:])
    # a rotation: pairs (i, i + 4) keep their norm
    n = lambda a: a[..., :4] ** 2 + a[..., 4:8] ** 2      # noqa: E731
    assert max_diff(n(y), n(x)) < 1e-5
    cos0, sin0 = ops.rope_tables([0], CFG)
    assert np.array_equal(ops.partial_rope(x[:1], cos0, sin0), x[:1])
