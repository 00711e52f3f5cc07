"""Both dies busy: a split replica's scheduler as two lanes whose steps overlap.

A replica split across two dies (worker/stage_link.py) would leave each die idle half
the time if a step ran its stages in turn. Here its slots are split into two lanes, each
a Scheduler of its own over half of the slot numbers (the model's state, the prefix cache
and the link are shared). The worker loop's `step` alternates between them: it finishes
the lane's previous step (collects the tail's logits, samples, emits) and at once starts
the lane's next one (the head's layers, sent to the tail). So while the tail runs lane A's
layers, the head runs lane B's, and the other way round: the step of one lane is the
other's micro-batch. A lane alone (one sequence, or every sequence in one lane) runs the
stages in turn, its step finished and begun in the same call. A lane's long prompt chunk
is itself cut in two (stage_link.micro_batches), so a lone prefill keeps both dies busy
too.

Between a lane's begin and finish its slots are in flight: an abort of one of them first
finishes that step (its outputs are kept for the next `step`); a new request goes to an
idle slot, which no step holds. The interface is the Scheduler's, as worker/main.py uses
it.
"""
from __future__ import annotations

import logging

from .scheduler import Request, Scheduler, Slot

log = logging.getLogger("pantheon.worker.pipeline")


class Lanes:
    def __init__(self, base: Scheduler, split, n_lanes: int = 2):
        n = len(base.slots)
        self.split, self.base = split, base
        self.ctx, self.spec, self.prefill_chunk = base.ctx, base.spec, base.prefill_chunk
        self.lanes: list[Scheduler] = []
        cuts = [n * i // n_lanes for i in range(n_lanes + 1)]
        for lo, hi in zip(cuts, cuts[1:]):
            lane = Scheduler(split, hi - lo, base.ctx, base.prefill_chunk, kv=base.kv,
                             cache=base.cache, sample=base.sample, pooled=base.pooled,
                             spec=base.spec, proposer=None)
            lane.slots = [Slot(i) for i in range(lo, hi)]
            self.lanes.append(lane)
        self.pending: list = [None] * len(self.lanes)
        self.turn = 0
        self.buffered: list = []
        self.failed: Exception | None = None
        self.last_step = (0, 0)

    # -- what the worker reads ----------------------------------------------------
    @property
    def slots(self) -> list[Slot]:
        return [s for lane in self.lanes for s in lane.slots]

    @property
    def by_id(self) -> dict:
        out: dict = {}
        for lane in self.lanes:
            out.update(lane.by_id)
        return out

    def active(self) -> int:
        return sum(lane.active() for lane in self.lanes) + bool(self.buffered)

    def free_slots(self) -> int:
        return sum(lane.free_slots() for lane in self.lanes)

    # -- the owner's operations -------------------------------------------------------
    def add(self, req: Request) -> None:
        """To the lane holding the request's session (its warm slot), else the one with
        the most free slots."""
        free = [lane for lane in self.lanes if lane.free_slots()]
        if not free:
            raise RuntimeError("no free slot")
        home = [lane for lane in free if req.session_id and any(
            s.session_id == req.session_id for s in lane.slots)]
        lane = home[0] if home else max(free, key=lambda x: (x.free_slots(), -x.active()))
        lane.add(req)

    def abort(self, request_id: str):
        for i, lane in enumerate(self.lanes):
            if request_id in lane.by_id:
                self.settle(i)
                return lane.abort(request_id)
        return None

    def settle(self, i: int) -> None:
        """Finish lane i's step in flight now; its outputs go out with the next step."""
        pending, self.pending[i] = self.pending[i], None
        if pending is None:
            return
        try:
            self.buffered += self.lanes[i].finish(pending, self.split.collect)
        except Exception as exc:            # raised by the next step, which fails them all
            self.failed = exc

    def step(self) -> list:
        if self.failed is not None:
            exc, self.failed = self.failed, None
            self.pending = [None] * len(self.lanes)
            raise exc
        out, self.buffered = self.buffered, []
        i = self.turn
        self.turn = (i + 1) % len(self.lanes)
        lane = self.lanes[i]
        pending, self.pending[i] = self.pending[i], None
        try:
            if pending is not None:
                out += lane.finish(pending, self.split.collect)
                self.last_step = lane.last_step
            self.pending[i] = lane.begin(lambda t, s: self.split.submit(t, s, cut=False)
                                         if self.busy_elsewhere(i) else self.split.submit(t, s))
        except Exception:
            self.pending = [None] * len(self.lanes)
            raise
        return out

    def busy_elsewhere(self, i: int) -> bool:
        """Another lane's step is in flight: this one is a micro-batch of its own."""
        return any(p is not None for j, p in enumerate(self.pending) if j != i)
