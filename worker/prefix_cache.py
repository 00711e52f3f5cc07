"""KV states kept in host memory after their slot was given to someone else.

When the scheduler reuses a warm slot for a different conversation, the
slot's state (its token history and the matching KV positions) moves here,
into an LRU bounded by a byte budget. A later request whose prompt begins
with a stored history (the session's next turn, a retried request, a common
system prompt) gets that state copied back into its slot and skips those
tokens. Entries are keyed by session id when there is one (a session keeps
only its latest state), else by their tokens, and scoped by a salt (one per API
key, see protocol.Generate.cache_salt): an entry serves only its own salt.

Plain Python: the states are opaque objects made and restored by the KV
cache, with their size in bytes.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class Entry:
    tokens: np.ndarray        # the history whose KV the state holds
    state: object
    nbytes: int
    session_id: str | None
    salt: str = ""


class PrefixCache:
    def __init__(self, budget_bytes: int, min_tokens: int = 16):
        self.budget, self.min_tokens = budget_bytes, min_tokens
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.used = 0
        self.hits = self.misses = 0

    @staticmethod
    def key(tokens: np.ndarray, session_id: str | None, salt: str = "") -> str:
        if session_id:
            return f"s:{salt}\0{session_id}"
        digest = hashlib.blake2b(tokens.astype(np.int64).tobytes(), digest_size=16).hexdigest()
        return f"t:{salt}\0{digest}"

    def worth_keeping(self, n_tokens: int, nbytes: int) -> bool:
        return n_tokens >= self.min_tokens and nbytes <= self.budget

    def put(self, tokens, state, nbytes: int, session_id: str | None, salt: str = "") -> None:
        tokens = np.asarray(tokens, dtype=np.int64)
        if not self.worth_keeping(len(tokens), nbytes):
            return
        key = self.key(tokens, session_id, salt)
        self.drop(key)
        self.entries[key] = Entry(tokens, state, nbytes, session_id, salt)
        self.used += nbytes
        while self.used > self.budget:
            self.drop(next(iter(self.entries)))          # least recently used first

    def drop(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used -= entry.nbytes

    def best(self, prompt, session_id: str | None = None, whole: bool = False,
             salt: str = "") -> tuple[Entry | None, int]:
        """The stored state sharing the longest prefix with `prompt`, and that length.

        Only entries of `salt` count; the session's own entry wins ties. With `whole` (a state that cannot be cut)
        only entries whose entire history is a prefix of the prompt, shorter than
        it, count. A hit moves the entry to the most-recently-used end.
        """
        prompt = np.asarray(prompt, dtype=np.int64)
        best_key, best_len = None, 0
        for key, entry in self.entries.items():
            if entry.salt != salt:
                continue
            n = common_prefix(entry.tokens, prompt)
            if whole and (n != len(entry.tokens) or n >= len(prompt)):
                continue
            if n > best_len or (n == best_len and n and entry.session_id == session_id):
                best_key, best_len = key, n
        if best_key is None or best_len < self.min_tokens:
            self.misses += 1
            return None, 0
        self.hits += 1
        self.entries.move_to_end(best_key)
        return self.entries[best_key], best_len

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.used, "budget": self.budget,
                "hits": self.hits, "misses": self.misses}
