"""Two builds of the CPU kernels, product by product, alternated call by call in one process.

    python -m pantheon.bench.kernels_ab OTHER.so [--batches 1,2,4,5,8,12,16,64] [--core 1]
    PANTHEON_ISA=avx2 python -m pantheon.bench.kernels_ab --int8 [--batches 1,8,32]

With --int8 (and no OTHER.so) it compares this build's int8 activations against its
int16 ones on the K-quant shapes (a matrix's act8 on and off; builds with int8 kernels:
AVX2 ones), x with an outlier channel in 3 % of its row-blocks, as activations have.

OTHER.so is another build of the kernels (an older commit's, or one compiled with other
flags: `cc -O3 -march=native -pthread -shared -fPIC -std=c11 -o OTHER.so pantheon.c -lm`);
it is set up as kernels_cpu sets up its own (pn_init where it has one, else the former
pn_pool_init). The process is pinned to one core (--core), so the pools have no second
thread for a busy shared host to preempt: what differs is the code. Each case runs a
product through pn_matmul_int on random blocks of SmolLM2's Q4_1 and Qwen2.5's Q4_K /
Q6_K shapes, the two builds taking turns call by call; printed as JSON lines: the
median microseconds per call of each build and their ratio (this build over OTHER).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time


def random_blocks(qtype, rows: int, blocks: int, seed: int = 0):
    """A GGUF tensor of random blocks with sane fp16 scales (as the kernel tests make)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
    scales = {QT.Q4_1: [0, 2], QT.Q4_K: [0, 2], QT.Q6_K: [208], QT.IQ4_XS: [0]}
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows * blocks, size), dtype=np.uint8)
    for off in scales[qtype]:
        b[:, off:off + 2] = rng.uniform(1e-3, 0.1, rows * blocks).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return b.reshape(-1), (rows, blocks * block)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pantheon.bench.kernels_ab", description=__doc__)
    ap.add_argument("other", nargs="?", help="another build of the kernels (.so)")
    ap.add_argument("--int8", action="store_true", help="this build's int8 activations "
                    "against its int16 ones (no OTHER.so)")
    ap.add_argument("--batches", default="1,2,4,5,8,12,16,64", help="rows of x")
    ap.add_argument("--core", type=int, default=1, help="the one core to run on")
    ap.add_argument("--calls", type=int, default=200, help="calls per build and case "
                    "(a quarter of that from 16 rows)")
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.core})            # before the pools start: one thread each
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from pantheon.worker import kernels_cpu as kc, kernels_header, matrices

    this = kc.library()
    if args.int8:
        return int8_vs_int16(args, kc, matrices, QT, np)
    if not args.other:
        ap.error("OTHER.so is needed unless --int8")
    other = ctypes.CDLL(os.path.abspath(args.other))
    names = [n for n in kc.DECLS.functions if hasattr(other, n)]
    kernels_header.declare(other, kernels_header.Header(
        functions={n: kc.DECLS.functions[n] for n in names}, structs=kc.DECLS.structs))
    if hasattr(other, "pn_init"):
        other.pn_init(ctypes.byref(kc.DECLS.structs["PnOptions"](**kc.default_options())))
    else:
        other.pn_pool_init.argtypes = [ctypes.c_int, ctypes.c_int64]
        other.pn_pool_init(kc.threads(), kc.POOL_SPIN_US)
    shapes = ((QT.Q4_1, 1536, 18, "Q4_1 [1536, 576]"), (QT.Q4_1, 576, 48, "Q4_1 [576, 1536]"),
              (QT.Q4_K, 1536, 6, "Q4_K [1536, 1536]"), (QT.Q6_K, 1536, 6, "Q6_K [1536, 1536]"))
    for qtype, rows, blocks, name in shapes:
        raw, shape = random_blocks(qtype, rows, blocks)
        m = matrices.from_gguf(raw, qtype, shape)
        for batch in (int(b) for b in args.batches.split(",")):
            x = np.random.default_rng(batch).standard_normal((batch, m.cols)).astype(np.float32)
            y = np.empty((batch, m.rows), np.float32)
            mat, scratch = kc._cmat(m), kc._cscratch(batch, m.cols)
            times: dict = {"this": [], "other": []}
            calls = args.calls if batch < 16 else max(1, args.calls // 4)
            for i in range(2 * calls):
                side = ("this", "other")[i % 2 ^ (i // 2) % 2]     # ABBA: neither always first
                lib = this if side == "this" else other
                t0 = time.perf_counter_ns()
                ran = lib.pn_matmul_int(mat, kc._ptr(x), batch, scratch, kc._ptr(y))
                times[side].append(time.perf_counter_ns() - t0)
            if not ran:
                continue
            a, b = statistics.median(times["this"]), statistics.median(times["other"])
            print(json.dumps({"case": name, "rows": batch, "plan": kc.plan(m, batch),
                              "this_us": round(a / 1e3, 1), "other_us": round(b / 1e3, 1),
                              "this_vs_other": round(a / b, 3)}), flush=True)
    print(json.dumps({"load_avg": os.getloadavg()[0]}))
    return 0


def int8_vs_int16(args, kc, matrices, QT, np) -> int:
    """This build's K-quant products with the matrix's act8 on against off, call by
    call (ABBA), on Qwen2.5-1.5B's shapes; JSON lines as main's."""
    if not kc.HAS_X8[0]:
        print(json.dumps({"note": "this build has no int8 activations (AVX2 builds do)"}))
        return 0
    shapes = ((QT.Q4_K, 8960, 6, "Q4_K [8960, 1536]"), (QT.Q4_K, 1536, 35, "Q4_K [1536, 8960]"),
              (QT.Q6_K, 1536, 35, "Q6_K [1536, 8960]"))
    lib = kc.library()
    for qtype, rows, blocks, name in shapes:
        raw, shape = random_blocks(qtype, rows, blocks)
        m = matrices.from_gguf(raw, qtype, shape)
        for batch in (int(b) for b in args.batches.split(",")):
            rng = np.random.default_rng(batch)
            x = rng.standard_normal((batch, m.cols)).astype(np.float32)
            hits = rng.random((batch, m.cols // 256)) < 0.03
            for b, k in zip(*np.nonzero(hits)):
                x[b, k * 256 + 5] *= 50
            y = np.empty((batch, m.rows), np.float32)
            scratch = kc._cscratch(batch, m.cols)
            times: dict = {"int8": [], "int16": []}
            calls = args.calls if batch < 16 else max(1, args.calls // 4)
            for i in range(2 * calls):
                side = ("int8", "int16")[i % 2 ^ (i // 2) % 2]
                kc.set_int8(m, side == "int8")
                mat = kc._cmat(m)
                t0 = time.perf_counter_ns()
                lib.pn_matmul_int(mat, kc._ptr(x), batch, scratch, kc._ptr(y))
                times[side].append(time.perf_counter_ns() - t0)
            a, b = statistics.median(times["int8"]), statistics.median(times["int16"])
            print(json.dumps({"case": name, "rows": batch, "int8_us": round(a / 1e3, 1),
                              "int16_us": round(b / 1e3, 1), "int16_vs_int8": round(b / a, 3),
                              "int8_gmac_s": round(m.rows * m.cols * batch / a, 1)}), flush=True)
    print(json.dumps({"load_avg": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
