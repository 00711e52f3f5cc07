"""Constrained decoding: an llguidance matcher per request turns its grammar into a mask
of the tokens that may come next, so the sampled text always fits the grammar.

Per step the sampler sends `bitmask()` (llguidance's packed int32 words) to the die, which
expands it there and sets disallowed logits to -inf, then feeds the sampled id to
`accept()`; the scheduler ends the request when `finished()`. The mask for a state is
computed once (llguidance walks its token trie against the grammar's lexer: ~0.09 ms mean,
0.2 ms worst for JSON over SmolLM2's 49k vocabulary, against ~30 ms for its forward) and
cached until the next `accept()`, so `finished()` and the next step's `bitmask()` share it.
"""
from __future__ import annotations

import numpy as np

SUMMARY_CHARS = 160


def summary(text: str) -> str:
    """A grammar error fit for the request's reply: llguidance's first line, cut short.
    Its full message dumps the matcher's state and the grammar itself, which belong in no
    reply (and, before per-request isolation, reached every request of the batch)."""
    line = (text or "error").strip().splitlines()[0] if (text or "").strip() else "error"
    return line if len(line) <= SUMMARY_CHARS else line[:SUMMARY_CHARS - 3] + "..."


class Constraint:
    """One request's grammar state during generation."""

    def __init__(self, matcher, n_tokens: int, not_eos: np.ndarray):
        self._matcher = matcher
        self._n = n_tokens                    # ids the llguidance tokenizer knows
        self._not_eos = not_eos               # bool [n_tokens]: False at the EOS ids
        self._bits = np.full((1, (n_tokens + 31) // 32), -1, dtype=np.int32)
        self._filled = False                  # _bits holds the current state's mask
        self._allowed: np.ndarray | None = None  # bool [n_tokens] for the current state

    def bitmask(self) -> np.ndarray:
        """int32 [ceil(n_tokens / 32)]: the tokens allowed next, packed (bit k of word w is
        token 32*w + k; bits past the tokenizer's ids are 0). This is what goes to the die;
        it stays valid until the next `accept()`."""
        if not self._filled:
            from llguidance.numpy import fill_next_token_bitmask
            fill_next_token_bitmask(self._matcher, self._bits)
            if self._n % 32:
                self._bits[0, -1] &= (1 << (self._n % 32)) - 1
            self._filled = True
        return self._bits[0]

    def _current(self) -> np.ndarray:
        if self._allowed is None:
            # bit k of int32 word w is token 32*w + k: little-endian bytes, low bit first
            raw = self.bitmask().astype("<i4", copy=False).view(np.uint8)
            self._allowed = np.unpackbits(raw, bitorder="little")[:self._n].view(bool)
        return self._allowed

    def mask(self, vocab_size: int) -> np.ndarray | None:
        """bool [vocab_size]: the tokens allowed next. Ids the tokenizer does not know (a
        model's padded vocabulary) are never allowed; the array is the caller's to keep."""
        allowed = self._current()
        if vocab_size <= self._n:
            return allowed[:vocab_size].copy()
        out = np.zeros(vocab_size, dtype=bool)
        out[:self._n] = allowed
        return out

    def accept(self, token: int) -> None:
        """Advance past the sampled token; ValueError if the grammar does not allow it
        (the matcher then stays in its error state, so the request should end)."""
        token = int(token)
        if not 0 <= token < self._n:
            raise ValueError(f"token {token} is outside the grammar's vocabulary")
        self._allowed, self._filled = None, False
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token} rejected by the grammar: "
                             f"{summary(self._matcher.get_error() or 'not allowed here')}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here on, one after another (none if the
        next has a choice): speculation proposes them for free."""
        return list(self._matcher.compute_ff_tokens())

    def allows(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from the current state, the grammar allows (the
        state does not move)."""
        return int(self._matcher.validate_tokens(tokens)) if tokens else 0

    def finished(self) -> bool:
        """The grammar is complete and nothing but end-of-sequence may follow: generation
        must stop here (the EOS need not be sampled). True also once an EOS was accepted."""
        if self._matcher.is_stopped():
            return True
        if not self._matcher.is_accepting():
            return False
        return not (self._current() & self._not_eos).any()

    @property
    def error(self) -> str | None:
        """Why the matcher failed, if it did."""
        return summary(self._matcher.get_error()) if self._matcher.is_error() else None


class ConstraintFactory:
    """One model's llguidance tokenizer (built once: ~0.35 s for a 49k vocabulary) and the
    matchers made from it, one per constrained request."""

    def __init__(self, tokenizer):
        from llguidance import LLTokenizer
        # llguidance reads the same `tokenizers` pipeline we encode with (byte-level BPE and
        # SentencePiece byte fallback alike), so token bytes agree with our decode().
        eos = [i for i in (tokenizer.eos_id,) if i is not None]
        eos += sorted(set(tokenizer.eot_ids) - set(eos))
        self._tok = LLTokenizer(tokenizer._hf.to_str(), eos_token=eos or None)
        self.vocab_size = self._tok.vocab_size
        self.eos_ids = sorted(set(self._tok.eos_tokens))
        self._not_eos = np.ones(self.vocab_size, dtype=bool)
        self._not_eos[self.eos_ids] = False

    def make(self, grammar: str) -> Constraint:
        """A fresh matcher for `grammar`; ValueError when it does not compile (the frontend
        checks with common.grammar.validate_grammar first, so this is rare)."""
        from llguidance import LLMatcher
        matcher = LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {summary(matcher.get_error())}")
        return Constraint(matcher, self.vocab_size, self._not_eos)
