"""Speculative decoding: who proposes tokens, and how many each sequence may propose.

A decoding sequence that has a proposal feeds its last token plus the proposed tokens
as one short chunk of the step's batched forward (worker/scheduler.py), and the rows
of that chunk are sampled one after another, each with the sequence's own sampler
state as it stands once the tokens before it are accepted. The emitted token at each
row is what the request's sampler draws there (greedy: the argmax; sampled: one draw
of the request's own generator); while it equals the proposed token the next row is
looked at, and the first that differs ends the run. So:

- greedy: the longest prefix of the proposal the model agrees with, plus one token —
  the same tokens as without speculation;
- sampled: a proposal is one token, not a distribution (q = a point mass), and
  rejection sampling against a point mass accepts d with probability p(d) and, when it
  rejects, draws from p without d renormalized; drawing t ~ p and accepting when t == d
  is the same law. Each emitted token costs one draw of the request's generator, as it
  does without speculation, so a seeded request gives the same output either way (as
  far as the logits of a chunk equal those of a single-token step).

Rejected positions are rolled back by length: the slot's history is cut, and its
attention KV past it is overwritten later. A recurrent state (Qwen3.5's DeltaNet)
cannot be cut: such a model runs without speculation (the load log says so).

Prompt lookup (`NgramProposer`): the last n tokens of the sequence (prompt and output
so far), for n from `n` down to 1, matched against earlier in the sequence (and
against a request's predicted output first, when it gave one); the tokens that
followed the most recent match are proposed.

`Adaptive` tracks each sequence's acceptance (also on steps where it proposes
nothing, by a free shadow proposal) and `SpecPacer` measures what a verified token
costs on this die at this batch size; a sequence proposes the tokens whose chance of
passing beats that price (down to none), so speculation follows the text and shrinks
as the batch fills or where extra rows are not cheap (the CPU's integer kernels).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..common.speculation import check



@dataclass(frozen=True, slots=True)
class SpecConfig:
    """A replica's speculation: `kind` ("" = none), prompt lookup's longest match `n`,
    and the longest proposal `k` (1-16)."""

    kind: str = ""
    n: int = 3
    k: int = 8
    draft: str = ""           # kind "draft": the draft model's path

    def __post_init__(self):
        check(self.kind, self.n, self.k, self.draft)

    @property
    def on(self) -> bool:
        return bool(self.kind)


class NgramProposer:
    """Prompt lookup over one sequence's tokens (numpy, a few µs per 1k tokens)."""

    free = True               # proposing costs nothing worth counting: shadow proposals too

    def __init__(self, n: int, min_n: int = 1):
        self.n, self.min_n = n, min(min_n, n)

    def propose_many(self, asks: list[tuple[int, list[int], int, list[int] | None]]
                     ) -> list[list[int]]:
        """For each (slot, tokens, k, prediction): up to k tokens to follow `tokens`."""
        return [self.propose(tokens, k, prediction) for _, tokens, k, prediction in asks]

    def propose(self, tokens: list[int], k: int, prediction: list[int] | None = None,
                done: int = 0) -> list[int]:
        """Up to k tokens to follow `tokens`. A predicted output (OpenAI's `prediction`)
        is tried first: where the sequence's last tokens occur in it, what follows there;
        `done` tokens of output so far are the prediction's natural position."""
        if k < 1 or not tokens:
            return []
        if prediction:
            found = self.lookup(np.asarray(prediction, dtype=np.int64),
                                np.asarray(tokens[-self.n:], dtype=np.int64), k, own=False)
            if found:
                return found
        return self.lookup(np.asarray(tokens, dtype=np.int64), None, k, own=True)

    def lookup(self, seq: np.ndarray, tail: np.ndarray | None, k: int, own: bool) -> list[int]:
        """Continuation, in `seq`, of the most recent earlier occurrence of its own last
        n tokens (own), or of `tail` (another sequence's last tokens)."""
        for n in range(self.n, self.min_n - 1, -1):
            if own:
                if len(seq) <= n:
                    continue
                key, hay = seq[-n:], seq[:-1]          # a match must end before the end
            else:
                if tail is None or len(tail) < n:
                    continue
                key, hay = tail[-n:], seq
            if len(hay) < n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(hay, n)
            hits = np.flatnonzero((windows == key).all(axis=1))
            for start in hits[::-1]:                   # the most recent match first
                follow = seq[start + n:start + n + k]
                if len(follow):
                    return follow.tolist()
        return []


