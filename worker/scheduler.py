"""Continuous batching over a replica's KV slots.

Each step gathers one mixed batch: every decoding slot contributes its last
sampled token, and prefilling slots contribute chunks of their prompts (at
most `prefill_chunk` prompt tokens per step in all, so a long prompt stalls
running decodes by one chunk at most; while streams are decoding, the
PrefillPacer shrinks the chunks of a prompt longer than one chunk, so each
of its many stalls stays within a small multiple of a decode step). Requests join and leave between steps; idle
slots cost nothing.

Slot lifecycle: IDLE → PREFILL → DECODE → IDLE (the spec's BOUND state
lasts no time here: the step that feeds a prompt's last chunk samples its
first token). Only the scheduler's owner (the worker loop, through `add`,
`abort` and `step`) moves a slot; a finished slot returns to IDLE in the same
step that reports its finish.

Prefix reuse: an idle slot keeps its KV and the token history it holds. A
new request goes to the idle slot that serves it best: its session's own
slot, else the one whose history shares the longest prefix with the prompt,
else the least recently used. The shared prefix is not computed again. A
warm state about to be overwritten is saved to the host-memory prefix cache
first, and a stored state that beats every slot is copied back in.

Plain Python, no sockets and no device arrays of its own: `forward` is any
callable taking (tokens, spans) and returning logits [n_sampled, V], which the
scheduler never looks into, only hands to `sample` (logits, the rows'
SequenceSamplers) → [(token, logprobs)] on the host; an engine keeps them on
its die that way. The default `sample` is NumPy's, for host logits (a fake
model's). `kv` (the model's sequence state, worker/sequence_state.py: `save`,
`restore`, `copy_prefix`) and `cache` (a PrefixCache) are optional.

A state that is not `truncatable` (a recurrent layer's) resumes only at the exact
length it holds: then a warm slot or a stored state is reused only when its whole
history is a prefix of the prompt (shorter than it), and a fork's source stops its
prefill at the fork length so that the copy is taken there. The snapshot of a turn
is the state its slot holds when it ends (history: the prompt and every reply token
but the last, never fed); it stays in the slot, and goes to the host cache, under
the session's id, when another conversation takes the slot. So a session's next
turn, whose prompt extends that history, resumes it exactly; a prompt without a
session resumes only a state whose whole history it extends; anything else is
computed from the start, and `cached_tokens` says which.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .model import Span
from .prefix_cache import PrefixCache, common_prefix
from .sampler import Sampler, SamplingParams, SequenceSampler
from .spec import Adaptive, SpecConfig, Speculator


class SlotState(enum.Enum):
    IDLE = "idle"          # free for a new request
    PREFILL = "prefill"    # feeding its prompt, chunk by chunk
    WAIT = "wait"          # another slot is prefilling the same prompt prefix: copy it then
    DECODE = "decode"      # one token per step until a stop, the budget or the context


@dataclass
class Request:
    """A generation as the worker receives it: token ids in, token ids out."""

    id: str
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop_ids: frozenset[int] = frozenset()
    session_id: str | None = None
    constraint: object = None        # a grammar the output must follow (worker/constraint.py)
    logprobs: int = -1               # -1: none; N: the chosen token's logprob and the top N
    salt: str = ""                   # its prefix-cache scope (Generate.cache_salt)
    pooling: str = ""                # "mean" / "last": an embedding, no decode (Generate)
    prediction: list[int] | None = None   # a predicted output: seeds speculation's proposals


@dataclass
class Output:
    """New tokens of one request from one step; `finish` is set on its last."""

    request_id: str
    tokens: list[int]
    finish: str | None = None        # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0           # prompt tokens whose KV was reused, not computed
    logprobs: list = field(default_factory=list)   # [logprob, [[id, logprob], ...]] per token
    error: str | None = None         # finish "error": why, short, of this request alone
    embedding: list = field(default_factory=list)  # an embedding request's pooled state
    proposed: int = 0                # speculation this step: tokens proposed and verified,
    accepted: int = 0                # and of those, the ones the model agreed with


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.IDLE
    request: Request | None = None
    sampler: SequenceSampler | None = None
    history: list[int] = field(default_factory=list)   # tokens whose KV is valid, in order
    feed: list[int] = field(default_factory=list)      # tokens not yet in the KV
    generated: int = 0
    reused: int = 0                  # prompt tokens taken from a warm state
    session_id: str | None = None    # of the last request that ran here
    salt: str = ""                   # the cache scope of that request: of its history
    last_used: int = 0
    fork_from: "Slot | None" = None  # WAIT: the slot whose prefix this one will copy
    fork_len: int = 0
    pooled: object = None            # an embedding request's running sum (or last state)
    proposal: list[int] = field(default_factory=list)   # speculated tokens in this step's feed
    adaptive: Adaptive | None = None
    shadow: int | None = None        # the token prompt lookup would have proposed, unverified
    idle: int = 0                    # steps since it last proposed
    probe: int = 8                   # steps without proposals before a probe (Speculator)

    @property
    def cached(self) -> int:
        return len(self.history)

    def release(self) -> None:
        """Back to IDLE; the KV and its history stay for a later request to reuse."""
        self.session_id = self.request.session_id if self.request else None
        self.state, self.request, self.sampler = SlotState.IDLE, None, None
        self.feed, self.generated, self.fork_from, self.pooled = [], 0, None, None


class PrefillPacer:
    """Prompt tokens a step may carry while other streams are decoding.

    On a CPU a step costs about (decode step) + (prompt tokens x per-token
    cost), and every decoding stream waits for the whole step. The pacer
    keeps running averages of both costs and sizes chunks so that a mixed
    step costs at most `1 + stall` decode steps; with nothing decoding, the
    full `max_chunk` is used, which is the most efficient.
    """

    ALPHA = 0.2     # weight of the newest measurement in the running averages

    def __init__(self, max_chunk: int, min_chunk: int = 16, stall: float = 1.0):
        self.max_chunk, self.min_chunk, self.stall = max_chunk, min(min_chunk, max_chunk), stall
        self.decode_s: float | None = None        # a decode-only step
        self.token_s: float | None = None         # one prompt token in a mixed step

    def budget(self, decoding: bool) -> int:
        if not decoding or self.decode_s is None or self.token_s is None:
            return self.max_chunk
        fit = int(self.stall * self.decode_s / max(self.token_s, 1e-9))
        return max(self.min_chunk, min(self.max_chunk, fit))

    def record(self, seconds: float, n_decode: int, n_prompt: int) -> None:
        if n_prompt == 0:
            self.decode_s = self.blend(self.decode_s, seconds)
        elif self.decode_s is not None or n_decode == 0:
            base = self.decode_s if n_decode else 0.0
            self.token_s = self.blend(self.token_s, max(seconds - base, 0.0) / n_prompt)

    def blend(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new


class Scheduler:
    def __init__(self, forward: Callable, n_slots: int, ctx: int, prefill_chunk: int = 128,
                 kv=None, cache: PrefixCache | None = None, pacer: PrefillPacer | None = None,
                 clock: Callable[[], float] = time.perf_counter, sample: Callable | None = None,
                 pooled: Callable | None = None, spec: SpecConfig | None = None,
                 proposer=None):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.forward, self.ctx, self.prefill_chunk = forward, ctx, prefill_chunk
        self.sample = sample or Sampler(np).sample
        # after a forward with pooling spans: [(span index, [D] host vector)]
        self.pooled = pooled
        self.pacer = pacer or PrefillPacer(prefill_chunk)
        self.clock = clock
        self.kv, self.cache = kv, cache
        self.exact = kv is not None and not getattr(kv, "truncatable", True)
        self.slots = [Slot(i) for i in range(n_slots)]
        self.by_id: dict[str, Slot] = {}
        self.uses = itertools.count(1)
        self.last_step = (0, 0)
        # speculation (worker/spec.py) needs a state that can be cut back by length
        self.spec = spec if spec is not None and spec.on and not self.exact else None
        self.speculator = Speculator(self.spec, proposer, clock) if self.spec else None

    # -- the owner's operations ------------------------------------------------
    def free_slots(self) -> int:
        return sum(s.state is SlotState.IDLE for s in self.slots)

    def active(self) -> int:
        return len(self.by_id)

    def add(self, req: Request) -> None:
        """Bind `req` to an idle slot; raises if none is free or it cannot fit."""
        if req.id in self.by_id:
            raise ValueError(f"request {req.id} is already running")
        if not req.prompt:
            raise ValueError("empty prompt")
        if req.pooling and (req.pooling not in ("mean", "last") or self.pooled is None):
            raise ValueError(f"pooling {req.pooling!r} is not available here")
        if len(req.prompt) >= self.ctx:
            raise ValueError(f"prompt of {len(req.prompt)} tokens leaves no room in the "
                             f"context of {self.ctx}")
        idle = [s for s in self.slots if s.state is SlotState.IDLE]
        if not idle:
            raise RuntimeError("no free slot")
        prompt = np.asarray(req.prompt, dtype=np.int64)
        # a warm state serves only requests of its own salt (a scope per API key): a hit
        # shows in cached_tokens, which would let one client read another's prompt
        matches = {s.index: self.usable(common_prefix(np.asarray(s.history, dtype=np.int64),
                                                      prompt), len(s.history), len(prompt))
                   if s.salt == req.salt else 0 for s in idle}
        slot = max(idle, key=lambda s: (bool(req.session_id) and s.session_id == req.session_id
                                        and s.salt == req.salt,
                                        matches[s.index], -s.last_used))
        reuse = self.warm_start(slot, matches[slot.index], req)
        if req.pooling == "mean":        # every position's state is wanted: none skipped
            reuse = 0
        slot.state, slot.request, slot.last_used = SlotState.PREFILL, req, next(self.uses)
        slot.salt = req.salt
        slot.sampler = SequenceSampler(req.params, req.prompt, req.constraint, req.logprobs)
        slot.history = list(req.prompt[:reuse])
        slot.feed, slot.generated, slot.reused = list(req.prompt[reuse:]), 0, reuse
        slot.adaptive = Adaptive() if self.spec else None
        slot.idle, slot.probe, slot.shadow, slot.proposal = 0, Speculator.PROBE, None, []
        self.by_id[req.id] = slot
        source, shared = self.fork_source(slot, prompt)
        if source is not None and shared > reuse and req.pooling != "mean":
            # n > 1, retries: prefill once, copy
            slot.state, slot.fork_from, slot.fork_len = SlotState.WAIT, source, shared

    FORK_MIN = 16      # shared prompt tokens worth waiting for instead of computing

    def usable(self, match: int, held: int, prompt_len: int) -> int:
        """Prompt tokens a state holding `held` tokens (sharing `match`) can skip: a state
        that cannot be cut only when all of it is a prefix of the prompt, leaving one."""
        if not self.exact:
            return match
        return match if match == held and match < prompt_len else 0

    def fork_source(self, slot: Slot, prompt: np.ndarray) -> tuple[Slot | None, int]:
        """A slot now prefilling a prompt that shares a long prefix with `prompt`."""
        if self.kv is None or not hasattr(self.kv, "copy_prefix"):
            return None, 0
        best, best_len = None, self.FORK_MIN - 1
        for other in self.slots:
            if other is not slot and other.state is SlotState.PREFILL \
                    and other.request.salt == slot.request.salt:
                shared = min(common_prefix(np.asarray(other.request.prompt, dtype=np.int64),
                                           prompt), len(prompt) - 1)
                if shared > best_len:
                    best, best_len = other, shared
        return best, best_len

    def resolve_forks(self) -> None:
        """WAIT slots whose source now holds the shared prefix copy it and go on;
        those whose source went away (aborted, reused) compute it themselves."""
        for slot in self.slots:
            if slot.state is not SlotState.WAIT:
                continue
            src, k, prompt = slot.fork_from, slot.fork_len, slot.request.prompt
            reached = src.cached == k if self.exact else src.cached >= k
            if reached and src.history[:k] == prompt[:k]:
                self.kv.copy_prefix(src.index, slot.index, k)
                slot.history, slot.feed, slot.reused = list(prompt[:k]), list(prompt[k:]), k
            elif (src.state is SlotState.PREFILL and src.request.prompt[:k] == prompt[:k]
                  and src.cached < k):
                continue                          # still on its way there
            slot.state, slot.fork_from = SlotState.PREFILL, None

    def warm_start(self, slot: Slot, match: int, req: Request) -> int:
        """Prompt tokens `slot` can skip, saving or restoring cached state as needed.

        At least the prompt's last token is always fed: its logits are needed.
        """
        if self.kv is not None and self.cache is not None:
            # a state that is about to lose most of its history is kept on the host
            if match < slot.cached // 2 and slot.cached >= self.cache.min_tokens:
                state, nbytes = self.kv.save(slot.index, slot.cached)
                self.cache.put(slot.history, state, nbytes, slot.session_id, slot.salt)
            entry, stored = self.cache.best(req.prompt, req.session_id, whole=self.exact,
                                            salt=req.salt)
            if entry is not None and stored > match:
                self.kv.restore(slot.index, entry.state)
                match = stored
        return min(match, len(req.prompt) - 1)

    def abort(self, request_id: str) -> Output | None:
        """Stop a request now; its slot is free for the next step."""
        slot = self.by_id.pop(request_id, None)
        if slot is None:
            return None
        out = self._output(slot, [], "abort")
        slot.release()
        return out

    # -- one step ----------------------------------------------------------------
    def plan(self) -> list[tuple[Slot, int]]:
        """(slot, tokens to feed) for this step: every decode, then prefill chunks."""
        self.resolve_forks()
        decoding = [s for s in self.slots if s.state is SlotState.DECODE]
        if self.speculator:
            self.speculator.propose(decoding, self.ctx)
        plan = [(s, len(s.feed)) for s in decoding]
        # a prompt that fits one chunk goes whole (one stall); a longer one is paced
        long_prompt = any(s.state is SlotState.PREFILL and len(s.feed) > self.prefill_chunk
                          for s in self.slots)
        budget = self.pacer.budget(decoding=bool(plan) and long_prompt)
        stops = self.fork_stops()
        for s in self.slots:
            if s.state is SlotState.PREFILL and budget > 0:
                take = min(budget, len(s.feed), stops.get(s.index, len(s.feed)))
                plan.append((s, take))
                budget -= take
        return plan

    def fork_stops(self) -> dict[int, int]:
        """Exact states: how far each fork source may prefill this step (to its nearest
        pending fork length), so the copy is taken at that length."""
        if not self.exact:
            return {}
        stops: dict[int, int] = {}
        for w in self.slots:
            if w.state is SlotState.WAIT and w.fork_from.cached < w.fork_len:
                src = w.fork_from.index
                stops[src] = min(stops.get(src, w.fork_len), w.fork_len - w.fork_from.cached)
        return stops

    def step(self) -> list[Output]:
        pending = self.begin()
        return self.finish(pending) if pending is not None else []

    def begin(self, submit: Callable | None = None):
        """A step's first half: plan it and start its forward (`submit`, default the
        forward itself, whose answer `finish` then takes as is); None when idle. A
        pipelined replica (worker/pipeline.py) finishes it a step later."""
        plan = self.plan()
        if not plan:
            return None
        tokens, spans = [], []
        for slot, n in plan:
            tokens += slot.feed[:n]
            pool = slot.request.pooling
            spans.append(Span(slot.index, slot.cached, n, logits=(n == len(slot.feed)) and not pool,
                              pool=pool if pool == "mean" or n == len(slot.feed) else "",
                              verify=1 + len(slot.proposal) if slot.state is SlotState.DECODE
                              else 1))
        started = self.clock()
        try:
            handle = (submit or self.forward)(np.asarray(tokens, dtype=np.int64), spans)
        except Exception:
            # a step that failed part way may have advanced some layers' states and not
            # others: nothing these slots hold is to be resumed
            for slot, _ in plan:
                slot.history = []
            raise
        return plan, tokens, spans, started, handle

    def finish(self, pending, collect: Callable | None = None) -> list[Output]:
        """A step's second half: its logits (`collect(handle)`, or the handle itself),
        sampled, and its outputs."""
        plan, tokens, spans, started, logits = pending
        if collect is not None:
            try:
                logits = collect(logits)
            except Exception:
                for slot, _ in plan:
                    slot.history = []
                raise
        sampled = [(slot, span.verify) for (slot, _), span in zip(plan, spans) if span.logits]
        pooled = self.pooled() if any(span.pool for span in spans) else []
        runs = Speculator.verify(self.sample, logits, sampled) if sampled else []
        decodes = [(slot, n) for slot, n in plan if slot.state is SlotState.DECODE]
        n_decode, n_spec = len(decodes), sum(n - 1 for _, n in decodes)
        n_prompt = len(tokens) - n_decode - n_spec
        self.last_step = (n_decode, n_prompt)                 # (decode rows, prompt tokens)
        seconds = self.clock() - started
        self.pacer.record(seconds, n_decode, n_prompt)
        if self.speculator:
            self.speculator.record(seconds, n_decode, n_spec, n_prompt)
        for slot, n in plan:
            slot.history += slot.feed[:n]
            del slot.feed[:n]
        return [self._advance(slot, run) for (slot, _), run in zip(sampled, runs)] \
            + [out for i, vector in pooled if (out := self._pool(plan[i][0], vector))]

    def _pool(self, slot: Slot, vector) -> Output | None:
        """An embedding request's chunk went through; its Output once its prompt has."""
        slot.pooled = vector if slot.pooled is None else slot.pooled + vector
        if slot.feed:
            return None
        req = slot.request
        pooled = slot.pooled / len(req.prompt) if req.pooling == "mean" else slot.pooled
        out = self._output(slot, [], "stop")
        out.embedding = np.asarray(pooled, dtype=np.float32).tolist()
        del self.by_id[req.id]
        slot.release()
        return out

    def _advance(self, slot: Slot, run: list) -> Output:
        """`slot`'s run of tokens from this step: its speculation settled (the rejected
        positions rolled back), then emitted."""
        proposed = accepted = 0
        if self.speculator and slot.state is SlotState.DECODE:
            proposed, accepted = self.speculator.settle(slot, run)
        out = self._emit(slot, run)
        out.proposed, out.accepted = proposed, accepted
        return out

    def _emit(self, slot: Slot, run: list) -> Output:
        req = slot.request
        done = False
        if slot.sampler.failed is None and req.constraint is not None:
            try:
                done = req.constraint.finished()
            except Exception as exc:
                slot.sampler.fail(exc)
        if slot.sampler.failed is not None:       # its grammar failed: it ends alone
            out = self._output(slot, [], "error")
            out.error = slot.sampler.failed
            del self.by_id[req.id]
            slot.release()
            return out
        slot.state = SlotState.DECODE
        finish = None
        tokens, logprobs = [], []
        # the history a step emitting only run[i] would have held: cached less the rest
        held = slot.cached - (len(run) - 1)
        for i, (token, entry) in enumerate(run):
            slot.generated += 1
            tokens.append(token)
            if entry is not None:
                logprobs.append(entry)
            if token in req.stop_ids or (req.constraint is not None and done
                                         and i == len(run) - 1):
                finish = "stop"
            elif slot.generated >= req.max_tokens or held + i + 1 >= self.ctx:
                finish = "length"
            if finish is not None:
                break
        if finish is None:
            slot.feed = [tokens[-1]]
            return self._output(slot, tokens, None, logprobs)
        out = self._output(slot, tokens, finish, logprobs)
        del self.by_id[req.id]
        slot.release()
        return out

    @staticmethod
    def _output(slot: Slot, tokens: list[int], finish: str | None, logprobs=()) -> Output:
        return Output(slot.request.id, tokens, finish, len(slot.request.prompt), slot.generated,
                      slot.reused, list(logprobs))

