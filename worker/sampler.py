"""Choosing the next token of every sequence in a step, on the die.

Logits stay where the forward left them, float32 [B, V] (NumPy on the CPU die,
CuPy on a GPU die): `Sampler.sample` works on them there, and only the chosen
ids (and the logprobs a request asked for) come back to the host. Full rows
would not: 8 x 151,936 x 4 B per step caps a K80's ~0.4 GB/s host link.

Each sequence keeps its parameters, history, grammar and random generator on
the host (`SequenceSampler`); what the die needs of them per step is small:
scatter indices for biases and penalties, a packed grammar bitset, and one
uniform float per sampled row, drawn from the request's own generator, so a
seeded request reproduces its output whatever runs beside it.

Order of operations, as llama.cpp and vLLM apply them: logit_bias →
repetition penalty (last `repeat_last_n` tokens, prompt included) →
presence/frequency penalties (generated tokens) → grammar mask → greedy, or
temperature → top_k → top_p → min_p → draw.

- greedy (temperature 0 or top_k 1): argmax, ties to the lowest id; no draw.
- top_k and top_p keep a prefix of the tokens ranked from most to least
  likely (ties: lower id first): the k first, then the fewest whose
  probability (over what top_k kept) reaches top_p.
- min_p keeps the tokens at least min_p times as likely as the likeliest.
- the draw: u = the generator's next float in [0, 1); the kept tokens in id
  order, each weighted by its probability; the first whose running share of
  the total exceeds u (as NumPy's `Generator.choice` picks).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..common.protocol import Sampling
from .constraint import summary

F32 = np.float32


# One request's sampling settings: the wire's own declaration, checked by `check()`.
SamplingParams = Sampling


class SequenceSampler:
    """Sampling state of one sequence, on the host: parameters, history, grammar, generator."""

    def __init__(self, params: SamplingParams, prompt: list[int], constraint=None,
                 logprobs: int = -1):
        self.p = params
        self.constraint = constraint     # grammar: masks disallowed tokens, then follows
        self.logprobs = logprobs         # -1: none; N: the chosen token's logprob and the top N
        self.recent = list(prompt[-params.repeat_last_n:]) if params.repeat_last_n else []
        self.generated: Counter[int] = Counter()
        # a negative seed (the API allows them) names the same 64-bit seed as its two's complement
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % (1 << 64))
        self.bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        self.bias_vals = np.fromiter(params.logit_bias.values(), dtype=np.float32)
        # why this sequence cannot go on (its grammar failed): the scheduler ends it alone,
        # with this short message; the rest of its batch never sees the failure
        self.failed: str | None = None

    def fail(self, exc: Exception) -> None:
        if self.failed is None:
            self.failed = summary(str(exc)) or type(exc).__name__

    @property
    def greedy(self) -> bool:
        return self.p.temperature == 0 or self.p.top_k == 1

    def accept(self, token: int) -> None:
        """Record a token that joined the sequence: its grammar moves past it too."""
        if self.constraint is not None:
            self.constraint.accept(token)
        self.generated[token] += 1
        if self.p.repeat_last_n:
            self.recent.append(token)
            del self.recent[:-self.p.repeat_last_n]


class Sampler:
    """Samples the rows of a step where their logits are: `xp` is numpy or cupy."""

    def __init__(self, xp, settle=None):
        self.xp = xp
        self.host = np.asarray if xp is np else xp.asnumpy
        self.settle = settle        # waits for the die's queued work (Device.settle)

    def sample(self, logits, seqs: list[SequenceSampler]) -> list[tuple[int, list | None]]:
        """(token, logprobs entry or None) for each row of logits [B, V] float32 and its
        sequence, which records the token. The logits are consumed (changed in place)."""
        xp = self.xp
        assert logits.dtype == F32, f"logits are {logits.dtype}, not float32"
        logits = xp.ascontiguousarray(logits)
        asked = [i for i, s in enumerate(seqs) if s.logprobs >= 0]
        raw = logits[asked] if asked else None          # a copy, before any change
        self.adjust(logits, seqs)
        self.mask(logits, seqs)
        tokens = self.choose(logits, seqs)
        entries: list = [None] * len(seqs)
        if asked:
            tops = [seqs[i].logprobs for i in asked]
            for i, entry in zip(asked, self.logprobs(raw, tokens[asked], tops)):
                entries[i] = entry
        if self.settle is not None:
            self.settle()           # the step's kernels are done: the copy will not wait
        picks = self.host(tokens).tolist()
        for seq, token in zip(seqs, picks):
            if seq.failed is None:
                try:                    # one grammar's failure is its own request's
                    seq.accept(token)
                except Exception as exc:
                    seq.fail(exc)
        return list(zip(picks, entries))

    # -- logits → adjusted logits, in place ------------------------------------------------
    def adjust(self, logits, seqs: list[SequenceSampler]) -> None:
        """logit_bias, then the repetition penalty, then presence/frequency penalties: each
        one scatter over flat indices row * V + id (unique within a scatter)."""
        xp, V = self.xp, logits.shape[1]
        flat = logits.reshape(-1)                        # a view: logits are contiguous
        bias = [(i, s.bias_ids, s.bias_vals) for i, s in enumerate(seqs) if s.bias_ids.size]
        if bias:
            idx, vals = self.scatter(bias, V)
            flat[idx] += vals
        rep = []
        for i, s in enumerate(seqs):
            if s.p.repetition_penalty != 1.0 and s.recent:
                ids = np.unique(np.asarray(s.recent, dtype=np.int64))
                rep.append((i, ids, np.full(ids.size, s.p.repetition_penalty, F32)))
        if rep:
            idx, pen = self.scatter(rep, V)
            vals = flat[idx]
            flat[idx] = xp.where(vals > 0, vals / pen, vals * pen)
        pay = []
        for i, s in enumerate(seqs):
            if (s.p.presence_penalty or s.p.frequency_penalty) and s.generated:
                ids = np.fromiter(s.generated.keys(), dtype=np.int64)
                counts = np.fromiter(s.generated.values(), dtype=F32)
                pay.append((i, ids, s.p.frequency_penalty * counts + s.p.presence_penalty))
        if pay:
            idx, vals = self.scatter(pay, V)
            flat[idx] -= vals

    def scatter(self, parts, V: int):
        """Per-row (row, ids, values) as flat indices and values on the die."""
        idx = np.concatenate([row * V + ids for row, ids, _ in parts])
        vals = np.concatenate([v for _, _, v in parts]).astype(F32, copy=False)
        return self.xp.asarray(idx), self.xp.asarray(vals)

    def mask(self, logits, seqs: list[SequenceSampler]) -> None:
        """Disallowed tokens of constrained rows → -inf. Each row's grammar gives a packed
        bitset (int32 words: bit k of word w is token 32w + k, little-endian); the words
        cross and are expanded here. Ids past the bitset are never allowed."""
        xp = self.xp
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return
        words = []
        for i in rows:          # a grammar that fails here fails its own request alone
            try:
                words.append(seqs[i].constraint.bitmask() if seqs[i].failed is None else None)
            except Exception as exc:
                seqs[i].fail(exc)
                words.append(None)
        width = max((w.size for w in words if w is not None), default=(logits.shape[1] + 31) // 32)
        words = np.stack([w if w is not None else np.full(width, -1, np.int32)
                          for w in words]).astype("<i4", copy=False)
        bits = xp.unpackbits(xp.asarray(words.view(np.uint8)), bitorder="little")
        bits = bits.reshape(len(rows), -1)                                 # [C, 32 W]: 1 = allowed
        V = logits.shape[1]
        if bits.shape[1] < V:                                              # a padded vocabulary
            bits = xp.pad(bits, ((0, 0), (0, V - bits.shape[1])))
        # -inf where banned, 0.0 where allowed, as float32 bit patterns: adding them is
        # branch-free (np.where over a scattered mask costs ~2.5 ns a token, this ~0.3)
        ban = ((1 - bits[:, :V]).astype(xp.uint32) * xp.uint32(0xFF800000)).view(F32)
        if len(rows) == len(seqs):
            logits += ban
        else:
            logits[rows] += ban

    # -- adjusted logits → token ids on the die -----------------------------------------
    def choose(self, logits, seqs: list[SequenceSampler]):
        """Token ids [B]: one argmax for the greedy rows, a draw for each of the others."""
        xp = self.xp
        drawn = [i for i, s in enumerate(seqs) if not s.greedy]
        if not drawn:
            return xp.argmax(logits, axis=1)
        if len(drawn) == len(seqs):
            return self.draw(logits, seqs)
        tokens = xp.argmax(logits, axis=1)
        tokens[drawn] = self.draw(logits[drawn], [seqs[i] for i in drawn])
        return tokens

    def draw(self, x, seqs: list[SequenceSampler]):
        """Temperature, top_k, top_p, min_p and the draw for rows that sample; x [S, V] is
        theirs to change."""
        xp = self.xp
        S, V = x.shape
        ps = [s.p for s in seqs]
        x /= xp.asarray(np.array([p.temperature for p in ps], F32))[:, None]
        m = x.max(axis=1, keepdims=True)                                    # [S, 1]
        u = np.array([s.rng.random() for s in seqs])                        # one float a row
        k = np.array([p.top_k if 0 < p.top_k < V else V for p in ps])
        top_p = np.array([p.top_p for p in ps])
        min_p = np.array([p.min_p for p in ps], F32)
        cut = (k < V) | (top_p < 1) | (min_p > 0)
        if not cut.any():
            return self.everything(x, m, u)
        if cut.all():
            return self.filtered(x, m, k, top_p, min_p, u)
        tokens = xp.empty(S, dtype=xp.int64)
        whole, few = np.flatnonzero(~cut).tolist(), np.flatnonzero(cut).tolist()
        tokens[whole] = self.everything(x[whole], m[whole], u[whole])
        tokens[few] = self.filtered(x[few], m[few], k[few], top_p[few], min_p[few], u[few])
        return tokens

    def everything(self, x, m, u):
        """A draw over the whole vocabulary."""
        x -= m
        return self.inverse_cdf(self.xp.exp(x, out=x), u)

    # Candidates for top_k / top_p: the tokens at least e^FLOOR as likely as the likeliest,
    # FLOOR going down row by row while a row's prefix may reach past them. Within e^-9.2 of
    # the top, SmolLM2 keeps a median of ~400 of its 49k tokens (at most a few thousand);
    # taking them costs a compare, where ranking every token is a partition or a sort.
    FLOORS = tuple(float(f) for f in np.log([1e-4, 1e-6, 1e-9, 1e-14, 1e-24])) + (-np.inf,)

    def filtered(self, x, m, k, top_p, min_p, u):
        """A draw over each row's top_k / top_p prefix, and its min_p share, found among
        candidate tokens close enough to the likeliest."""
        xp = self.xp
        S, V = x.shape
        ranked = (k < V) | (top_p < 1)                 # else min_p alone: all candidates
        with np.errstate(divide="ignore"):
            own = np.log(min_p) - 1e-3                 # just below min_p: exp's rounding
        z_all = None
        if ((top_p < 1) & (k == V)).any():             # probabilities over the vocabulary
            z_all = xp.exp(x - m).sum(axis=1, dtype=xp.float64)
        finite = None                                  # tokens not masked out, when asked
        kd, pd, level = xp.asarray(k), xp.asarray(top_p), np.zeros(S, dtype=np.int64)
        while True:
            offset = xp.asarray(np.where(ranked, np.take(self.FLOORS, level), own).astype(F32))
            # a floor just below: rounding of m + offset never drops a candidate
            ids, xc, count = self.candidates(x, m[:, 0] + offset - F32(1e-5) * abs(m[:, 0]))
            top = -xp.sort(-xc, axis=1)                                     # descending
            # float64: a nucleus can be tens of thousands of tokens long
            cum = xp.cumsum(xp.exp(top - m), axis=1, dtype=xp.float64)
            z = xp.take_along_axis(cum, xp.minimum(kd, cum.shape[1])[:, None] - 1, axis=1)
            if z_all is not None:
                z = xp.where(kd[:, None] < V, z, z_all[:, None])   # mass of top_k's set
            n_p = (cum / z < pd[:, None]).sum(axis=1) + 1
            n = xp.minimum(kd, xp.where(pd < 1, n_p, V))        # a prefix of the ranking
            # exact when every token that could be in the prefix (or in z) is a candidate
            short = self.host(~(((kd <= count) | (kd == V)) & (n <= count))) & ranked
            if short.any():                            # unless the rest is masked out
                finite = (x > -np.inf).sum(axis=1) if finite is None else finite
                short &= self.host(count < finite)
            if not short.any():
                break
            level = np.minimum(level + short, len(self.FLOORS) - 1)    # the last takes all
        n = xp.minimum(n, count)
        t = xp.take_along_axis(top, n[:, None] - 1, axis=1)                  # the cut
        above, tie = xc > t, xc == t
        room = n - above.sum(axis=1)                          # ties at the cut: lowest ids
        keep = above | (tie & (xp.cumsum(tie, axis=1) <= room[:, None]))
        w = xp.where(keep, xp.exp(xc - m), F32(0))
        if (min_p > 0).any():
            w = xp.where(w >= xp.asarray(min_p)[:, None], w, F32(0))
        return xp.take_along_axis(ids, self.inverse_cdf(w, u)[:, None], axis=1)[:, 0]

    def candidates(self, x, floor):
        """Per row of x [S, V], the tokens at or above floor [S], in id order and padded to
        the widest row: ids [S, M] (padding V), values [S, M] (padding -inf), counts [S]."""
        xp = self.xp
        S, V = x.shape
        flat = xp.flatnonzero(x >= floor[:, None])     # row by row, ids ascending
        rows = flat // V
        count = xp.bincount(rows, minlength=S)
        pos = xp.arange(flat.size) - (xp.cumsum(count) - count)[rows]
        M = int(count.max())
        ids = xp.full((S, M), V, dtype=xp.int64)
        ids[rows, pos] = flat - rows * V
        vals = xp.full((S, M), -np.inf, dtype=F32)
        vals[rows, pos] = x.reshape(-1)[flat]
        return ids, vals, count

    BLOCK = 128          # a long row's weights are summed in blocks first (49,152 = 384 x 128)
    LONG = 64 * BLOCK    # from this length on: below it, one cumsum is as cheap

    def inverse_cdf(self, w, u):
        """Per row of weights w [S, N], the first index whose running share of the total
        exceeds u [S]. Sums are float64. A long row is walked block by block: one pass sums
        its blocks, and only the block the draw lands in is summed element by element
        (a float64 cumsum of 8 x 49,152 weights costs ~1.4 ms on the CPU, this ~0.2 ms)."""
        xp, (S, N), B = self.xp, w.shape, self.BLOCK
        if N < self.LONG:
            return self.landing(w, u)[0]
        if N % B:
            w = xp.pad(w, ((0, 0), (0, -N % B)))
        blocks = w.reshape(S, -1, B)
        block, share = self.landing(blocks.sum(axis=2, dtype=xp.float64), u)
        inside = blocks[xp.arange(S), block]                                      # [S, B]
        return block * B + self.landing(inside, share)[0]

    def landing(self, w, u):
        """(index, where u falls inside that index's share, in [0, 1)) per row."""
        xp = self.xp
        cdf = xp.cumsum(w, axis=1, dtype=xp.float64)
        cdf /= cdf[:, -1:]
        u = xp.asarray(u)
        j = (cdf <= u[:, None]).sum(axis=1)
        below = xp.take_along_axis(cdf, xp.maximum(j - 1, 0)[:, None], axis=1)[:, 0]
        lo = xp.where(j > 0, below, 0.0)
        hi = xp.take_along_axis(cdf, j[:, None], axis=1)[:, 0]
        return j, xp.clip((u - lo) / (hi - lo), 0.0, np.nextafter(1.0, 0.0))

    # -- logprobs ------------------------------------------------------------------------
    def logprobs(self, raw, tokens, tops: list[int]) -> list[list]:
        """[logprob of the token, [[id, logprob] of the `top` likeliest]] per row of raw
        [L, V]: the model's own distribution (before penalties, biases and grammar), as
        vLLM reports by default. Ties in the top list: lower id first."""
        xp = self.xp
        V = raw.shape[1]
        raw -= raw.max(axis=1, keepdims=True)
        logz = self.host(xp.log(xp.exp(raw).sum(axis=1))).tolist()
        chosen = self.host(xp.take_along_axis(raw, tokens[:, None], axis=1)[:, 0]).tolist()
        n = min(max(tops), V)
        top_ids = top_vals = None
        if n > 0:
            zero = xp.zeros(raw.shape[0], dtype=F32)
            for floor in self.FLOORS:
                ids, vals, count = self.candidates(raw, zero + F32(floor))
                if floor == -np.inf or bool((count >= n).all()):
                    break
            # most likely first, ties by id: ids ascend, and the sort is stable
            order = xp.argsort(-vals, axis=1) if xp is not np else \
                np.argsort(-vals, axis=1, kind="stable")      # CuPy's sort is always stable
            order = order[:, :n]
            top_ids = self.host(xp.take_along_axis(ids, order, axis=1)).tolist()
            top_vals = self.host(xp.take_along_axis(vals, order, axis=1)).tolist()
        return [[chosen[r] - logz[r],
                 [[top_ids[r][j], top_vals[r][j] - logz[r]] for j in range(min(top, V))]]
                for r, top in enumerate(tops)]
