"""The CuPy path on a GPU die: each test runs on the emulated die (worker/emulated.py,
in `make test`) and on a real one (`gpu`-marked: skipped where CuPy finds no device,
run by `make gpu-check`): one test list for both."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import tiny_models as tm
from test_sampler import FixedGrammar
from pantheon.common.default_model import cached_path
from pantheon.worker.device import cuda_device, emulated_device
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "smollm2-reference.json"
EMU, CUDA = pytest.param("emu", id="emu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)
smollm2 = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")


@pytest.fixture(params=[EMU, CUDA])
def die(request):
    """open(fp16=...) → a die of the kind: emulated, or CUDA device 0."""
    if request.param == "emu":
        return lambda fp16=True: emulated_device(0, fp16=fp16)
    return lambda fp16=True: cuda_device(0, fp16=fp16)


@pytest.mark.parametrize("name", ["llama", "llama3", "qwen2", "qwen3"])
def test_fp32_gpu_forward_matches_reference(tmp_path, die, name):
    engine = load_engine(tm.write_gguf(name, tmp_path / f"{name}.gguf"),
                         die(fp16=False), n_slots=2, ctx=64, quantize="none")
    for tokens, want in zip(tm.GOLDEN_TOKENS, tm.load_golden(name)):
        got = engine.forward(np.array(tokens), [Span(0, 0, len(tokens))])
        np.testing.assert_allclose(got[0], want[-1], atol=1e-3, rtol=0)
        rows = [engine.forward(np.array([t]), [Span(1, i, 1)])[0] for i, t in enumerate(tokens)]
        np.testing.assert_allclose(np.stack(rows), want, atol=1e-3, rtol=0)


def test_qwen35_on_the_gpu_matches_reference(tmp_path, die):
    """The recurrent state on the die: a 150-token prompt in chunks (the chunked delta
    rule), then decodes of two sequences batched with a prefill of a third."""
    engine = load_engine(tm.write_gguf("qwen35", tmp_path / "q35.gguf"),
                         die(fp16=False), n_slots=3, ctx=200, quantize="none")
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


def test_fp16_gpu_mixed_batch_stays_close(tmp_path, die):
    engine = load_engine(tm.write_gguf("qwen3", tmp_path / "q.gguf"),
                         die(fp16=True), n_slots=2, ctx=64)
    (a, b), (want_a, want_b) = tm.GOLDEN_TOKENS, tm.load_golden("qwen3")
    engine.forward(np.array(a[:5]), [Span(0, 0, 5)])
    engine.forward(np.array(b[:3]), [Span(1, 0, 3)])
    out = engine.forward(np.array(a[5:9] + b[3:4]), [Span(0, 5, 4), Span(1, 3, 1)])
    np.testing.assert_allclose(out, np.stack([want_a[8], want_b[3]]), atol=5e-2, rtol=0)


def test_gemma3_windows_and_a_partial_batch_on_the_die(tmp_path, die):
    """Gemma 3's sliding window (4 positions) in the prefill mask and in the decode bias,
    and decodes of slots 0 and 2 with slot 1 idle between them (queries scattered over
    the slots' range): the reference logits."""
    engine = load_engine(tm.write_gguf("gemma3", tmp_path / "g.gguf"),
                         die(fp16=False), n_slots=3, ctx=64, quantize="none")
    (a, b), (want_a, want_b) = tm.GOLDEN_TOKENS, tm.load_golden("gemma3")
    got = engine.forward(np.array(a[:6]), [Span(0, 0, 6)])        # 6 > the window
    np.testing.assert_allclose(got[0], want_a[5], atol=1e-3, rtol=0)
    got_a, got_b = [], []
    for i, t in enumerate(b):
        if 6 + i < len(a):
            out = engine.forward(np.array([a[6 + i], t]), [Span(0, 6 + i, 1), Span(2, i, 1)])
            got_a.append(out[0])
            got_b.append(out[1])
        else:
            got_b.append(engine.forward(np.array([t]), [Span(2, i, 1)])[0])
    np.testing.assert_allclose(np.stack(got_a), want_a[6:6 + len(got_a)], atol=1e-3, rtol=0)
    np.testing.assert_allclose(np.stack(got_b), want_b, atol=1e-3, rtol=0)


def test_the_kernels_tile_in_parts_and_refuse_what_they_cannot_read(die, monkeypatch):
    """A batch past the GEMV's reach in row tiles smaller than the matrix equals the GEMV;
    an empty batch, an unknown path, rows out of range, an unknown kind, K not a multiple
    of 8 and a block size the kernels lack are refused by name."""
    from pantheon.worker import kernels_cuda as kc
    from pantheon.worker import matrices as qm
    xp = die().xp
    rng = np.random.default_rng(2)
    m = qm.to_die(qm.quantize(rng.standard_normal((48, 64)).astype(np.float32), "q8_0"), xp)
    x = xp.asarray(rng.standard_normal((kc.GEMV_MAX_B + 8, 64)).astype(np.float32))
    want = xp.asnumpy(kc.matmul(x, m, "gemv"))
    monkeypatch.setattr(kc, "TILE_ELEMS", 16 * 64)          # three tiles of 16 rows
    np.testing.assert_allclose(xp.asnumpy(kc.matmul(x, m)), want, rtol=1e-5, atol=1e-4)
    assert kc.matmul(x[:0], m).shape == (0, 48)
    with pytest.raises(ValueError, match="path must be auto, gemv or tile"):
        kc.matmul(x, m, "fast")
    with pytest.raises(IndexError, match="rows \\[40, 60\\) of a 48-row"):
        kc.dequantize_rows(m, 40, 60)
    with pytest.raises(ValueError, match="no CUDA kernel for QMatrix kind 'q6'"):
        kc.check(dataclasses.replace(m, kind="q6"))
    with pytest.raises(ValueError, match="K % 8 == 0"):
        kc.check(dataclasses.replace(m, cols=60))
    with pytest.raises(ValueError, match="q8 with block size 64"):
        kc.check(dataclasses.replace(m, bs=64))


def test_a_k_quant_file_is_repacked_for_the_die(tmp_path, die):
    """A Q4_K_M file (Q4_K and Q6_K super-blocks) on a GPU die: its blocks repacked into
    the kernels' q4 and q8 rows, the forward that of the same file's fp32 weights."""
    from kquants import rewrite_as_k_quants
    from test_kquant_model import SEQS, kinds, q4_k_m, widened
    from test_quantized_model import compare
    with widened("llama") as name:
        f32 = tm.write_gguf(name, tmp_path / f"{name}.gguf")
    path = rewrite_as_k_quants(f32, tmp_path / "q4km.gguf", q4_k_m)
    on_die = load_engine(path, die(fp16=False), n_slots=1, ctx=64)
    assert kinds(on_die) == {"q4/32", "q8/16"}          # Q6_K: scales per 16
    reference = load_engine(path, n_slots=1, ctx=64, quantize="none")
    agree, kl, n = compare(reference, on_die, SEQS[:2])
    assert n > 20 and agree >= 0.99 and kl <= 0.01, (agree, kl)


@smollm2
@pytest.mark.gpu
def test_smollm2_greedy_on_gpu_fp32():
    engine = load_engine(cached_path(), cuda_device(0, fp16=False), n_slots=1, ctx=256,
                         quantize="none")
    for case in json.loads(REFERENCE.read_text())["chat_greedy"]:
        ids, want = case["prompt_ids_fp32ref"], case["greedy_ids_fp32ref"]
        logits = engine.forward(np.array(ids), [Span(0, 0, len(ids))])
        out, pos = [int(logits[0].argmax())], len(ids)
        while len(out) < len(want):
            logits = engine.forward(np.array([out[-1]]), [Span(0, pos, 1)])
            out.append(int(logits[0].argmax()))
            pos += 1
        assert out == want


def test_sampling_on_the_gpu_equals_the_numpy_path(die):
    """Every option, a grammar mask over a padded vocabulary and logprobs: the CuPy sampler
    picks what the NumPy one picks from the same logits and seeds."""
    cupy = die().xp
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
    for step in range(20 if cupy.__name__ == "cupy" else 6):
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


@smollm2
@pytest.mark.gpu
def test_smollm2_greedy_through_the_scheduler_on_gpu_fp32():
    """The scheduler's path on a GPU die: logits stay there, ids come back."""
    from pantheon.worker.sampler import SamplingParams
    from pantheon.worker.scheduler import Request
    engine = load_engine(cached_path(), cuda_device(0, fp16=False), n_slots=4, ctx=256,
                         quantize="none")
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


def test_settle_waits_for_queued_work_by_polling(die):
    """PN_ASYNC_POLL_US: the step's kernels are done when settle() returns (on the emulated
    die a launch keeps the die busy for a few polls: the sleeps between them run)."""
    from pantheon.worker import kernels_cuda as kc
    from pantheon.worker import matrices as qm
    dev = die()
    cp = dev.xp
    host = qm.quantize(np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32),
                       "q8_0")
    x = cp.asarray(np.ones((1, 512), np.float32))
    y = kc.matmul(x, qm.to_die(host, cp))                       # queued, not waited for
    after = cp.cuda.Event(block=False, disable_timing=True)
    after.record()
    polls = dev.settle()
    assert after.done and polls >= 1
    if dev.emulated:
        assert polls > 1
    np.testing.assert_allclose(cp.asnumpy(y)[0], qm.dequantize(host).sum(axis=1), atol=1e-3)


