"""The CuPy path on a real GPU die (skipped where CuPy finds no device)."""
import json
from pathlib import Path

import numpy as np
import pytest

import tiny_models as tm
from test_sampler import FixedGrammar
from pantheon.common.default_model import cached_path
from pantheon.worker.device import cuda_device
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span

pytestmark = pytest.mark.gpu
REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "smollm2-reference.json"


@pytest.mark.parametrize("name", ["llama", "llama3", "qwen2", "qwen3"])
def test_fp32_gpu_forward_matches_reference(tmp_path, name):
    engine = load_engine(tm.write_gguf(name, tmp_path / f"{name}.gguf"),
                         cuda_device(0, fp16=False), n_slots=2, ctx=64)
    for tokens, want in zip(tm.GOLDEN_TOKENS, tm.load_golden(name)):
        got = engine.forward(np.array(tokens), [Span(0, 0, len(tokens))])
        np.testing.assert_allclose(got[0], want[-1], atol=1e-3, rtol=0)
        rows = [engine.forward(np.array([t]), [Span(1, i, 1)])[0] for i, t in enumerate(tokens)]
        np.testing.assert_allclose(np.stack(rows), want, atol=1e-3, rtol=0)


def test_qwen35_on_the_gpu_matches_reference(tmp_path):
    """The recurrent state on the die: a 150-token prompt in chunks (the chunked delta
    rule), then decodes of two sequences batched with a prefill of a third."""
    engine = load_engine(tm.write_gguf("qwen35", tmp_path / "q35.gguf"),
                         cuda_device(0, fp16=False), n_slots=3, ctx=200)
    (a, b, long), want = tm.golden_tokens("qwen35"), tm.load_golden("qwen35")
    start = 0
    for n in (37, 64, 49):
        got = engine.forward(np.array(long[start:start + n]), [Span(0, start, n)])
        start += n
        np.testing.assert_allclose(got[0], want[2][start - 1], atol=1e-3, rtol=0)
    engine.forward(np.array(a[:-1]), [Span(1, 0, len(a) - 1)])
    out = engine.forward(np.array([a[-1]] + b[:6]), [Span(1, len(a) - 1, 1), Span(2, 0, 6)])
    np.testing.assert_allclose(out, np.stack([want[0][-1], want[1][5]]), atol=1e-3, rtol=0)
    out = engine.forward(np.array([b[6]]), [Span(2, 6, 1)])
    np.testing.assert_allclose(out[0], want[1][6], atol=1e-3, rtol=0)


def test_fp16_gpu_mixed_batch_stays_close(tmp_path):
    engine = load_engine(tm.write_gguf("qwen3", tmp_path / "q.gguf"),
                         cuda_device(0, fp16=True), n_slots=2, ctx=64)
    (a, b), (want_a, want_b) = tm.GOLDEN_TOKENS, tm.load_golden("qwen3")
    engine.forward(np.array(a[:5]), [Span(0, 0, 5)])
    engine.forward(np.array(b[:3]), [Span(1, 0, 3)])
    out = engine.forward(np.array(a[5:9] + b[3:4]), [Span(0, 5, 4), Span(1, 3, 1)])
    np.testing.assert_allclose(out, np.stack([want_a[8], want_b[3]]), atol=5e-2, rtol=0)


@pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
def test_smollm2_greedy_on_gpu_fp32():
    engine = load_engine(cached_path(), cuda_device(0, fp16=False), n_slots=1, ctx=256)
    for case in json.loads(REFERENCE.read_text())["chat_greedy"]:
        ids, want = case["prompt_ids_fp32ref"], case["greedy_ids_fp32ref"]
        logits = engine.forward(np.array(ids), [Span(0, 0, len(ids))])
        out, pos = [int(logits[0].argmax())], len(ids)
        while len(out) < len(want):
            logits = engine.forward(np.array([out[-1]]), [Span(0, pos, 1)])
            out.append(int(logits[0].argmax()))
            pos += 1
        assert out == want


def test_sampling_on_the_gpu_equals_the_numpy_path():
    """Every option, a grammar mask over a padded vocabulary and logprobs: the CuPy sampler
    picks what the NumPy one picks from the same logits and seeds."""
    import cupy
    from pantheon.worker.sampler import Sampler, SamplingParams, SequenceSampler
    V, n_tokens = 151_936, 151_665
    kinds = [dict(temperature=0), dict(temperature=0.8), dict(top_k=40), dict(top_p=0.9),
             dict(min_p=0.05), dict(temperature=0, frequency_penalty=0.5, logit_bias={7: 2.0}),
             dict(top_k=20, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.3),
             dict(top_k=5, temperature=0.7)]
    rng = np.random.default_rng(0)

    def rows():
        return [SequenceSampler(SamplingParams(**kw, seed=i), list(range(0, 900, 9)),
                                logprobs=[-1, 3][i % 2]) for i, kw in enumerate(kinds)]
    on_host, on_die = rows(), rows()
    for step in range(20):
        allowed = np.zeros(-(-n_tokens // 32) * 32, bool)
        allowed[:n_tokens] = rng.random(n_tokens) < 0.01
        words = np.packbits(allowed, bitorder="little").view("<i4")
        for seqs in (on_host, on_die):
            seqs[6].constraint = FixedGrammar(words)
        logits = rng.normal(0, 3, (len(kinds), V)).astype(np.float32)
        want = Sampler(np).sample(logits.copy(), on_host)
        got = Sampler(cupy).sample(cupy.asarray(logits), on_die)
        assert [t for t, _ in got] == [t for t, _ in want], step
        for (_, a), (_, b) in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                assert [i for i, _ in a[1]] == [i for i, _ in b[1]]
                np.testing.assert_allclose([a[0]] + [v for _, v in a[1]],
                                           [b[0]] + [v for _, v in b[1]], atol=1e-4)


@pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
def test_smollm2_greedy_through_the_scheduler_on_gpu_fp32():
    """The scheduler's path on a GPU die: logits stay there, ids come back."""
    from pantheon.worker.sampler import SamplingParams
    from pantheon.worker.scheduler import Request
    engine = load_engine(cached_path(), cuda_device(0, fp16=False), n_slots=4, ctx=256)
    engine.warm_up()
    cases = json.loads(REFERENCE.read_text())["chat_greedy"]
    sched = engine.scheduler
    for i, case in enumerate(cases):
        sched.add(Request(str(i), case["prompt_ids_fp32ref"], SamplingParams(temperature=0),
                          len(case["greedy_ids_fp32ref"]), frozenset({2}), logprobs=2))
    got = {}
    while sched.active():
        for out in sched.step():
            got.setdefault(int(out.request_id), []).extend(out.tokens)
    assert [got[i] for i in range(len(cases))] == [c["greedy_ids_fp32ref"] for c in cases]


def test_settle_waits_for_queued_work_by_polling():
    """PN_ASYNC_POLL_US: the step's kernels are done when settle() returns."""
    import cupy
    die = cuda_device(0)
    x = cupy.arange(1 << 24, dtype=cupy.float32)
    y = (x * 2).sum()                                  # queued, not waited for
    after = cupy.cuda.Event(block=False, disable_timing=True)
    after.record()
    die.settle()
    assert after.done and float(y) == float(x.sum()) * 2