class DraftProposer:
    """A small model of the same vocabulary, on the same die, with its own sequence state
    in the same slot numbers, proposing its greedy continuation (a point mass, so the
    verification above stays exact for sampled requests too).

    It tracks the tokens each slot's state holds; asked for a slot's proposal it keeps the
    prefix those share with the sequence (rolled back by length, as the target's KV),
    feeds the rest as one chunk, and then its own picks one token at a time. Every slot
    asking in a step shares each of those forwards."""

    free = False

    def __init__(self, model, n_slots: int):
        if not model.state.truncatable:
            raise ValueError("spec.draft: a draft model with recurrent layers cannot be "
                             "rolled back; choose an attention-only model")
        self.model = model
        self.held: list[list[int]] = [[] for _ in range(n_slots)]
        self.host = np.asarray if model.xp is np else model.xp.asnumpy

    def propose_many(self, asks: list[tuple[int, list[int], int, list[int] | None]]
                     ) -> list[list[int]]:
        from .model import Span
        out: list[list[int]] = [[] for _ in asks]
        live = [i for i, (_, tokens, k, _) in enumerate(asks) if k > 0 and tokens]
        if not live:
            return out
        feed, spans = [], []
        for i in live:                            # catch up: what the draft lacks, at once
            slot, tokens = asks[i][0], asks[i][1]
            held = self.held[slot]
            keep = 0
            for a, b in zip(held, tokens):
                if a != b:
                    break
                keep += 1
            keep = min(keep, len(tokens) - 1)     # the last token is fed: its logits
            feed += tokens[keep:]
            spans.append(Span(slot, keep, len(tokens) - keep))
            self.held[slot] = list(tokens)
        picks = self.pick(feed, spans)
        while live:
            for i, token in zip(live, picks):
                out[i].append(token)
            live = [i for i in live if len(out[i]) < asks[i][2]
                    and len(self.held[asks[i][0]]) + 1 < self.model.ctx]
            if not live:
                break
            spans = []
            for i in live:
                slot = asks[i][0]
                spans.append(Span(slot, len(self.held[slot]), 1))
                self.held[slot].append(out[i][-1])
            picks = self.pick([out[i][-1] for i in live], spans)
        return out

    def pick(self, tokens: list[int], spans) -> list[int]:
        logits = self.model.forward(np.asarray(tokens, dtype=np.int64), spans)
        return self.host(self.model.xp.argmax(logits, axis=1)).tolist()


class Adaptive:
    """One sequence's acceptance: the chance `a` that a proposed token passes, given the
    ones before it did (an average over recent steps). Measured on every step, also
    those where the sequence proposes nothing: then the first token prompt lookup would
    have proposed is compared with the token that came (a shadow proposal, free)."""

    ALPHA = 0.3

    def __init__(self, prior: float = 0.5):
        self.a = prior

    def record(self, tries: int, accepted: int) -> None:
        if tries:
            self.a += self.ALPHA * (accepted / tries - self.a)

    def length(self, price: float | None, most: int) -> int:
        """The proposal length that maximizes the tokens gained, sum of a^j for j <= k,
        less k times the price of a verified token (SpecPacer.price): each further token
        is worth proposing while a^j > price. Price unknown: `most`, which measures it."""
        if price is None:
            return most
        if self.a <= price or self.a <= 0.0:
            return 0
        if self.a >= 1.0 or price <= 0.0:
            return most
        return max(0, min(most, int(np.log(price) / np.log(self.a))))


