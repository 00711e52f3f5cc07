"""From detokenized text to what a client may see: content, reasoning, tool calls.

Text arrives piece by piece as tokens are decoded, but how it is cut is an
accident of tokenization. The emitter makes the outcome independent of it:
for any way of cutting a reply into pieces, the concatenated events equal
those of feeding it whole. Three rules make that so:

- It is a small state machine over three modes: content, reasoning (inside
  `<think>…</think>`) and tool (inside `<tool_call>…</tool_call>`). Only the
  markers that can end the current mode are looked for, so `<tool_call>` in
  reasoning is reasoning text and `<think>` in a tool block is tool text.
- Stop strings are matched in the raw stream (markers included, every mode),
  and the reply is exactly what feeding the text before the first match,
  then `finish()`, would give. The match itself is never emitted.
- Invariant: `carry` is the only unreleased raw text, and it is the shortest
  suffix that could still start a stop string or a marker of the current mode.
  Everything before it is settled: no later piece can change what it means,
  so nothing is ever emitted and then taken back.

A tool block is buffered and emitted as one event when it closes; one left
open at the end (or cut by a stop string) is returned as plain content, raw,
so a malformed block is never lost. Whitespace-only content next to tool
blocks is noise from the template, not an answer: content whitespace is held
until non-space content follows; it is dropped when a tool block opens (but
kept in that block's raw text, in case it never closes) and at the end when
nothing but whitespace followed the last tool block.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK, END_THINK, TOOL, END_TOOL = "<think>", "</think>", "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Event:
    kind: str     # "content" | "reasoning" | "tool"
    text: str


class Emitter:
    """One reply's text in, events out. Not thread-safe: one per request."""

    def __init__(self, stop: list[str] | None = None, think: bool = False, tools: bool = True,
                 reasoning: bool = True, max_calls: int | None = None):
        self.stop = [s for s in (stop or []) if s]
        self.tools = tools
        self.reasoning = reasoning   # False: `<think>` is plain text (raw completions)
        self.mode = "reasoning" if think else "content"   # the template may open <think>
        self.carry = ""        # unsettled raw tail (see the invariant above)
        self.space = ""        # content whitespace held back (tools only)
        self.tool_raw = ""     # the open tool block as it was written, opening tag included
        self.tool_start = 0    # where its inner text starts in tool_raw
        self.after_tool = False  # a tool block closed, no non-space content since
        self.stopped = False   # a stop string ended the reply
        self.stop_string: str | None = None   # which one (Anthropic reports it)
        # parallel_tool_calls false: the reply ends when this many tool blocks closed
        self.max_calls, self.calls = max_calls, 0
        self.done = False      # the reply ended (stop string or finish())
        self.out: list[Event] = []

    def push(self, text: str) -> list[Event]:
        """Events that are settled now; sets `stopped` at a stop string."""
        if self.done or not text:
            return []
        buf = self.carry + text
        hit = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:       # the reply is buf[:hit], settled at once
            self.stopped, self.carry = True, ""
            self.stop_string = next(s for s in self.stop if buf.find(s) == hit)
            self.scan(buf[:hit], final=True)
            return self.flush()
        self.scan(buf, final=False)
        if self.max_calls is not None and self.calls >= self.max_calls:
            self.stopped, self.carry = True, ""     # what follows the last call is dropped
            return self.flush()
        return self.take()

    def finish(self) -> list[Event]:
        """End of the reply: flush the carry into its channel. Idempotent."""
        if self.done:
            return []
        buf, self.carry = self.carry, ""
        self.scan(buf, final=True)
        return self.flush()

    # -- internals ---------------------------------------------------------

    def scan(self, buf: str, final: bool) -> None:
        """Release `buf` (carry + new text, with no stop string in it) up to
        what is settled; keep the rest as the new carry. With `final`, all of it."""
        limit = len(buf) if final else len(buf) - held(buf, self.stop)
        i = 0
        while True:
            if self.max_calls is not None and self.calls >= self.max_calls:
                self.carry = ""          # the reply ends with the last call it may make
                return
            markers = self.markers()
            found = [(j, m) for m in markers if (j := buf.find(m, i, limit)) >= 0]
            if not found:
                break
            j, m = min(found)
            self.text(buf[i:j])
            self.switch(m)
            i = j + len(m)
        end = limit if final else limit - held(buf[i:limit], markers)
        self.text(buf[i:end])
        self.carry = buf[end:]

    def markers(self) -> list[str]:
        """The markers that mean something in the current mode."""
        if self.mode == "reasoning":
            return [END_THINK]
        if self.mode == "tool":
            return [END_TOOL]
        return [THINK] * self.reasoning + [TOOL] * self.tools

    def switch(self, marker: str) -> None:
        if marker == THINK:
            self.mode = "reasoning"          # held content whitespace stays held
        elif marker == END_THINK:
            self.mode = "content"
        elif marker == TOOL:
            self.mode, self.tool_raw, self.space = "tool", self.space + TOOL, ""
            self.tool_start = len(self.tool_raw)
        else:                                # END_TOOL: the block is complete
            self.emit("tool", self.tool_raw[self.tool_start:])
            self.calls += 1
            self.mode, self.tool_raw, self.after_tool = "content", "", True

    def text(self, s: str) -> None:
        """Settled text in the current mode."""
        if not s:
            return
        if self.mode == "tool":
            self.tool_raw += s
        elif self.mode == "reasoning":
            self.emit("reasoning", s)
        elif not self.tools:
            self.emit("content", s)
        else:                                # hold trailing whitespace
            s = self.space + s
            cut = len(s.rstrip())
            self.emit("content", s[:cut])
            self.space = s[cut:]
            self.after_tool = self.after_tool and not cut

    def flush(self) -> list[Event]:
        """The reply ended: an open tool block is content; so is held
        whitespace, unless it only trails a tool block (then it is noise)."""
        self.done = True
        if self.mode == "tool":
            self.emit("content", self.tool_raw)
            self.tool_raw = ""
        if self.space and not self.after_tool:
            self.emit("content", self.space)
        self.space = ""
        return self.take()

    def emit(self, kind: str, s: str) -> None:
        """Queue an event, merging with the last one of the same text kind."""
        if not s and kind != "tool":
            return
        if kind != "tool" and self.out and self.out[-1].kind == kind:
            s = self.out.pop().text + s
        self.out.append(Event(kind, s))

    def take(self) -> list[Event]:
        out, self.out = self.out, []
        return out


def held(buf: str, patterns: list[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of a pattern."""
    best = 0
    for p in patterns:
        for n in range(min(len(p) - 1, len(buf)), best, -1):
            if buf.endswith(p[:n]):
                best = n
                break
    return best


def joined(events: list[Event]) -> dict[str, object]:
    """All of a reply's events as one message: for non-streaming replies and tests."""
    return {"content": "".join(e.text for e in events if e.kind == "content"),
            "reasoning": "".join(e.text for e in events if e.kind == "reasoning"),
            "tools": [e.text for e in events if e.kind == "tool"]}
