"""Prefill with and without the blocks-of-32 groups product (worker/kernels/b_groups.c: 256-bit
builds, 17+ rows of x), alternated in one process, as JSON.

    PANTHEON_ISA=avx2 python -m pantheon.bench.groups -m MODEL [--rounds 5] [--tokens 512]

Each round times one prefill of --tokens tokens in chunks of 128 (as `bench engine`)
with the groups off (what took those products before: dequantized tiles and BLAS), then
on: the same engine, one switch flipped, so a shared host's drift falls on both. Builds
without the groups (AVX-512 ones: their token lanes) say so and measure nothing.
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
    ap = argparse.ArgumentParser(prog="pantheon.bench.groups", description=__doc__)
    ap.add_argument("-m", "--model", help="GGUF file (default: SmolLM2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=512, help="prefill length, in chunks of 128")
    args = ap.parse_args(argv)
    from pantheon.common import settings
    from pantheon.common.default_model import default_model_path
    from pantheon.worker import kernels_cpu
    from pantheon.worker.engine import load_engine
    from pantheon.worker.model import Span
    from pantheon.worker.qmatrix import QMatrix
    path = args.model or str(default_model_path())
    engine = load_engine(path, n_slots=1, ctx=args.tokens + 8)
    out = {"model": path, "isa": settings.isa(), "threads": len(os.sched_getaffinity(0))}
    flat = [m for it in engine.model.w.matrices() for m in (it if isinstance(it, list) else [it])]
    probe = next((m for m in flat if isinstance(m, QMatrix)), None)
    if probe is None or kernels_cpu.plan(probe, 128) != "b_groups":
        out["note"] = "nothing to compare: this build or model does not take the groups"
        print(json.dumps(out))
        return 0
    ids = np.random.default_rng(0).integers(0, engine.cfg.vocab_size, args.tokens)

    def prefill() -> float:
        started = time.perf_counter()
        for start in range(0, args.tokens, 128):
            part = ids[start:start + 128]
            engine.forward(part, [Span(0, start, len(part))])
        return args.tokens / (time.perf_counter() - started)
    fills = {"off": [], "on": []}
    prefill()
    for _ in range(args.rounds):
        for name in ("off", "on"):
            with kernels_cpu.options(bgroups=0 if name == "off" else -1):
                fills[name].append(round(prefill(), 1))
    out |= {"prefill_tok_s": fills,
            "on_vs_off_median": round(statistics.median(b / a for a, b in zip(fills["off"], fills["on"])), 3),
            "load_avg": os.getloadavg()[0]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