class SpecPacer:
    """What a verified proposal token costs, measured as the replica runs (PrefillPacer's
    twin): running averages of a decode-only step's seconds per batch size, and of the
    seconds one verified token adds to a step. Its `price` is that cost in tokens the
    batch would have emitted meanwhile: on a bandwidth-bound die a few extra rows are
    nearly free (price near 0), where the CPU's integer kernels cost in proportion to
    the rows (price near the batch size); and it grows with the batch, which is how
    speculation shrinks as the batch fills."""

    ALPHA = 0.2

    def __init__(self):
        self.decode_s: dict[int, float] = {}
        self.token_s: float | None = None

    def record(self, seconds: float, n_decode: int, n_spec: int, n_prompt: int) -> None:
        if n_prompt or not n_decode:
            return
        if n_spec == 0:
            old = self.decode_s.get(n_decode)
            self.decode_s[n_decode] = seconds if old is None else \
                (1 - self.ALPHA) * old + self.ALPHA * seconds
        elif n_decode in self.decode_s:
            extra = max(seconds - self.decode_s[n_decode], 0.0) / n_spec
            self.token_s = extra if self.token_s is None else \
                (1 - self.ALPHA) * self.token_s + self.ALPHA * extra

    def measured(self, batch: int) -> bool:
        """Whether a decode-only step of this batch size has been timed (until then steps
        of it verify nothing: the base every price is taken against)."""
        return batch in self.decode_s

    def price(self, batch: int) -> float | None:
        base = self.decode_s.get(batch)
        if base is None or self.token_s is None:
            return None
        return batch * self.token_s / max(base, 1e-9)


