"""Routing: which replica of a served model takes a request group.

A *group* is every choice of one request (`n`, or a completions prompt list): they all
go to one replica, so that worker prefills the shared prompt once and forks it
(the scheduler's WAIT slots) instead of each replica prefilling its own copy.

Rules, in order: only replicas whose context holds the group's `need` (its longest
prompt plus the tokens it asks for, or at least one) are candidates; replicas on a slow worker are left out while another can serve; a
replica fits the group when it has that many free slots (or it is idle: a group
larger than a replica's slots waits for slots on the worker, not here); a session goes
back to the replica holding its warm prefix while that one fits, else to the fitting
replica with the fewest in flight, and is remembered there (LRU of sessions).
"""
from __future__ import annotations

from collections import OrderedDict

from .registry import Replica, ServedModel


class Router:
    AFFINITY_SESSIONS = 10000      # sessions whose replica is remembered (LRU)

    def __init__(self):
        self.affinity: OrderedDict[str, str] = OrderedDict()    # session → replica id

    @staticmethod
    def fits(replica: Replica, n: int) -> bool:
        return replica.inflight == 0 or replica.inflight + n <= max(replica.slots, 1)

    def pick(self, model: ServedModel, session: str | None = None, n: int = 1,
             need: int = 0) -> Replica | None:
        """The replica for a group of `n` choices of `need` positions each now, or None
        when none has room."""
        ready = [r for r in model.ready() if r.ctx >= need]
        fast = [r for r in ready if r.worker is None or not r.worker.slow]
        free = [r for r in (fast or ready) if self.fits(r, n)]
        home = self.affinity.get(session) if session else None
        for r in free:
            if r.model_id == home:
                return r
        return min(free, key=lambda r: r.inflight) if free else None

    def routed(self, replica: Replica, session: str | None) -> None:
        """The group went to `replica`: its session's next turn goes there too."""
        if session:
            self.affinity[session] = replica.model_id
            self.affinity.move_to_end(session)
            while len(self.affinity) > self.AFFINITY_SESSIONS:
                self.affinity.popitem(last=False)
