"""`pantheon bench engine`: in-process speed of the forward on one die.

Prints one JSON object:
  prefill_tok_s   prompt tokens/s through 128-token chunks
  decode_tok_s    {"1": .., "4": .., "8": ..} aggregate decode tokens/s per batch size
                  (batch / median step time: forward + greedy pick)
  floor_tok_s     batch-1 tokens/s if a decode step cost only its weight matmuls
                  (this model's own matrices, timed back to back on the spot,
                  median of as many repeats as decode steps)
  decode_1_at_context_tok_s  with --contexts 256,4096: batch-1 decode tokens/s after a
                  prompt of each length (steps alternating between them, median), and
                  longest_vs_shortest_context their ratio
  isa             on a CPU die, the kernels' build target (PANTHEON_ISA: native, avx2, generic)
  peak_rss_bytes  the process's peak resident memory
  weight_bytes, kv_bytes, file_bytes and their ratios (weights / file, RSS / (file + KV))
--synthetic qwen35-wide benchmarks a random-weight model of that shape (bench/synthetic.py)
instead of -m; --batches 1,8,16 picks the decode batch sizes (default 1,4,8). With
--compare-llama BIN_DIR, llama.cpp's llama-bench runs on the same file with the same thread
count right after, and "llama" holds its pp / tg figures and the ratios (ours / theirs);
where BIN_DIR also holds llama-batched-bench (the anchor's build dir: `make
llama-batched-bench`), it decodes the same batch sizes after the same 64-token prompts
("llama": "decode_tok_s", aggregate, and "ratios": "decode_vs_batched" per batch size).
With --rounds N the speed figures are measured N times (llama.cpp's after each of our
rounds, so the two alternate) and each figure is the median, the rounds' own under
"rounds" (and "llama": "rounds", "ratios_by_round").
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..common import settings
from ..worker.engine import load_engine
from ..worker.model import Span, linear
from ..worker.qmatrix import QMatrix


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
    mats = w.matrices()[1:] + [w.head]          # the embedding is a lookup, not a product
    if w.embed is not None:
        mats = mats[1:]
    def cols(m):
        first = m[0] if isinstance(m, list) else m
        return first.cols if isinstance(first, QMatrix) else first.shape[0]
    inputs = [xp.ones((1, cols(m)), dtype=np.float32) for m in mats]

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


def decode_at_contexts(engine, contexts: list[int], steps: int, chunk: int = 256) -> dict:
    """Batch-1 decode tokens/s after a prompt of each length in `contexts` (slot i holds
    contexts[i]): how a step's cost grows with the history (attention) or does not
    (recurrent layers). The steps alternate between the contexts, so a shared machine's
    changing load falls on all of them alike."""
    rng = np.random.default_rng(0)
    tokens, pos = [], list(contexts)
    for slot, n in enumerate(contexts):
        ids = rng.integers(0, engine.cfg.vocab_size, n)
        for start in range(0, n, chunk):
            part = ids[start:start + chunk]
            engine.forward(part, [Span(slot, start, len(part))])
        tokens.append(ids[-1:])
    times: list[list[float]] = [[] for _ in contexts]
    for rep in range(steps + 1):
        for slot in range(len(contexts)):
            t0 = time.perf_counter()
            tokens[slot] = engine.forward(tokens[slot], [Span(slot, pos[slot], 1)]).argmax(axis=-1)
            engine.device.synchronize()
            if rep:                                  # the first step of each warms up
                times[slot].append(time.perf_counter() - t0)
            pos[slot] += 1
    return {str(n): round(1.0 / float(np.median(t)), 1) for n, t in zip(contexts, times)}


def prefill_rate(engine, n_tokens: int, chunk: int = 128) -> float:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, engine.cfg.vocab_size, n_tokens)

    def run():
        for start in range(0, n_tokens, chunk):
            part = ids[start:start + chunk]
            engine.forward(part, [Span(0, start, len(part))])
    run()
    return n_tokens / median_time(run, 3)


PROMPT_LEN = 64         # each decode slot's prompt (llama-batched-bench's -npp too)
MAX_BATCH = 64          # --batches: slots of 1,024 positions each, their KV committed at load


def measure(engine, steps: int, batches) -> dict:
    """One round of the speed figures: prefill, decode per batch size, the floor."""
    figures = {
        "prefill_tok_s": round(prefill_rate(engine, 512), 1),
        "decode_tok_s": {str(b): round(decode_rate(engine, b, steps, PROMPT_LEN), 1)
                         for b in batches},
        "floor_tok_s": round(1.0 / matmul_floor(engine, steps), 1),
    }
    if "1" in figures["decode_tok_s"]:
        figures["decode_1_vs_floor"] = round(figures["decode_tok_s"]["1"] / figures["floor_tok_s"], 3)
    return figures


def parse_batches(text: str) -> list[int]:
    """--batches: distinct positive batch sizes, ascending (ValueError saying what is wrong)."""
    try:
        batches = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"--batches takes batch sizes like 1,4,8, not {text!r}") from None
    if not batches or batches[0] < 1 or batches[-1] > MAX_BATCH:
        raise ValueError(f"--batches takes batch sizes from 1 to {MAX_BATCH}, not {text!r}")
    return batches



def medians(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds (tokens/s, one decimal; a dict of figures, such
    as the decode batches, key by key)."""
    med = lambda values: round(float(np.median(values)), 1)
    out = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            out[key] = {k: med([r[key][k] for r in rounds]) for k in value}
        else:
            out[key] = med([r[key] for r in rounds])
    return out


