"""Speculative decoding settings, as both sides read them: `serve --spec`, the admin
load body's `"spec"`, and the Load message's `Speculation` (worker/spec.py runs it)."""
from __future__ import annotations

from .protocol import Speculation

KINDS = ("ngram",)
MAX_PROPOSAL = 16          # the longest proposal a request may verify in one step
MAX_NGRAM = 64
DEFAULT_N = 3              # the longest n-gram prompt lookup matches
DEFAULT_K = 8              # the longest proposal


def check(kind: str, n: int, k: int) -> None:
    """ValueError naming the field that is wrong (the admin API's 400 repeats it)."""
    if kind and kind not in KINDS:
        raise ValueError(f"spec.kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_PROPOSAL:
        raise ValueError(f"spec.k (the longest proposal) must be an integer in "
                         f"1-{MAX_PROPOSAL}, got {k!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NGRAM:
        raise ValueError(f"spec.n (the longest n-gram matched) must be an integer in "
                         f"1-{MAX_NGRAM}, got {n!r}")


def parse(value) -> Speculation | None:
    """The admin body's `"spec"`: null, a kind ("ngram"), or {"kind", "n", "k"}; None for
    none. ValueError (naming the field) for anything else."""
    if value is None or value == "" or value == "none":
        return None
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise ValueError(f"spec must be a kind or an object, not {type(value).__name__}")
    unknown = set(value) - {"kind", "n", "k"}
    if unknown:
        raise ValueError(f"spec.{sorted(unknown)[0]} is not a field of spec (kind, n, k)")
    kind = value.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"spec.kind must be one of {', '.join(KINDS)}, not {kind!r}")
    n, k = value.get("n", DEFAULT_N), value.get("k", DEFAULT_K)
    check(kind, n, k)
    return Speculation(kind, n, k)
