"""Bounds on what one client may ask for or hold, each refused with an OpenAI error.

Two halves:
- `RequestLimits`: checks of a parsed body (openai_api calls them): messages,
  n × max_tokens, stop strings, tool schemas. A 400 naming the field.
- `ConnectionLimits` and `BoundedHttp`: uvicorn's httptools protocol with what it
  lacks: a deadline for a request's headers (slowloris) and for its body, a cap on the
  header bytes, caps on open connections, all and per client IP (the longest-idle
  connection is closed to make room; a 503 when all are busy, except for /health and
  the load routes, which are always answered), and a deadline for a
  peer that stops reading (its connection is dropped). Each refusal is a JSON error
  body with `connection: close`, and a lingering close: our side is shut for writing
  (the peer reads the answer and then end of stream) while what the peer still sends is
  read and dropped for up to `LINGER_S`, so the kernel never answers those bytes with a
  reset that could discard the answer before the peer read it.
"""
from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..common import settings
from .errors import APIError

log = logging.getLogger("pantheon.frontend.limits")
LINGER_S = 2.0      # a refused peer's bytes are read and dropped this long, at most


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """What one generation request may ask for."""

    max_messages: int = settings.MAX_MESSAGES
    max_request_tokens: int = settings.MAX_REQUEST_TOKENS   # n × max_tokens (× prompts)
    max_stop_chars: int = settings.MAX_STOP_CHARS           # per stop string
    max_choices: int = settings.MAX_REQUEST_CHOICES         # n × prompts
    max_tool_schema_bytes: int = settings.MAX_TOOL_SCHEMA_BYTES
    max_tool_schema_depth: int = settings.MAX_TOOL_SCHEMA_DEPTH

    def messages(self, messages: list) -> None:
        if len(messages) > self.max_messages:
            raise too_much("messages", f"messages may have at most {self.max_messages} "
                                       f"entries, got {len(messages)}")

    def stop(self, stops: list[str]) -> None:
        for s in stops:
            if len(s) > self.max_stop_chars:
                raise too_much("stop", f"each stop string may have at most "
                                       f"{self.max_stop_chars} characters, got {len(s)}")

    def tokens(self, n: int, max_tokens: int | None, prompts: int = 1) -> None:
        """n × prompts choices, and n × max_tokens (× prompts) tokens, at most."""
        if n * prompts > self.max_choices:
            raise too_much("prompt", f"n × prompts is {n * prompts}, more than the "
                                     f"{self.max_choices} choices one request may ask for")
        if max_tokens is None:
            return
        total = n * prompts * max_tokens
        if total > self.max_request_tokens:
            what = "n × max_tokens" + (" × prompts" if prompts > 1 else "")
            raise too_much("max_tokens", f"{what} is {total}, more than the "
                                         f"{self.max_request_tokens} tokens one request may "
                                         "ask for; lower max_tokens or n")

    def tools(self, tools) -> None:
        if tools is None:
            return
        depth = json_depth(tools)
        if depth > self.max_tool_schema_depth:
            raise too_much("tools", f"tools nest {depth} levels deep as JSON (a function's "
                                    "parameters start at level 4), more than "
                                    f"{self.max_tool_schema_depth}")
        size = len(json.dumps(tools, separators=(",", ":")))
        if size > self.max_tool_schema_bytes:
            raise too_much("tools", f"tools take {size} bytes as JSON, more than "
                                    f"{self.max_tool_schema_bytes}")


def too_much(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="limit_exceeded")


