"""`pantheon bench engine`: in-process speed of the forward on one die.

Prints one JSON object:
  prefill_tok_s   prompt tokens/s through 128-token chunks
  decode_tok_s    {"1": .., "4": .., "8": ..} aggregate decode tokens/s per batch size
                  (batch / median step time: forward + greedy pick)
  floor_tok_s     batch-1 tokens/s if a decode step cost only its weight matmuls
                  (this model's own matrices, timed back to back on the spot,
                  median of as many repeats as decode steps)
  peak_rss_bytes  the process's peak resident memory
"""
from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np

from ..worker.engine import load_engine
from ..worker.model import Span, linear


def median_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` timed calls: robust to a noisy, shared machine."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def matmul_floor(engine, repeats: int) -> float:
    """Seconds of one batch-1 step's matrix products alone."""
    w, xp = engine.model.w, engine.device.xp
    mats = [m for layer in w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    mats.append(w.head)
    inputs = [xp.ones((1, m.shape[0]), dtype=np.float32) for m in mats]

    def step():
        for x, m in zip(inputs, mats):
            linear(x, m)
        engine.device.synchronize()
    step()
    return median_time(step, repeats)


def decode_rate(engine, batch: int, steps: int, prompt_len: int = 64) -> float:
    rng = np.random.default_rng(batch)
    vocab = engine.cfg.vocab_size
    for slot in range(batch):   # fill each slot with a prompt first
        engine.forward(rng.integers(0, vocab, prompt_len), [Span(slot, 0, prompt_len)])
    tokens = rng.integers(0, vocab, batch)
    pos = prompt_len

    def step():
        nonlocal tokens, pos
        logits = engine.forward(tokens, [Span(s, pos, 1) for s in range(batch)])
        tokens = logits.argmax(axis=-1)
        pos += 1
    step()
    return batch / median_time(step, steps)


def prefill_rate(engine, n_tokens: int, chunk: int = 128) -> float:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, engine.cfg.vocab_size, n_tokens)

    def run():
        for start in range(0, n_tokens, chunk):
            part = ids[start:start + chunk]
            engine.forward(part, [Span(0, start, len(part))])
    run()
    return n_tokens / median_time(run, 3)


def run_bench(model_path, die: str = "cpu", steps: int = 32, batches=(1, 4, 8)) -> dict:
    engine = load_engine(model_path, die=die, n_slots=max(batches), ctx=1024)
    engine.warm_up()
    result = {
        "model": str(model_path),
        "die": engine.device.die_id,
        "load_s": round(engine.load_seconds, 2),
        "prefill_tok_s": round(prefill_rate(engine, 512), 1),
        "decode_tok_s": {str(b): round(decode_rate(engine, b, steps), 1) for b in batches},
        "floor_tok_s": round(1.0 / matmul_floor(engine, steps), 1),
    }
    result["decode_1_vs_floor"] = round(result["decode_tok_s"]["1"] / result["floor_tok_s"], 3)
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss is KiB on Linux
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    result["weight_bytes"] = engine.model.w.nbytes()
    result["kv_bytes"] = engine.model.kv.nbytes
    return result


def main(args) -> int:
    print(json.dumps(run_bench(args.model, die=args.die, steps=args.steps), indent=2))
    return 0
