"""Logging for every process: one line per record, as text or as one JSON object.

A record about a request carries its id (the client's X-Request-Id, else one the
frontend made): set for a whole request with `request_id.set()` (the frontend, per
HTTP request) or given per record as `extra={"request_id": ...}` (the worker).
Structured fields (`extra={"fields": {...}}`: the access log's) become keys of the
JSON object, or `key=value` pairs at the end of a text line.
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

FORMATS = ("text", "json")
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id",
                                                                        default=None)


class RequestContext(logging.Filter):
    """Gives every record a `request_id` (its own, the context's, or None)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id.get()
        return True


def text_fields(fields: dict) -> str:
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) and (' ' in v or not v) else v}"
                    for k, v in fields.items())


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.rid = f" [{record.request_id}]" if getattr(record, "request_id", None) else ""
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return f"{line} {text_fields(fields)}" if fields else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str, fmt: str = "text") -> None:
    """Configure the root logger of this process (once, at start)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestContext())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