def median_round(rounds: list[dict]) -> dict:
    out = medians([{k: v for k, v in r.items() if k != "decode_1_vs_floor"} for r in rounds])
    if "1" in out["decode_tok_s"]:
        out["decode_1_vs_floor"] = round(out["decode_tok_s"]["1"] / out["floor_tok_s"], 3)
    return out


def kv_bytes_per_position(engine) -> int:
    """The bytes a position of one slot takes in the worker's KV caches (all layers)."""
    state = engine.model.state
    kv = [layer for layer in state.layers if hasattr(layer, "kinds")]
    return sum(layer.nbytes for layer in kv) // (state.n_slots * state.ctx)


def run_bench(model_path, die: str = "cpu", steps: int = 32, batches=(1, 4, 8),
              quantize: str = "auto", contexts=(), rounds: int = 1, between=None,
              activations: str = "int16", kv_cache=None) -> dict:
    """The figures of `rounds` rounds (medians; each round's own under "rounds" when there
    are several), `between()` called after each round: a shared machine's speed moves
    by minutes, and alternating with the reference puts both on the same minutes."""
    ctx = max([1024] + [c + steps + 8 for c in contexts])
    engine = load_engine(model_path, die=die, n_slots=max([*batches, len(contexts)]), ctx=ctx,
                         quantize=quantize, activations=activations,
                         **({"kv_cache": kv_cache} if kv_cache else {}))
    engine.warm_up()
    result = {
        "model": str(model_path),
        "die": engine.device.die_id,
        "quantize": quantize,
        "activations": engine.activations,
        "threads": len(os.sched_getaffinity(0)),
        "isa": settings.isa() if die == "cpu" else None,     # the CPU kernels' build target
        "load_s": round(engine.load_seconds, 2),
    }
    each = []
    for _ in range(rounds):
        each.append(measure(engine, steps, batches))
        if between is not None:
            between(result["threads"])
    result |= median_round(each)
    if rounds > 1:
        result["rounds"] = each
    if contexts:
        rates = decode_at_contexts(engine, list(contexts), steps)
        result["decode_1_at_context_tok_s"] = rates
        result["longest_vs_shortest_context"] = round(
            rates[str(max(contexts))] / rates[str(min(contexts))], 3)
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss is KiB on Linux
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    result["weight_bytes"] = engine.model.w.nbytes()
    result["kv_bytes"] = engine.model.state.nbytes
    caches = [layer.kinds for layer in engine.model.state.layers if hasattr(layer, "kinds")]
    result["kv_cache"] = ("/".join(caches[0]) if caches[0][0] != caches[0][1] else caches[0][0]) \
        if caches else None
    result["kv_bytes_per_position"] = kv_bytes_per_position(engine)
    result["formats"] = engine.model.w.formats()
    if Path(model_path).is_file():
        size = Path(model_path).stat().st_size
        result["file_bytes"] = size
        result["weights_vs_file"] = round(result["weight_bytes"] / size, 3)
        result["rss_vs_file_plus_kv"] = round(result["peak_rss_bytes"] / (size + result["kv_bytes"]), 3)
    d = result["decode_tok_s"]
    if "1" in d and "8" in d:
        result["batch8_vs_batch1"] = round(d["8"] / d["1"], 2)
    return result


