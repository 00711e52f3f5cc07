"""How precisely a CPU die's products see the activations: `--activations auto|int8|int16`.

The K-quant products (Q4_K, Q5_K, Q6_K, IQ4_XS) quantize x per super-block of 256: to int16
(16000 steps: teacher-forced against the fp32 forward every model tried stays within
top-1 >= 99 %, mean KL <= 0.01) or, in builds that have the kernels (AVX2 ones), to
int8 (llama.cpp's q8_K: the weights' bytes meet x in vpmaddubsw; Qwen2.5-1.5B Q4_K_M
batch-1 decode 1.2x, prefill 1.4x the int16 kernels). One step of 127 per 256 loses the
small values of a block beside an outlier channel, so such a block of a row is held as
two int8 digits (int16's steps), and a row with a third of its blocks so held takes the
int16 kernels (worker/kernels/x8.c). int8 keeps some models inside the bound and takes
others outside it (tiny models with near-tied logits; Qwen2.5-1.5B's top-1 by a little),
so it is a per-model choice:

- `int16`: the exact-as-possible default of the kernels;
- `int8`: every product that has an int8 kernel takes it, at every batch size;
- `auto`: at the first load of a file, a short built-in text is run both ways, as a
  prefill (chunks of 32: the many-row kernels) and token by token (batch 1); int8 is
  kept where both agree with int16 on top-1 at >= 99 % of the positions with mean KL
  <= 0.01 nats. The verdict is cached by the file's identity (size and the sha256 of
  its first and last 4 MiB) in the cache folder's `activations.json`, so later loads
  decide at once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common import settings
from . import kernels_cpu

log = logging.getLogger(__name__)

CHOICES = settings.ACTIVATIONS
TOP1_MIN = 0.99             # the quantized engine's accuracy bound, as for weights
KL_MAX = 0.01
CALIBRATION_TOKENS = 192
VERSION = 2                 # of the calibration: a change re-decides every file
                            # (2: int8 held per 256, on many rows too, measured as a prefill)
CALIBRATION_TEXT = (
    "The lighthouse keeper climbed the stairs at dusk, as he had every evening for thirty "
    "years, and wound the clockwork that turned the lamp. Ships passing the reef saw its "
    "beam sweep the water twice a minute. In winter the storms came from the north-east "
    "and the spray reached the gallery; he wrote each one in the log, with the barometer "
    "reading, the wind's direction and the names of the boats that sheltered in the bay.\n\n"
    "def merge(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "Q: A train leaves at 9:40 and arrives at 13:05. How long is the journey?\n"
    "A: From 9:40 to 12:40 is three hours, and from 12:40 to 13:05 is 25 minutes, so the "
    "journey takes 3 hours and 25 minutes.\n")


@dataclass
class Verdict:
    used: str               # "int8" or "int16"
    why: str                # for the load log
    matrices: int = 0       # products that take int8


def check(choice: str) -> str:
    """The choice, or a ValueError naming the choices."""
    if choice not in CHOICES:
        raise ValueError(f"activations must be one of {', '.join(CHOICES)}, not {choice!r}")
    return choice


def _int8_matrices(weights) -> list:
    out = []
    for item in weights.matrices():
        out += [m for m in (item if isinstance(item, list) else [item])
                if kernels_cpu.takes_int8(m)]
    return out


def _set(mats: list, on: bool) -> None:
    for m in mats:
        kernels_cpu.set_int8(m, on)


def apply(model, path: str | Path, choice: str, quantize: str = "auto") -> Verdict:
    """Set `model`'s products to the activations `choice` asks for (auto: measured or
    cached as the module says) and say what was chosen."""
    check(choice)
    if model.xp is not np:
        return Verdict("int16", "a GPU die's products take their own activations")
    mats = _int8_matrices(model.w)
    if not mats:
        why = ("this build has no int8 products (AVX-512 builds keep their int16 ones)"
               if not kernels_cpu.HAS_X8[0] else "no Q4_K, Q5_K, Q6_K or IQ4_XS matrix")
        return Verdict("int16", why)
    if choice == "int16":
        _set(mats, False)
        return Verdict("int16", "asked")
    if choice == "int8":
        _set(mats, True)
        return Verdict("int8", "asked", len(mats))
    if model.layers != (0, model.cfg.n_layers):
        _set(mats, False)
        return Verdict("int16", "auto on a stage of a split replica (the calibration "
                                "measures whole models)")
    key = f"{file_key(path)}:{quantize}:v{VERSION}"
    known = _cache_read().get(key)
    if known is None:
        try:
            known = calibrate(model, path, mats)
        except Exception as exc:     # e.g. a tokenizer the file's text cannot go through
            _set(mats, False)        # the load goes on, as exact as it can be; not cached
            return Verdict("int16", f"auto: the calibration could not run "
                                    f"({type(exc).__name__}: {exc})")
        _cache_write(key, known)
        how = "measured"
    else:
        how = "cached"
    used = "int8" if known["top1"] >= TOP1_MIN and known["kl"] <= KL_MAX else "int16"
    _set(mats, used == "int8")
    return Verdict(used, f"auto, {how}: int8 against int16 over {known['tokens']} positions, "
                         f"the worse of prefill and decode: top-1 {100 * known['top1']:.1f} %, "
                         f"mean KL {known['kl']:.2g}",
                   len(mats) if used == "int8" else 0)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    row -= row.max()
    return row - np.log(np.exp(row).sum())


def calibrate(model, path: str | Path, mats: list) -> dict:
    """Teacher-forced over the built-in text in slot 0 (free at load): int16 in prefill
    chunks of 32 (the reference), then int8 the same way (the many-row kernels) and token
    by token (batch 1). Each int8 side's top-1 agreement and mean KL(int16 || int8) over
    the positions; the verdict's top1 / kl are the worse side's. The int16 side is kept
    as each position's top token and log-probabilities in fp16 (a 152k vocabulary: 58 MB
    for the 192 positions), the int8 sides compared row by row."""
    from ..common.tokenizer import open_tokenizer
    from .model import Span
    tokens = open_tokenizer(path).encode(CALIBRATION_TEXT)
    tokens = tokens[:max(2, min(CALIBRATION_TOKENS, model.ctx - 1))]
    n, vocab = len(tokens), model.cfg.vocab_size
    ref_top = np.empty(n, dtype=np.int64)
    ref_lp = np.empty((n, vocab), dtype=np.float16)

    def prefill():
        for start in range(0, n, 32):
            k = min(32, n - start)
            rows = np.asarray(model.forward(np.array(tokens[start:start + k]),
                                            [Span(0, start, k, verify=k)]), dtype=np.float32)
            yield from enumerate(rows, start)

    def decode():
        for i, t in enumerate(tokens):
            yield i, np.asarray(model.forward(np.array([t]), [Span(0, i, 1)])[0])

    def compare(rows) -> dict:
        agree, kl = 0, 0.0
        for i, row in rows:
            lq, lp = _log_softmax(row), ref_lp[i].astype(np.float64)
            agree += int(row.argmax() == ref_top[i])
            kl += float(np.sum(np.exp(lp) * (lp - lq)))
        return {"top1": agree / n, "kl": max(kl / n, 0.0)}

    try:
        _set(mats, False)
        for i, row in prefill():
            ref_top[i] = row.argmax()
            ref_lp[i] = _log_softmax(row)
        _set(mats, True)
        sides = {"prefill": compare(prefill()), "decode": compare(decode())}
    finally:
        _set(mats, False)
    return {"top1": min(v["top1"] for v in sides.values()),
            "kl": max(v["kl"] for v in sides.values()), **sides,
            "tokens": n, "file": Path(path).name}


def file_key(path: str | Path) -> str:
    """A model file's identity: its size and the sha256 of its first and last 4 MiB (a
    folder: of its files' names and sizes, and its largest file's ends)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:                  # a file's own name does not matter, a folder's do
        h.update(f"{f.relative_to(path) if path.is_dir() else ''}:{f.stat().st_size};".encode())
    big = max(files, key=lambda f: f.stat().st_size)
    size, span = big.stat().st_size, 4 << 20
    with open(big, "rb") as fh:
        h.update(fh.read(span))
        fh.seek(max(0, size - span))
        h.update(fh.read(span))
    return h.hexdigest()[:32]


def _cache_path() -> Path:
    return settings.cache_dir() / "activations.json"


def _cache_read() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _cache_write(key: str, verdict: dict) -> None:
    """Add one verdict (written whole through a rename: a reader never sees half)."""
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _cache_read()
        data[key] = verdict
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".activations-")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:               # a read-only cache: measured again next time
        log.warning("could not record the activations verdict in %s: %s", path, exc)
