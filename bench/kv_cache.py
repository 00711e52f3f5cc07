"""KV cache types side by side on one model (issue 33's figures), as JSON:

- KV bytes per position of one slot, all layers, as the worker holds them;
- the slots x context that admission (frontend/dies.replica_bytes) accepts at one
  `--budget-mb`, at `--ctx` positions a slot;
- decode tok/s of a batch of `--batch` slots each holding `--ctx` positions, the types
  alternated in rounds (medians) on the same weights (one load: each type is a second
  sequence state beside them). The caches are filled with quantized random rows rather
  than prefilled (a 1.5B prefill of 8 x 2,048 tokens takes minutes on 2 cores): the
  attention reads every position either way; the logits are not looked at.

    python -m pantheon.bench.kv_cache -m MODEL.gguf [--ctx 2048] [--batch 8] \\
        [--budget-mb 4096] [--rounds 3] [--types f16,q8_0,q4_0] [--compare-llama DIR]
    python -m pantheon.bench.kv_cache -m MODEL.gguf --attention-only [--rounds 7]

`--attention-only` times the C decode attention alone: one layer's call over the batch's
caches with the model's heads, the types alternated in rounds (less noisy on a shared
host than whole steps, whose weights' products every type shares).

With `--compare-llama DIR` (a folder holding llama.cpp's `llama-batched-bench`, e.g. what
`../shared/tools/llama-anchor.sh` prints), each type is also run there with the same
cache types, batch, context and threads, and its decode rate printed beside ours:

    DIR/llama-batched-bench -m MODEL.gguf -c BATCH*CTX+64 -npp CTX-NTG -ntg NTG -npl BATCH \\
        -fa on -ctk T -ctv T -t THREADS --output-format jsonl

(llama.cpp prefills the BATCH x (CTX - NTG) prompt tokens first: minutes for a 1.5B model
on 2 cores; `--llama-shared-prompt` adds `-pps`, one prompt shared by the sequences, which
prefills once but leaves llama.cpp one copy of the history to read instead of BATCH.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from ..common.kv_cache import KVCacheTypes
from ..common.model_file import read_config
from ..frontend.dies import replica_bytes
from ..worker.engine import load_engine
from ..worker.kv_quant import quantize
from ..worker.model import Model, Span


def per_position(model: Model) -> int:
    kv = [s for s in model.state.layers if hasattr(s, "kinds")]
    return sum(s.nbytes for s in kv) // (model.state.n_slots * model.state.ctx)


def fill(model: Model, length: int, seed: int = 0) -> None:
    """Every slot's first `length` positions: rows of N(0, 1), stored as each cache's type."""
    rng = np.random.default_rng(seed)
    for s in model.state.layers:
        if not hasattr(s, "kinds"):
            continue
        n_slots, n_kv = s.k.shape[:2]
        rows = rng.standard_normal((n_kv, length, s.head_dim), dtype=np.float32)
        for slot in range(n_slots):
            s.k[slot, :, :length] = quantize(rows, s.kinds[0])
            s.v[slot, :, :length] = quantize(rows[::-1], s.kinds[1])


def decode_rate(model: Model, batch: int, start: int, steps: int) -> float:
    tokens = np.full(batch, 100, dtype=np.int64)
    began = time.perf_counter()
    for i in range(steps):
        model.forward(tokens, [Span(b, start + i, 1) for b in range(batch)])
    return batch * steps / (time.perf_counter() - began)


def run(path: str, types: list[str], ctx: int, batch: int, budget_mb: float, rounds: int,
        steps: int) -> dict:
    cfg = read_config(path)
    base = load_engine(path, n_slots=1, ctx=16)
    w = base.model.w
    models = {t: Model(cfg, w, np, batch, ctx + steps + 1,
                       kv_dtype=KVCacheTypes.of(t).held("cpu", False, True))
              for t in types}
    for m in models.values():
        fill(m, ctx)
    out = {"model": os.path.basename(path), "ctx": ctx, "batch": batch,
           "budget_mb": budget_mb, "load_avg": os.getloadavg()[0], "types": {}}
    budget = budget_mb * (1 << 20)
    for t, m in models.items():
        kv = KVCacheTypes.of(t)
        one = replica_bytes(path, cfg, "cpu", 1, ctx, kv=kv)
        slot_bytes = replica_bytes(path, cfg, "cpu", 2, ctx, kv=kv) - one
        weights = one - slot_bytes
        admitted = max(0, int((budget - weights) // slot_bytes))
        assert replica_bytes(path, cfg, "cpu", admitted, ctx, kv=kv) <= budget
        out["types"][t] = {"kv_bytes_per_position": per_position(m),
                           "slots_admitted": admitted, "slots_x_ctx": admitted * ctx}
    rates: dict[str, list[float]] = {t: [] for t in types}
    for _ in range(rounds):                       # alternated: the same minutes for each
        for t, m in models.items():
            decode_rate(m, batch, ctx, 2)         # warm
            rates[t].append(decode_rate(m, batch, ctx, steps))
    ref = "f16" if "f16" in types else types[0]
    f16 = out["types"][ref]
    for t in types:
        row = out["types"][t]
        row["decode_tok_s"] = round(statistics.median(rates[t]), 2)
        row["rounds_tok_s"] = [round(r, 2) for r in rates[t]]
        row["best_tok_s"] = round(max(rates[t]), 2)      # the least disturbed round
        row["bytes_vs_" + ref] = round(row["kv_bytes_per_position"] / f16["kv_bytes_per_position"], 4)
        row["slots_x_ctx_vs_" + ref] = round(row["slots_x_ctx"] / max(f16["slots_x_ctx"], 1), 3)
    for t in types:
        out["types"][t]["decode_vs_" + ref] = round(
            out["types"][t]["decode_tok_s"] / out["types"][ref]["decode_tok_s"], 3)
    out["load_avg_after"] = os.getloadavg()[0]
    return out


def attention_rates(cfg, types: list[str], ctx: int, batch: int, rounds: int,
                    reps: int = 10) -> dict:
    """The C decode attention alone (worker/kernels/attention.c), one layer's call over `batch`
    slots of `ctx` positions with the model's heads, the types alternated in rounds:
    {type: median ms a call, each round's}."""
    from ..worker import kernels_cpu
    rng = np.random.default_rng(0)
    hkv, hd, hq = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads
    rows = rng.standard_normal((batch, hkv, ctx, hd), dtype=np.float32)
    caches = {t: (quantize(rows, t), quantize(rows[:, :, ::-1], t)) for t in types}
    q = (rng.standard_normal((batch, hq, hd)) * hd ** -0.5).astype(np.float32)
    new = rng.standard_normal((batch, hkv, hd)).astype(np.float32)
    out = np.empty((batch, hq * hd), dtype=np.float32)
    bounds = kernels_cpu.DecodeBounds(np.arange(batch), np.zeros(batch, dtype=np.int64),
                                      np.full(batch, ctx - 1), caches[types[0]][0].shape)
    ms: dict[str, list[float]] = {t: [] for t in types}
    for _ in range(rounds):
        for t, (k, v) in caches.items():
            kernels_cpu.attend_decodes(q, new, new, k, v, bounds, out)          # warm
            began = time.perf_counter()
            for _ in range(reps):
                kernels_cpu.attend_decodes(q, new, new, k, v, bounds, out)
            ms[t].append((time.perf_counter() - began) / reps * 1e3)
    return {t: {"ms": round(statistics.median(ms[t]), 3), "best_ms": round(min(ms[t]), 3),
                "rounds_ms": [round(x, 3) for x in ms[t]]} for t in types}


def llama_command(bindir: str, path: str, kind: str, ctx: int, batch: int, ntg: int,
                  threads: int, shared: bool) -> list[str]:
    """llama-batched-bench's command line for one cache type (both K and V)."""
    cmd = [str(Path(bindir) / "llama-batched-bench"), "-m", path,
           "-c", str(batch * ctx + 64), "-npp", str(ctx - ntg), "-ntg", str(ntg),
           "-npl", str(batch), "-fa", "on", "-ctk", kind, "-ctv", kind, "-t", str(threads),
           "--output-format", "jsonl"]
    return cmd + (["-pps"] if shared else [])


def llama_rates(bindir: str, path: str, types: list[str], ctx: int, batch: int, ntg: int,
                threads: int, shared: bool) -> dict:
    """{type: llama-batched-bench's decode and prefill tok/s} (one run per type: each
    prefills its prompts first)."""
    out = {}
    for t in types:
        cmd = llama_command(bindir, path, t, ctx, batch, ntg, threads, shared)
        done = subprocess.run(cmd, capture_output=True, text=True)
        rows = [json.loads(line) for line in done.stdout.splitlines()
                if line.startswith("{") and "speed_tg" in line]
        if done.returncode != 0 or not rows:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                               f"{done.stderr[-1500:]}")
        r = rows[-1]
        out[t] = {"decode_tok_s": round(r["speed_tg"], 2), "prefill_tok_s": round(r["speed_pp"], 2),
                  "command": " ".join(cmd), "load_avg": os.getloadavg()[0]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--types", default="f16,q8_0,q4_0")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget-mb", type=float, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--attention-only", action="store_true",
                    help="time the C decode attention alone (one layer's call, the model's "
                         "heads), not the model's decode")
    ap.add_argument("--compare-llama", metavar="DIR",
                    help="a folder with llama.cpp's llama-batched-bench: its decode rate "
                         "per type beside ours")
    ap.add_argument("--llama-ntg", type=int, default=32,
                    help="tokens llama-batched-bench generates per sequence (after CTX - NTG "
                         "prompt tokens)")
    ap.add_argument("--llama-shared-prompt", action="store_true",
                    help="pass -pps: one prompt shared by the sequences (one prefill)")
    a = ap.parse_args(argv)
    types = a.types.split(",")
    if a.compare_llama and not (Path(a.compare_llama) / "llama-batched-bench").exists():
        ap.error(f"--compare-llama: no llama-batched-bench in {a.compare_llama}")
    if a.attention_only:
        got = attention_rates(read_config(a.model), types, a.ctx, a.batch, a.rounds)
        ref = got[types[0]]["ms"]
        for t in types:
            got[t]["speed_vs_" + types[0]] = round(ref / got[t]["ms"], 3)
        print(json.dumps({"model": os.path.basename(a.model), "ctx": a.ctx, "batch": a.batch,
                          "load_avg": os.getloadavg()[0], "attention_ms": got}, indent=1))
        return 0
    out = run(a.model, types, a.ctx, a.batch, a.budget_mb, a.rounds, a.steps)
    if a.compare_llama:
        from ..worker.kernels_cpu import threads
        llama = llama_rates(a.compare_llama, a.model, types, a.ctx, a.batch, a.llama_ntg,
                            threads(), a.llama_shared_prompt)
        out["llama_batched_bench"] = llama
        for t in types:
            out["types"][t]["vs_llama"] = round(
                out["types"][t]["decode_tok_s"] / llama[t]["decode_tok_s"], 3)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