def test_an_unload_gives_the_dies_memory_back(die):
    """Device.release after the arrays are dropped: the die's free memory is what it was
    (CuPy's pool would otherwise keep the blocks), and synchronize returns."""
    dev = die()
    cp = dev.xp
    dev.release()
    before = dev.memory()[1]
    held = [cp.ones((1 << 20,), dtype=cp.float32) for _ in range(4)]      # 16 MiB
    dev.synchronize()
    assert dev.memory()[1] <= before - (16 << 20)
    del held
    dev.release()
    assert dev.memory()[1] == before


@smollm2
def test_smollm2_on_the_die_follows_the_cpu_within_fp16(die):
    """The default model with fp16 KV on the die (prefill through the tiles: 37 tokens;
    decodes through the GEMV) greedy as on the CPU, its logits within fp16's reach."""
    case = json.loads(REFERENCE.read_text())["chat_greedy"][0]
    ids = case["prompt_ids_fp32ref"]
    cpu = load_engine(cached_path(), "cpu", n_slots=1, ctx=48)
    gpu = load_engine(cached_path(), die(fp16=True), n_slots=1, ctx=48)
    assert gpu.model.state.nbytes == cpu.model.state.nbytes // 2          # fp16 KV
    out, pos = [], 0
    chunk = ids
    for _ in range(4):
        a = cpu.forward(np.array(chunk), [Span(0, pos, len(chunk))])
        b = gpu.forward(np.array(chunk), [Span(0, pos, len(chunk))])
        np.testing.assert_allclose(b, a, atol=0.15, rtol=0)
        assert int(b[0].argmax()) == int(a[0].argmax())
        pos += len(chunk)
        out.append(int(a[0].argmax()))
        chunk = [out[-1]]
    assert out == case["greedy_ids_fp32ref"][:4]


