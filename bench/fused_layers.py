"""The fused C decode layer against the Python layers on one model, alternated.

    python -m pantheon.bench.fused_layers MODEL.gguf [--rounds 5] [--steps 16]
        [--batches 1,8] [--compare-llama BIN_DIR]
    python -m pantheon.bench.fused_layers --synthetic qwen35-wide ...

Each round times decode at each batch size with the Python layers ("before": what a
Gemma 3 or Qwen3.5 block ran until the C layer took its spec), then with the fused C
layer; the medians of the rounds are printed with the host's load average beside them.
With --compare-llama, llama-bench's tg and llama-batched-bench's batches on the same file
and threads (bench/engine.py) follow.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from ..worker import kernels_cpu
from ..worker.engine import load_engine
from ..worker.layers import decode_cpu
from .engine import LlamaBenchError, decode_rate, llama_batched, llama_bench
from .synthetic import SHAPES, synthetic_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pantheon.bench.fused_layers")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--synthetic", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--compare-llama", metavar="BIN_DIR")
    args = ap.parse_args(argv)
    path = synthetic_model(args.synthetic) if args.synthetic else args.model
    if not path:
        ap.error("a model file or --synthetic NAME")
    batches = [int(b) for b in args.batches.split(",")]
    engine = load_engine(path, n_slots=max(batches), ctx=64 + args.steps + 8)
    print("\n".join(engine.model.decode_c.describe()))
    rates = {(way, b): [] for way in ("python", "fused") for b in batches}
    for _ in range(args.rounds):
        for way in ("python", "fused"):
            decode_cpu.ENABLED[0] = way == "fused"
            for b in batches:
                rates[way, b].append(decode_rate(engine, b, args.steps))
    decode_cpu.ENABLED[0] = True
    out = {"model": os.path.basename(str(path)), "threads": kernels_cpu.threads(),
           "load": os.getloadavg()[0], "rounds": args.rounds,
           "decode_tok_s": {f"{way} b{b}": round(statistics.median(r), 1)
                            for (way, b), r in rates.items()}}
    if args.compare_llama:
        t = kernels_cpu.threads()
        try:
            out["llama"] = llama_bench(args.compare_llama, path, t) | \
                llama_batched(args.compare_llama, path, t, batches, args.steps)
        except LlamaBenchError as e:      # e.g. a synthetic file without a tokenizer
            out["llama"] = str(e)[-200:]
        out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
