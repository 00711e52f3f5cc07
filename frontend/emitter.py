"""From detokenized text to what a client may see: stop strings with a carry.

Text arrives piece by piece as tokens are decoded. The emitter releases it
as content, except for the longest tail that could still turn into a stop
string: that tail is carried until the next piece settles it. So nothing is
ever sent and then taken back, and the reply ends right before the first
stop string, which is never sent.
"""
from __future__ import annotations


class Emitter:
    def __init__(self, stop: list[str] | None = None):
        self.stop = [s for s in (stop or []) if s]
        self.carry = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Content that is safe to send now; sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        buf = self.carry + text
        hit = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped, self.carry = True, ""
            return buf[:hit]
        keep = self.held_back(buf)
        self.carry = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self) -> str:
        """The carried tail, once generation ended without a stop string."""
        tail, self.carry = ("" if self.stopped else self.carry), ""
        return tail

    def held_back(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
