"""int8 against int16 activations on one model, alternated in one process, as JSON.

    PANTHEON_ISA=avx2 python -m pantheon.bench.activations -m MODEL [--rounds 4] [--steps 24]

Batch-1 and batch-8 decode (after a prompt of --prompt tokens in each slot) and prefill
(that prompt as one chunk) tok/s with every K-quant product on int16, then on int8,
round after round (the same engine, one switch flipped: a shared host's drift falls on both), and
the calibration `--activations auto` measures (top-1 agreement and mean KL of int8
against int16 over the built-in text). Builds without int8 products (AVX-512 ones) say
so and measure nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from pantheon.common import blas_env

blas_env.apply()                # before NumPy loads OpenBLAS

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pantheon.bench.activations", description=__doc__)
    ap.add_argument("-m", "--model", help="GGUF file (default: SmolLM2)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per measurement")
    ap.add_argument("--prompt", type=int, default=128, help="prefill chunk, tokens")
    args = ap.parse_args(argv)
    from pantheon.common import settings
    from pantheon.common.default_model import default_model_path
    from pantheon.worker import activations as act
    from pantheon.worker import kernels_cpu
    from pantheon.worker.engine import load_engine
    from pantheon.worker.model import Span
    path = args.model or str(default_model_path())
    engine = load_engine(path, n_slots=8, ctx=max(256, args.prompt + args.steps + 8),
                         activations="int16")
    mats = act._int8_matrices(engine.model.w)
    out = {"model": path, "isa": settings.isa(), "threads": len(os.sched_getaffinity(0)),
           "int8_matrices": len(mats)}
    if not mats:
        out["note"] = ("nothing to compare: " + ("this build has no int8 products" if not
                       kernels_cpu.HAS_X8[0] else "the model has no Q4_K/Q5_K/Q6_K/IQ4_XS matrix"))
        print(json.dumps(out))
        return 0

    prompt = np.arange(args.prompt) % 1000 + 10
    for slot in range(8):       # every slot holds the prompt: decodes follow it, as in use
        engine.model.forward(prompt, [Span(slot, 0, args.prompt)])

    def decode() -> float:
        started = time.perf_counter()
        for i in range(args.steps):
            engine.model.forward(np.array([5]), [Span(0, args.prompt + i, 1)])
        return args.steps / (time.perf_counter() - started)

    def decode8() -> float:
        started = time.perf_counter()
        for i in range(args.steps):
            engine.model.forward(np.full(8, 5), [Span(s, args.prompt + i, 1) for s in range(8)])
        return 8 * args.steps / (time.perf_counter() - started)

    def prefill() -> float:
        started = time.perf_counter()
        engine.model.forward(prompt, [Span(0, 0, args.prompt)])
        return args.prompt / (time.perf_counter() - started)

    speeds = {"int16": [], "int8": []}
    speeds8 = {"int16": [], "int8": []}
    fills = {"int16": [], "int8": []}
    for _ in range(args.rounds):
        for name in ("int16", "int8"):
            act._set(mats, name == "int8")
            speeds[name].append(round(decode(), 2))
            speeds8[name].append(round(decode8(), 2))
            fills[name].append(round(prefill(), 2))
    act._set(mats, False)

    def ratio(figures):
        return round(statistics.median(b / a for a, b in zip(figures["int16"], figures["int8"])), 3)
    out |= {"decode_1_tok_s": speeds, "int8_vs_int16_median": ratio(speeds),
            "decode_8_tok_s": speeds8, "batch8_int8_vs_int16_median": ratio(speeds8),
            "prefill_tok_s": fills, "prefill_int8_vs_int16_median": ratio(fills),
            "calibration": act.calibrate(engine.model, path, mats),
            "bounds": {"top1_min": act.TOP1_MIN, "kl_max": act.KL_MAX},
            "load_avg": os.getloadavg()[0]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
