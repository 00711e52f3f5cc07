"""The CuPy path on a real GPU die (skipped where CuPy finds no device)."""
import json
from pathlib import Path

import numpy as np
import pytest

import tiny_models as tm
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
