"""Speculative decoding settings, as both sides read them: `serve --spec`, the admin
load body's `"spec"`, and the Load message's `Speculation` (worker/spec.py runs it)."""
from __future__ import annotations

from .protocol import Speculation

KINDS = ("ngram", "draft")
MAX_PROPOSAL = 16          # the longest proposal a request may verify in one step
MAX_NGRAM = 64
DEFAULT_N = 3              # the longest n-gram prompt lookup matches
DEFAULT_K = 8              # the longest proposal


def check(kind: str, n: int, k: int, draft: str = "") -> None:
    """ValueError naming the field that is wrong (the admin API's 400 repeats it)."""
    if kind and kind not in KINDS:
        raise ValueError(f"spec.kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "draft" and not draft:
        raise ValueError("spec.draft (the draft model's path) is required with kind draft")
    if draft and kind != "draft":
        raise ValueError(f"spec.draft is for kind draft, not {kind!r}")
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
    unknown = set(value) - {"kind", "n", "k", "draft"}
    if unknown:
        raise ValueError(f"spec.{sorted(unknown)[0]} is not a field of spec (kind, n, k, "
                         "draft)")
    kind = value.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"spec.kind must be one of {', '.join(KINDS)}, not {kind!r}")
    n, k = value.get("n", DEFAULT_N), value.get("k", DEFAULT_K)
    draft = value.get("draft", "")
    if not isinstance(draft, str):
        raise ValueError(f"spec.draft must be a path, not {type(draft).__name__}")
    check(kind, n, k, draft)
    return Speculation(kind, n, k, draft)


def effective(wanted, default):
    """A replica's speculation: its load's own (kind "": none) or else the server's."""
    spec = wanted if wanted is not None else default
    return spec if spec is not None and spec.kind else None


def check_draft(target, draft_path: str, target_bytes: int, draft_bytes: int):
    """The draft's config if it can serve `target` (a ModelConfig); ValueError naming
    spec.draft if not: another vocabulary, recurrent layers, or bigger than the target."""
    from .model_file import ModelFileError, open_model_file
    try:
        cfg, _ = open_model_file(draft_path, cached=True)
    except (ModelFileError, OSError, ValueError) as exc:
        raise ValueError(f"spec.draft: {exc}") from None
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"spec.draft: the draft's vocabulary ({cfg.vocab_size} tokens) is "
                         f"not the target's ({target.vocab_size}): a draft must share its "
                         "tokenizer")
    if cfg.fixed_bytes_per_slot():
        raise ValueError("spec.draft: a draft model with recurrent layers cannot be rolled "
                         "back; choose an attention-only model")
    if draft_bytes > target_bytes:
        raise ValueError(f"spec.draft: the draft ({draft_bytes / 2**20:.0f} MiB) is bigger "
                         f"than the model it drafts for ({target_bytes / 2**20:.0f} MiB)")
    return cfg
