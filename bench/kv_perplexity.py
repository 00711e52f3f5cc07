"""Perplexity of a text per KV cache type, scored as llama-perplexity scores it: chunks
of `--ctx` tokens (the first token of each replaced by BOS), the second half of each chunk
scored, the first half its context. Ours teacher-forces the second half a token at a
time (the decode path, which reads the cache every step). Beside llama.cpp's figure:

    llama-perplexity -m MODEL.gguf -f TEXT -c 256 --chunks 8 -fa on -ctk T -ctv T
    python -m pantheon.bench.kv_perplexity -m MODEL.gguf -f TEXT --ctx 256 --chunks 8
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from ..common.kv_cache import KVCacheTypes
from ..common.tokenizer import open_tokenizer
from ..worker.engine import load_engine
from ..worker.model import Span


def log_softmax(a):
    a = a - a.max()
    return a - math.log(np.exp(a).sum())


def perplexity(engine, ids: list[int], ctx: int, chunks: int, bos: int) -> float:
    nll, n = 0.0, 0
    for c in range(min(chunks, len(ids) // ctx)):
        chunk = [bos] + ids[c * ctx + 1:(c + 1) * ctx]
        half = ctx // 2
        row = engine.forward(np.array(chunk[:half]), [Span(0, 0, half)])[0]
        for i in range(half, ctx):
            nll -= log_softmax(row)[chunk[i]]
            n += 1
            if i + 1 < ctx:
                row = engine.forward(np.array([chunk[i]]), [Span(0, i, 1)])[0]
    return math.exp(nll / n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-f", "--file", required=True)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--types", default="f16,q8_0,q4_0", help="comma-separated; K/V for two")
    a = ap.parse_args(argv)
    tok = open_tokenizer(a.model)
    ids = tok.encode(open(a.file, encoding="utf-8").read())
    bos = tok.bos_id if getattr(tok, "bos_id", None) is not None else ids[0]
    out = {"model": os.path.basename(a.model), "tokens": len(ids), "ctx": a.ctx}
    for t in a.types.split(","):
        k, _, v = t.partition("/")                # "q8_0/q4_0": keys q8_0, values q4_0
        engine = load_engine(a.model, n_slots=1, ctx=a.ctx,
                             kv_cache=KVCacheTypes.of(k=k, v=v or k))
        out[t] = round(perplexity(engine, ids, a.ctx, a.chunks, bos), 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
