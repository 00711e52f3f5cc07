"""The frontend's memory of OpenAI Responses: what `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}` read.

A stored response keeps its response object and its conversation as chat turns (the
input that produced it, earlier turns included, and its own output as an assistant
turn), so a follow-up names only the response it continues, and its own input as
items (what `GET /v1/responses/{id}/input_items` lists). Entries live `ttl_s`
seconds and take at most `max_bytes` together (their JSON size); past that the oldest
go first. Responses still running are held apart (`running`), unbounded by either
limit since admission bounds how many there are, so they can be read and cancelled.
Only the event loop touches a store.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class Stored:
    response: dict              # the Response object as last answered
    turns: list[dict]           # the conversation through this response, as chat turns
    session: str                # the prefix-cache session its follow-ups share
    size: int
    expires: float
    items: list[dict] = field(default_factory=list)   # its own input, as items (input_items)


class ResponseStore:
    def __init__(self, ttl_s: float = 3600.0, max_bytes: int = 64 << 20, clock=time.monotonic):
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()     # oldest first
        self.bytes = 0
        # id → (response, its Job, its input items)
        self.running: dict[str, tuple[dict, object, list[dict]]] = {}

    def put(self, rid: str, response: dict, turns: list[dict], session: str,
            items: list[dict] | None = None) -> bool:
        """Keep a finished response (`items`: its own input, as input items); False when it
        alone is bigger than the store."""
        self.delete(rid)
        items = items or []
        size = len(json.dumps(response)) + len(json.dumps(turns)) + len(json.dumps(items))
        if size > self.max_bytes:
            return False
        self.entries[rid] = Stored(response, turns, session, size, self.clock() + self.ttl_s,
                                   items=items)
        self.bytes += size
        self.expire()
        while self.bytes > self.max_bytes:
            self.drop(next(iter(self.entries)))
        return True

    def get(self, rid: str) -> Stored | None:
        self.expire()
        return self.entries.get(rid)

    def delete(self, rid: str) -> bool:
        if rid not in self.entries:
            return False
        self.drop(rid)
        return True

    def drop(self, rid: str) -> None:
        self.bytes -= self.entries.pop(rid).size

    def expire(self) -> None:
        """Entries past their time go (all live the same ttl: the oldest expire first)."""
        now = self.clock()
        while self.entries:
            rid, first = next(iter(self.entries.items()))
            if first.expires > now:
                return
            self.drop(rid)