def run_llama(exe: Path, argv: list[str], parse) -> dict:
    """Run one of llama.cpp's tools and parse(stdout); any failure is a LlamaBenchError
    naming the tool."""
    out = subprocess.run([str(exe), *argv], capture_output=True, text=True)
    try:
        if out.returncode != 0:
            raise ValueError(f"exit status {out.returncode}: {out.stderr.strip()[-300:]}")
        return parse(out.stdout)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise LlamaBenchError(f"{exe} failed: {e}") from None


def llama_bench(bin_dir: str, model_path, threads: int) -> dict:
    """llama.cpp's pp512 / tg64 on the same file with the same threads (tokens/s)."""
    def parse(stdout):
        figures = {}
        for row in json.loads(stdout):
            key = "pp" if row.get("n_prompt") and not row.get("n_gen") else "tg"
            figures[f"{key}_tok_s"] = round(float(row["avg_ts"]), 1)
        return figures
    return run_llama(Path(bin_dir) / "llama-bench",
                     ["-m", str(model_path), "-t", str(threads), "-p", "512", "-n", "64",
                      "-r", "3", "-o", "json"], parse)


def llama_batched(bin_dir: str, model_path, threads: int, batches, steps: int) -> dict:
    """llama.cpp's aggregate decode tokens/s per batch size (llama-batched-bench: each of
    `b` sequences gets a PROMPT_LEN-token prompt, then `steps` decode steps together)."""
    def parse(stdout):
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        rates = {str(int(row["pl"])): round(float(row["speed_tg"]), 1) for row in rows}
        if sorted(rates, key=int) != [str(b) for b in batches]:
            raise ValueError(f"batch sizes {sorted(rates, key=int)} in its output, "
                             f"{list(batches)} asked")
        return {"decode_tok_s": rates}
    ctx = max(batches) * (PROMPT_LEN + steps) + 64
    return run_llama(Path(bin_dir) / "llama-batched-bench",
                     ["-m", str(model_path), "-t", str(threads), "-c", str(ctx),
                      "-npp", str(PROMPT_LEN), "-ntg", str(steps),
                      "-npl", ",".join(str(b) for b in batches), "--output-format", "jsonl"],
                     parse)


class LlamaBenchError(RuntimeError):
    pass


def compare(ours: dict, theirs: dict) -> dict:
    ratios = {}
    decode = ours["decode_tok_s"]
    if "tg_tok_s" in theirs:
        if "1" in decode:
            ratios["decode1_vs_tg"] = round(decode["1"] / theirs["tg_tok_s"], 2)
        if "8" in decode:
            ratios["decode8_aggregate_vs_tg"] = round(decode["8"] / theirs["tg_tok_s"], 2)
    if "pp_tok_s" in theirs:
        ratios["prefill_vs_pp"] = round(ours["prefill_tok_s"] / theirs["pp_tok_s"], 2)
    if "decode_tok_s" in theirs:
        ratios["decode_vs_batched"] = {b: round(decode[b] / theirs["decode_tok_s"][b], 2)
                                       for b in decode if theirs["decode_tok_s"].get(b)}
    return ratios


def main(args) -> int:
    contexts = [int(c) for c in (getattr(args, "contexts", None) or "").split(",") if c]
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        print("error: --rounds must be at least 1", file=sys.stderr)
        return 2
    try:
        batches = parse_batches(getattr(args, "batches", None) or "1,4,8")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    theirs: list[dict] = []
    between = None
    if getattr(args, "compare_llama", None):
        bins = Path(args.compare_llama)
        if not (bins / "llama-bench").is_file():
            print(f"error: no llama-bench in {args.compare_llama}", file=sys.stderr)
            return 2
        batched = (bins / "llama-batched-bench").is_file()

        def between(threads):
            figures = llama_bench(args.compare_llama, args.model, threads)
            if batched:
                figures |= llama_batched(args.compare_llama, args.model, threads, batches,
                                         args.steps)
            theirs.append(figures)
    try:
        result = run_bench(args.model, die=args.die, steps=args.steps, batches=batches,
                           quantize=getattr(args, "quantize", "auto"), contexts=contexts,
                           rounds=rounds, between=between,
                           activations=getattr(args, "activations", "int16"),
                           kv_cache=getattr(args, "kv", None))
    except LlamaBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if theirs:
        llama = medians(theirs)
        llama["ratios"] = compare(result, llama)
        if rounds > 1:
            llama["rounds"] = theirs
            llama["ratios_by_round"] = [compare(ours, t) for ours, t in zip(result["rounds"], theirs)]
        result["llama"] = llama
    print(json.dumps(result, indent=2))
    return 0
