"""Continuous batching over a replica's KV slots.

Each step gathers one mixed batch: every decoding slot contributes its last
sampled token, and prefilling slots contribute chunks of their prompts (at
most `prefill_chunk` prompt tokens per step in all, so a long prompt stalls
running decodes by one chunk at most). Requests join and leave between steps;
idle slots cost nothing.

Slot lifecycle: IDLE → PREFILL → DECODE → IDLE. Only the scheduler's owner
(the worker loop, through `add`, `abort` and `step`) moves a slot; a finished
slot returns to IDLE in the same step that reports its finish.

Plain Python, no sockets and no device arrays: `forward` is any callable
taking (tokens, spans) and returning host logits [n_sampled, V].
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .model import Span
from .sampler import SamplingParams, SequenceSampler


class SlotState(enum.Enum):
    IDLE = "idle"          # free for a new request
    PREFILL = "prefill"    # feeding its prompt, chunk by chunk
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


@dataclass
class Output:
    """New tokens of one request from one step; `finish` is set on its last."""

    request_id: str
    tokens: list[int]
    finish: str | None = None        # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.IDLE
    request: Request | None = None
    sampler: SequenceSampler | None = None
    cached: int = 0                  # positions of this slot's KV that are valid
    feed: list[int] = field(default_factory=list)   # tokens not yet in the KV
    generated: int = 0

    def reset(self) -> None:
        self.state, self.request, self.sampler = SlotState.IDLE, None, None
        self.cached, self.feed, self.generated = 0, [], 0


class Scheduler:
    def __init__(self, forward: Callable, n_slots: int, ctx: int, prefill_chunk: int = 128):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.forward, self.ctx, self.prefill_chunk = forward, ctx, prefill_chunk
        self.slots = [Slot(i) for i in range(n_slots)]
        self.by_id: dict[str, Slot] = {}

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
        if len(req.prompt) >= self.ctx:
            raise ValueError(f"prompt of {len(req.prompt)} tokens leaves no room in the "
                             f"context of {self.ctx}")
        slot = next((s for s in self.slots if s.state is SlotState.IDLE), None)
        if slot is None:
            raise RuntimeError("no free slot")
        slot.state, slot.request = SlotState.PREFILL, req
        slot.sampler = SequenceSampler(req.params, req.prompt)
        slot.cached, slot.feed, slot.generated = 0, list(req.prompt), 0
        self.by_id[req.id] = slot

    def abort(self, request_id: str) -> Output | None:
        """Stop a request now; its slot is free for the next step."""
        slot = self.by_id.pop(request_id, None)
        if slot is None:
            return None
        out = self._output(slot, [], "abort")
        slot.reset()
        return out

    # -- one step ----------------------------------------------------------------
    def plan(self) -> list[tuple[Slot, int]]:
        """(slot, tokens to feed) for this step: every decode, then prefill chunks."""
        plan = [(s, 1) for s in self.slots if s.state is SlotState.DECODE]
        budget = self.prefill_chunk
        for s in self.slots:
            if s.state is SlotState.PREFILL and budget > 0:
                take = min(budget, len(s.feed))
                plan.append((s, take))
                budget -= take
        return plan

    def step(self) -> list[Output]:
        plan = self.plan()
        if not plan:
            return []
        tokens, spans = [], []
        for slot, n in plan:
            tokens += slot.feed[:n]
            spans.append(Span(slot.index, slot.cached, n, logits=(n == len(slot.feed))))
        logits = self.forward(np.asarray(tokens, dtype=np.int64), spans)
        outputs, row = [], 0
        for (slot, n), span in zip(plan, spans):
            slot.cached += n
            del slot.feed[:n]
            if span.logits:
                outputs.append(self._advance(slot, logits[row]))
                row += 1
        return [o for o in outputs if o is not None]

    def _advance(self, slot: Slot, logits: np.ndarray) -> Output:
        req = slot.request
        token = slot.sampler.sample(logits)
        slot.generated += 1
        slot.state = SlotState.DECODE
        finish = None
        if token in req.stop_ids:
            finish = "stop"
        elif slot.generated >= req.max_tokens or slot.cached + 1 >= self.ctx:
            finish = "length"
        if finish is None:
            slot.feed = [token]
            return self._output(slot, [token], None)
        out = self._output(slot, [token], finish)
        del self.by_id[req.id]
        slot.reset()
        return out

    @staticmethod
    def _output(slot: Slot, tokens: list[int], finish: str | None) -> Output:
        return Output(slot.request.id, tokens, finish, len(slot.request.prompt), slot.generated)