def json_depth(value) -> int:
    """Nesting depth of a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in node)
    return deepest


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """What one HTTP connection may hold."""

    header_timeout_s: float = settings.HEADER_TIMEOUT_S   # first byte → end of headers
    body_timeout_s: float = settings.BODY_TIMEOUT_S       # end of headers → end of body
    write_timeout_s: float = settings.WRITE_TIMEOUT_S     # a peer reading nothing
    max_header_bytes: int = settings.MAX_HEADER_BYTES     # request line + headers
    max_connections: int = settings.MAX_CONNECTIONS
    max_connections_per_client: int = settings.MAX_CONNECTIONS_PER_CLIENT   # per IP
    send_buffer_bytes: int = settings.SEND_BUFFER_BYTES   # per connection, kernel + ours

    def protocol(self) -> type:
        """The protocol class uvicorn's `http=` takes, bound to these limits."""
        return type("BoundedHttp", (BoundedHttp,), {"limits": self})


def error_response(status: int, reason: str, err: APIError) -> bytes:
    """A whole HTTP response for `err`, written straight to a transport."""
    body = json.dumps(err.body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and caps of `limits`.

    Invariant: while a request's headers are being read, exactly one header timer
    is armed; while its body is, one body timer; while writes are paused, one write
    timer. Each is cancelled when its phase ends or the connection goes.
    """

    limits: ConnectionLimits = ConnectionLimits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timers = {}
        self.header_bytes = self.parsed_bytes = 0   # read in the header phase; parsed
        self.in_headers = True
        self.lingering = False
        sock = transport.get_extra_info("socket")
        if sock is not None and self.limits.send_buffer_bytes:
            # what a peer that reads nothing can leave queued here: the kernel's buffer
            # (Linux doubles it) and the transport's, instead of ~4 MB autotuned
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
            transport.set_write_buffer_limits(high=self.limits.send_buffer_bytes)
        self.busy, self.idle_since = False, self.loop.time()
        self.over_cap = not self.make_room()
        self.arm("header", self.limits.header_timeout_s, self.headers_too_slow)

    # -- the connection caps -------------------------------------------------------------
    def make_room(self) -> bool:
        """Room for this new connection under both caps, closing the longest-idle
        connection (of anyone, then of this client) where one is over; False if every
        connection that would have to go is busy."""
        others = [c for c in self.connections if c is not self and not c.transport.is_closing()]
        if len(others) >= self.limits.max_connections and not self.close_idle(others):
            return False
        ip = self.client[0] if self.client else None
        mine = [c for c in others if ip is not None and c.client and c.client[0] == ip
                and not c.transport.is_closing()]
        return len(mine) < self.limits.max_connections_per_client or self.close_idle(mine)

    @staticmethod
    def close_idle(conns: list) -> bool:
        """Close the one idle the longest (no request in progress); False if none is."""
        idle = [c for c in conns if isinstance(c, BoundedHttp) and not c.busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since)
        log.info("closed the idle connection from %s to make room", oldest.peer())
        oldest.transport.close()
        return True

    def on_response_complete(self) -> None:
        self.busy, self.idle_since = False, self.loop.time()
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        super().connection_lost(exc)

    def arm(self, name: str, delay: float, callback) -> None:
        self.disarm(name)
        if delay > 0:
            self.timers[name] = self.loop.call_later(delay, callback)

    def disarm(self, name: str) -> None:
        timer = self.timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    # -- reading -----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.lingering:                        # refused: read and dropped
            return
        self.busy = True                          # a request has begun (or is underway)
        if self.in_headers:
            self.header_bytes += len(data)
        super().data_received(data)
        # headers still incomplete: every byte since the request began was header
        if self.in_headers and self.header_bytes > self.limits.max_header_bytes:
            self.headers_too_big()

    def on_url(self, url: bytes) -> None:
        self.parsed_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # headers that arrive whole in one read are counted here, as parsed
        self.parsed_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def headers_too_big(self) -> None:
        self.refuse(431, "Request Header Fields Too Large", self.oversized())

    def oversized(self) -> APIError:
        return APIError(431, f"request line and headers exceed "
                             f"{self.limits.max_header_bytes} bytes", code="headers_too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # a transport's hard close, for a handler that must drop its client (lifecycle)
        self.scope["extensions"] = {"pantheon.abort": self.transport.abort}
        self.parsed_bytes = 0
        if not self.in_headers:                   # the next request on a kept-alive link
            self.in_headers, self.header_bytes = True, 0
            self.arm("header", self.limits.header_timeout_s, self.headers_too_slow)

    def on_headers_complete(self) -> None:
        self.in_headers = False
        self.disarm("header")
        self.arm("body", self.limits.body_timeout_s, self.body_too_slow)
        refusal = self.oversized() if self.parsed_bytes > self.limits.max_header_bytes \
            else BUSY if self.over_cap and not self.always_answered() else None
        if refusal is None:
            super().on_headers_complete()
            if self.over_cap and self.cycle is not None:
                self.cycle.keep_alive = False     # answered, then closed: room for others
            return
        app, self.app = self.app, refusal_app(refusal)     # answered, never handled
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def always_answered(self) -> bool:
        """/health (and the load routes routers poll) are answered even past the caps:
        cheap, and how an orchestrator tells busy from dead."""
        return self.url.split(b"?", 1)[0] in ALWAYS_ANSWERED

    def on_message_complete(self) -> None:
        self.disarm("body")
        super().on_message_complete()

    def headers_too_slow(self) -> None:
        self.timers.pop("header", None)
        self.refuse(408, "Request Timeout", APIError(
            408, f"the request's headers did not arrive within "
                 f"{self.limits.header_timeout_s:g} s", code="request_timeout"))

    def body_too_slow(self) -> None:
        self.timers.pop("body", None)
        self.refuse(408, "Request Timeout", APIError(
            408, f"the request's body did not arrive within {self.limits.body_timeout_s:g} s",
            code="request_timeout"))

    def refuse(self, status: int, reason: str, err: APIError) -> None:
        """Answer `err` where no response is under way, and close the connection; the
        handler of a request whose body was still coming sees a disconnect."""
        if self.transport.is_closing() or self.lingering:
            return
        cycle = self.cycle        # in the header phase: the previous request's, if any
        reading_body = cycle is not None and not self.in_headers and not cycle.response_complete
        ours = cycle is None or (cycle.response_complete if self.in_headers
                                 else not cycle.response_started)
        if reading_body:
            cycle.disconnected = True             # its handler's answer goes nowhere
            cycle.message_event.set()
        log.info("closed a connection from %s: %s", self.peer(), err.message)
        if ours:
            self.transport.write(error_response(status, reason, err))
        if ours and self.transport.can_write_eof():
            self.linger()
        else:
            self.transport.close()                # a response under way ends here

    def linger(self) -> None:
        """Shut our side once the answer is flushed, drop what the peer still sends,
        and close when it closes or after `LINGER_S`, whichever comes first."""
        self.lingering = True
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        if not self.transport.is_reading():       # paused by flow control: drain anyway
            self.transport.resume_reading()
        self.transport.write_eof()
        self.arm("linger", LINGER_S, self.end_linger)

    def end_linger(self) -> None:
        """The linger's end: closed, or dropped if the peer has not even read the answer
        (a close would wait on it for ever)."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def peer(self) -> str:
        return "%s:%s" % self.client if self.client else "?"

    # -- writing -----------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self.arm("write", self.limits.write_timeout_s, self.reader_stalled)

    def resume_writing(self) -> None:
        self.disarm("write")
        super().resume_writing()

    def reader_stalled(self) -> None:
        self.timers.pop("write", None)
        log.warning("dropped the connection from %s: it read nothing for %g s",
                    self.peer(), self.limits.write_timeout_s)
        self.transport.abort()


ALWAYS_ANSWERED = frozenset({b"/health", b"/get_load", b"/v1/loads"})
BUSY = APIError(503, "too many open connections; retry shortly", type="service_unavailable",
               code="too_many_connections", headers={"retry-after": "1"})


def refusal_app(err: APIError):
    """An ASGI app that answers `err` and closes the connection."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    headers += [(k.encode(), v.encode()) for k, v in (err.headers or {}).items()]

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    return app