def run_scheduler(engine, requests) -> tuple[dict, dict]:
    """Every request through the engine's scheduler: tokens and cached counts by id."""
    from pantheon.worker.scheduler import Request
    sched, got, cached = engine.scheduler, {}, {}
    waiting = [Request(rid, prompt, params, 6, frozenset(), session, None, 2)
               for rid, prompt, params, session in requests]
    while waiting or sched.active():
        while waiting and sched.free_slots():          # as the worker admits them
            sched.add(waiting.pop(0))
        for out in sched.step():
            got.setdefault(out.request_id, []).extend(out.tokens)
            cached[out.request_id] = max(cached.get(out.request_id, 0), out.cached_tokens)
    return got, cached


def test_scheduler_on_the_die_streams_as_the_cpu(tmp_path, die):
    """Concurrent streams, prompts in chunks of 8 beside decodes, a session's second turn
    from its warm slot and a prefix from the host cache (slots taken over meanwhile),
    greedy and seeded draws, Q8_0 through the kernels and fp16 KV on the die: the tokens
    the CPU's scheduler gives."""
    from pantheon.worker.sampler import SamplingParams
    path = tm.write_gguf("llama", tmp_path / "q8.gguf", tensor_type="Q8_0")
    rng = np.random.default_rng(4)
    first = [rng.integers(3, 320, n).tolist() for n in (21, 5, 13)]
    kinds = [SamplingParams(temperature=0), SamplingParams(seed=3, top_k=20),
             SamplingParams(seed=5, top_p=0.9, temperature=0.8)]
    runs = []
    for dev in ("cpu", die(fp16=False)):
        engine = load_engine(path, dev, n_slots=2, ctx=96, prefill_chunk=8,
                             prefix_cache_bytes=1 << 22)
        turn1, c1 = run_scheduler(engine, [(f"a{i}", p, k, f"s{i}")
                                           for i, (p, k) in enumerate(zip(first, kinds))])
        again = [(f"b{i}", first[i] + turn1[f"a{i}"] + [7, 8], kinds[0], f"s{i}")
                 for i in range(3)]
        turn2, c2 = run_scheduler(engine, again)
        runs.append((turn1, turn2, c2))
    (t1, t2, c2), (e1, e2, ec2) = runs
    assert e1 == t1 and e2 == t2
    assert ec2 == c2 and sum(c2.values()) > 0         # warm slots and host-cache hits
