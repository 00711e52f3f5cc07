"""bench/gpu_check.py's parts that need no GPU: the random model and the arithmetic."""
import numpy as np

from pantheon.bench import gpu_check
from pantheon.common.model_file import read_config
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span

SMALL = dict(n_layers=2, d_model=128, d_ff=256, n_heads=4, n_kv_heads=2, vocab=96)


def test_random_gguf_loads_and_runs(tmp_path):
    path = gpu_check.write_random_gguf(tmp_path / "r.gguf", SMALL)
    cfg = read_config(path)
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_kv_heads, cfg.vocab_size) == (2, 128, 256, 2, 96)
    assert not cfg.tied_embeddings
    engine = load_engine(path, "cpu", n_slots=1, ctx=16)
    logits = engine.forward(np.array([1, 5, 7]), [Span(0, 0, 3)])
    assert logits.shape == (1, 96) and np.isfinite(logits).all()


def test_bandwidth_share_counts_one_weight_read_per_step():
    # 100 tok/s at batch 1 and 400 at batch 4 both read 1 GB 100 times a second
    assert gpu_check.shares({"1": 100.0, "4": 400.0}, 10**9, 200e9) == {"1": 0.5, "4": 0.5}
