"""Choosing the next token of each sequence in a batch.

Logits arrive on the host as float32 [B, V] (only sampled rows ever leave a
GPU). Each sequence carries its own parameters and its own random generator,
so a seeded request reproduces its output whatever runs beside it.

Order of operations, as llama.cpp and vLLM apply them: logit_bias →
repetition penalty (last `repeat_last_n` tokens, prompt included) →
presence/frequency penalties (generated tokens) → greedy, or temperature →
top_k → top_p → min_p → draw.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SamplingParams:
    """One request's sampling settings; validated by `check()`."""

    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None

    def check(self, vocab_size: int) -> "SamplingParams":
        rules = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
            (all(0 <= int(t) < vocab_size for t in self.logit_bias),
             f"logit_bias token ids must be in [0, {vocab_size})"),
        ]
        for ok, message in rules:
            if not ok:
                raise ValueError(message)
        return self


class SequenceSampler:
    """Sampling state of one sequence: its parameters, history and generator."""

    # Candidates below max_prob / CUTOFF are skipped before sorting for top_p
    # when the ones above already hold the nucleus (exact, and much cheaper).
    CUTOFF = 1e4

    def __init__(self, params: SamplingParams, prompt: list[int], constraint=None):
        self.p = params
        self.constraint = constraint     # grammar: masks disallowed tokens, then follows
        self.recent = list(prompt[-params.repeat_last_n:]) if params.repeat_last_n else []
        self.generated: Counter[int] = Counter()
        self.rng = np.random.default_rng(params.seed)
        self.bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        self.bias_vals = np.fromiter(params.logit_bias.values(), dtype=np.float32)

    def accept(self, token: int) -> None:
        """Record a token that joined the sequence (sampled or forced)."""
        self.generated[token] += 1
        if self.p.repeat_last_n:
            self.recent.append(token)
            del self.recent[:-self.p.repeat_last_n]

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """Biases and penalties applied to a copy of one row of logits [V]."""
        p = self.p
        logits = logits.astype(np.float32, copy=True)
        if self.bias_ids.size:
            logits[self.bias_ids] += self.bias_vals
        if p.repetition_penalty != 1.0 and self.recent:
            ids = np.unique(np.asarray(self.recent))
            vals = logits[ids]
            logits[ids] = np.where(vals > 0, vals / p.repetition_penalty,
                                   vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.generated:
            ids = np.fromiter(self.generated.keys(), dtype=np.int64)
            counts = np.fromiter(self.generated.values(), dtype=np.float32)
            logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return logits

    def sample(self, logits: np.ndarray) -> int:
        """The next token for this sequence from its logits row [V]; recorded."""
        adjusted = self.adjust(logits)
        if self.constraint is not None:
            allowed = self.constraint.mask(adjusted.size)
            if allowed is not None:
                adjusted[~allowed] = -np.inf
        token = self.choose(adjusted)
        if self.constraint is not None:
            self.constraint.accept(token)
        self.accept(token)
        return token

    def choose(self, logits: np.ndarray) -> int:
        p = self.p
        if p.temperature == 0 or p.top_k == 1:
            return int(np.argmax(logits))
        logits = logits / np.float32(p.temperature)
        ids = None
        if 0 < p.top_k < logits.size:
            ids = np.argpartition(logits, -p.top_k)[-p.top_k:]
            logits = logits[ids]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            ids, probs = self.nucleus(ids, probs)
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs.max()
            ids = np.flatnonzero(keep) if ids is None else ids[keep]
            probs = probs[keep]
        probs = probs / probs.sum()
        pick = int(self.rng.choice(probs.size, p=probs))
        return pick if ids is None else int(ids[pick])

    def nucleus(self, ids, probs):
        """The smallest highest-probability set whose mass reaches top_p."""
        cand = np.flatnonzero(probs >= probs.max() / self.CUTOFF)
        if probs[cand].sum() < self.p.top_p:   # the nucleus reaches below the cut
            cand = np.arange(probs.size)
        order = cand[np.argsort(-probs[cand], kind="stable")]
        cum = np.cumsum(probs[order])
        keep = order[:int(np.searchsorted(cum, self.p.top_p)) + 1]
        return (keep if ids is None else ids[keep]), probs[keep]
