"""A GPU die's attention over a KV cache of each type, as JSON: the kernels that read the
blocks in place (worker/attention_cuda.py) beside the array path they replaced (the
window dequantized to float32, then CuPy products: `KVState.window` + `attend_decodes`),
alternated in rounds, medians.

One attention layer of a model's geometry (default Qwen2.5-1.5B: 12 query heads, 2 KV
heads of 128), `--batch` slots each holding `--ctx` positions of random rows: a decode
step (one query a slot) and a prefill chunk (`--chunk` queries of one slot after its
history). Per type: microseconds per layer and step, the KV bytes a decode step reads
and the rate that makes. On the emulated die (`--die emu:0`, the default here: no GPU)
the figures time the host shim, not a GPU: use it with small sizes to check the script.

    python -m pantheon.bench.attention_gpu --die 0 [--ctx 2048] [--batch 8] [--chunk 128] \\
        [--heads 12] [--kv-heads 2] [--head-dim 128] [--rounds 5] [--types f16,q8_0,q4_0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from ..worker import attention_cuda
from ..worker.device import open_device
from ..worker.kv_quant import quantize
from ..worker.layers.attention import DecodeGroup, attend_decodes
from ..worker.model import Span
from ..worker.sequence_state import KVState


def timed(sync, fn, repeat: int) -> float:
    fn()                                   # compile, first touch
    sync()
    began = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - began) / repeat * 1e6


def run(die: str, types: list[str], ctx: int, batch: int, chunk: int, heads: int,
        kv_heads: int, head_dim: int, rounds: int, repeat: int) -> dict:
    device = open_device(die)
    xp = device.xp
    sync = xp.cuda.Device().synchronize
    rng = np.random.default_rng(0)
    states = {}
    for kind in types:
        s = KVState(batch, kv_heads, ctx, head_dim, xp, kind)
        rows = rng.standard_normal((kv_heads, ctx, head_dim), dtype=np.float32)
        for slot in range(batch):
            s.k[slot] = xp.asarray(quantize(rows, kind))
            s.v[slot] = xp.asarray(quantize(rows[::-1].copy(), kind))
        states[kind] = s
    pos = ctx - chunk - 1                       # decodes at the last position but the chunk's
    decode = [Span(b, pos, 1) for b in range(batch)]
    prefill = [Span(0, pos - chunk, chunk)]
    q1 = xp.asarray(rng.standard_normal((batch, heads, head_dim), dtype=np.float32) * 0.1)
    k1 = xp.asarray(rng.standard_normal((batch, kv_heads, head_dim), dtype=np.float32))
    qc = xp.asarray(rng.standard_normal((chunk, heads, head_dim), dtype=np.float32) * 0.1)
    kc = xp.asarray(rng.standard_normal((chunk, kv_heads, head_dim), dtype=np.float32))
    out = xp.zeros((max(batch, chunk), heads * head_dim), dtype=xp.float32)

    def kernels(state, spans, q, k):
        plan = attention_cuda.StepPlan(spans, xp)
        return lambda: (attention_cuda.write(state, k, k, plan),
                        attention_cuda.attend(state, q, out, plan, None))

    def array_path(state, q, k):               # the path the kernels replaced (decodes)
        group = DecodeGroup(decode, xp)

        def step():
            state.write_rows(group.slots, group.pos, k, k)
            lo, bias = group.mask(None)
            kw, vw = state.window(slice(group.lo, group.hi), lo, group.length)
            attend_decodes(q, kw, vw, bias, group.sel)
        return step

    cases = {(kind, name): fn for kind, s in states.items() for name, fn in (
        ("decode", kernels(s, decode, q1, k1)), ("decode_array_path", array_path(s, q1, k1)),
        ("prefill_chunk", kernels(s, prefill, qc, kc)))}
    times: dict = {key: [] for key in cases}
    for _ in range(rounds):                     # alternated: each round times every case once
        for key, fn in cases.items():
            times[key].append(timed(sync, fn, repeat))
    report = {"device": device.name, "load": os.getloadavg()[0], "ctx": ctx, "batch": batch,
              "chunk": chunk, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "rounds": rounds, "types": {}}
    for kind, s in states.items():
        read = s.nbytes // ctx * (pos + 1)      # every slot's keys and values up to pos
        row = {name: round(statistics.median(times[kind, name]), 1)
               for name in ("decode", "decode_array_path", "prefill_chunk")}
        row["decode_kv_bytes"] = int(read)
        row["decode_GBps"] = round(read / row["decode"] / 1e3, 2)
        report["types"][kind] = row
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--die", default="emu:0")
    ap.add_argument("--types", default="f16,q8_0,q4_0")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)
    if a.ctx <= 2 * a.chunk + 1:
        ap.error("--ctx must exceed twice --chunk (the chunk's history, then its queries)")
    print(json.dumps(run(a.die, a.types.split(","), a.ctx, a.batch, a.chunk, a.heads,
                         a.kv_heads, a.head_dim, a.rounds, a.repeat)))


if __name__ == "__main__":
    main()