class Speculator:
    """A replica's speculation, as its scheduler runs it: who proposes (prompt lookup or
    a draft), what a verified token costs (SpecPacer), and the totals /metrics reads.
    The scheduler calls `propose` before a step's forward, `verify` on its logits and
    `settle` on each slot's run; slots carry `proposal`, `shadow`, `idle`, `adaptive`."""

    PROBE = 8    # a sequence proposing nothing tries one token after PROBE steps, then
    MAX_PROBE = 512  # after twice as many each time (a draft's shadow would cost a forward)

    def __init__(self, spec: SpecConfig, proposer=None, clock=time.perf_counter):
        self.spec, self.clock = spec, clock
        self.proposer = proposer or NgramProposer(spec.n)   # or a DraftProposer
        self.pacer = SpecPacer()
        self.propose_s = 0.0              # this step's proposing (a draft's forwards)
        self.totals = [0, 0, 0]           # steps that verified a proposal, proposed, accepted

    def propose(self, decoding: list, ctx: int) -> None:
        """Each decoding slot's proposal for this step, put in its feed after its last
        token: as long as its acceptance is worth the measured price."""
        started = self.clock()
        measured = self.pacer.measured(len(decoding))
        price = self.pacer.price(len(decoding))
        asks, shadows = [], []
        for s in decoding:
            req = s.request
            # no more than the longest proposal, the request's budget (less the token every
            # step emits anyway) or its context allow
            room = min(self.spec.k, req.max_tokens - s.generated - 1, ctx - s.cached - 2)
            k = s.adaptive.length(price, room) if measured and room > 0 else 0
            if k == 0 and room > 0 and measured:
                s.idle += 1
                if self.proposer.free:
                    shadows.append(s)
                elif s.idle >= s.probe and price is not None and price < 1.0:
                    # (at a price of 1 or more not even a sure token pays for its row)
                    k, s.idle, s.probe = 1, 0, min(2 * s.probe, self.MAX_PROBE)
                    asks.append((s, k))
                continue
            if k:
                s.idle, s.probe = 0, self.PROBE
                asks.append((s, k))
        found = self.proposer.propose_many(
            [(s.index, s.history + s.feed[:1], k, s.request.prediction) for s, k in asks]
            + [(s.index, s.history + s.feed[:1], 1, s.request.prediction) for s in shadows])
        for (s, k), tokens in zip(asks, found):
            s.proposal = grammatical(s.request.constraint, tokens[:k])
        if price is None or price < 1.0:     # a forced token passes for sure: worth a row
            for s in decoding:
                forced = forced_tokens(s.request.constraint)
                room = min(self.spec.k, s.request.max_tokens - s.generated - 1,
                           ctx - s.cached - 2)
                if forced and room > 0 and len(forced) > len(s.proposal) and measured:
                    s.proposal, s.shadow = forced[:room], None
        for s, tokens in zip(shadows, found[len(asks):]):
            s.shadow = tokens[0] if tokens else None
        for s in decoding:
            s.feed = s.feed[:1] + s.proposal
        self.propose_s = self.clock() - started

    @staticmethod
    def verify(sample, logits, sampled: list) -> list[list]:
        """Each sampled (slot, rows)'s run of (token, logprobs): one token, or for a slot
        with a proposal the tokens its sampler picks at its rows in turn, while each equals
        the proposed one (the module's docstring says why this is exact). The rows of every
        slot still going are sampled together: a round per position."""
        if not any(rows > 1 for _, rows in sampled):
            picks = sample(logits, [slot.sampler for slot, _ in sampled]) if sampled else []
            return [[pick] for pick in picks]
        starts = np.cumsum([0] + [rows for _, rows in sampled])[:-1].tolist()
        runs: list[list] = [[] for _ in sampled]
        going, j = list(range(len(sampled))), 0
        while going:
            picks = sample(logits[[starts[i] + j for i in going]],
                           [sampled[i][0].sampler for i in going])
            on = []
            for i, pick in zip(going, picks):
                runs[i].append(pick)
                slot, rows = sampled[i]
                if j + 1 < rows and pick[0] == slot.proposal[j] and goes_on(slot, pick[0]):
                    on.append(i)
            going, j = on, j + 1
        return runs

    def settle(self, slot, run: list) -> tuple[int, int]:
        """(proposed, accepted) of a decoding slot's step: the rejected positions cut from
        its history (the KV holds its last token and every proposal), its acceptance
        recorded (a shadow proposal's too)."""
        proposed, accepted = len(slot.proposal), len(run) - 1
        if proposed:
            del slot.history[len(slot.history) - (proposed - accepted):]
            slot.adaptive.record(accepted + (accepted < proposed), accepted)
            t = self.totals
            t[0], t[1], t[2] = t[0] + 1, t[1] + proposed, t[2] + accepted
        elif slot.shadow is not None:
            slot.adaptive.record(1, int(run[0][0] == slot.shadow))
        slot.proposal, slot.shadow = [], None
        return proposed, accepted

    def record(self, seconds: float, n_decode: int, n_spec: int, n_prompt: int) -> None:
        """A step's time: a draft's forwards are part of what its proposals cost."""
        self.pacer.record(seconds + self.propose_s, n_decode, n_spec, n_prompt)
        self.propose_s = 0.0


def grammatical(constraint, tokens: list[int]) -> list[int]:
    """The prefix of a proposal its request's grammar allows (a grammar that fails here
    fails its request in the step, as without speculation: nothing is proposed)."""
    if constraint is None or not tokens:
        return tokens
    try:
        return tokens[:constraint.allows(tokens)]
    except Exception:
        return []


def forced_tokens(constraint) -> list[int]:
    if constraint is None:
        return []
    try:
        return constraint.forced()
    except Exception:
        return []


def goes_on(slot, token: int) -> bool:
    """Whether a run may continue past `token` (no stop, no grammar end or failure)."""
    req, sampler = slot.request, slot.sampler
    if token in req.stop_ids or sampler.failed is not None:
        return False
    if req.constraint is not None:
        try:
            return not req.constraint.finished()
        except Exception:
            return False                   # the scheduler asks again and fails the request
    return True
