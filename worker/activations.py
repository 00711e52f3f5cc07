"""How precisely a CPU die's products see the activations: `--activations auto|int8|int16`.

The K-quant products (Q4_K, Q5_K, Q6_K) at batch 1 quantize x per super-block of 256:
to int16 (16000 steps: teacher-forced against the fp32 forward every model tried stays
within top-1 >= 99 %, mean KL <= 0.01) or, in builds that have the kernels (AVX2 ones),
to int8 (127 steps, llama.cpp's q8_K: half the multiplies). int8 keeps some models inside
that bound (Qwen2.5-1.5B: top-1 100 %, KL 0.0005) and takes others outside it (tiny
models with near-tied logits: 92-95 %), so it is a per-model choice:

- `int16`: the exact-as-possible default of the kernels;
- `int8`: every product that has an int8 kernel takes it;
- `auto`: at the first load of a file, a short built-in text is run token by token both
  ways; int8 is kept where it agrees with int16 on top-1 at >= 99 % of the positions with
  mean KL <= 0.01 nats. The verdict is cached by the file's identity (size and the
  sha256 of its first and last 4 MiB) in the cache folder's `activations.json`, so later
  loads decide at once.
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
VERSION = 1                 # of the calibration: a change re-decides every file
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
               if not kernels_cpu.HAS_X8[0] else "no Q4_K, Q5_K or Q6_K matrix")
        return Verdict("int16", why)
    if choice == "int16":
        _set(mats, False)
        return Verdict("int16", "asked")
    if choice == "int8":
        _set(mats, True)
        return Verdict("int8", "asked", len(mats))
    key = f"{file_key(path)}:{quantize}:v{VERSION}"
    known = _cache_read().get(key)
    if known is None:
        known = calibrate(model, path, mats)
        _cache_write(key, known)
        how = "measured"
    else:
        how = "cached"
    used = "int8" if known["top1"] >= TOP1_MIN and known["kl"] <= KL_MAX else "int16"
    _set(mats, used == "int8")
    return Verdict(used, f"auto, {how}: int8 against int16 over {known['tokens']} positions "
                         f"top-1 {100 * known['top1']:.1f} %, mean KL {known['kl']:.2g}",
                   len(mats) if used == "int8" else 0)


def calibrate(model, path: str | Path, mats: list) -> dict:
    """Teacher-forced over the built-in text in slot 0 (free at load): int16 in one
    prefill, int8 token by token (batch 1, where its products run); the top-1 agreement
    and mean KL(int16 || int8) over its positions."""
    from ..common.tokenizer import open_tokenizer
    from .model import Span
    tokens = open_tokenizer(path).encode(CALIBRATION_TEXT)
    tokens = tokens[:max(2, min(CALIBRATION_TOKENS, model.ctx - 1))]
    n = len(tokens)
    try:
        _set(mats, False)            # int16: one prefill (its many-row products: the same
        ref = model.forward(np.array(tokens), [Span(0, 0, n, verify=n)])   # sums as batch 1)
        _set(mats, True)             # int8: token by token, where its products run
        got = np.concatenate([model.forward(np.array([t]), [Span(0, i, 1)])
                              for i, t in enumerate(tokens)])
    finally:
        _set(mats, False)
    ref, got = np.asarray(ref, dtype=np.float64), got.astype(np.float64)
    top1 = float(np.mean(ref.argmax(axis=1) == got.argmax(axis=1)))
    lp = ref - ref.max(axis=1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    lq = got - got.max(axis=1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(axis=1, keepdims=True))
    kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1)))
    return {"top1": top1, "kl": max(kl, 0.0), "tokens": len(tokens),
            "file": Path(path).name}


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
