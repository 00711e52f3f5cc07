"""A request body, read and decoded once for every route: size, JSON, depth, text.

What `read_json` refuses, each an OpenAI error (so the connection stays usable):
- more than `limit` bytes: 413 (refused before reading past the limit);
- not valid JSON, or not an object: 400;
- nested deeper than `MAX_JSON_DEPTH`: 400 (Python's decoder would otherwise raise
  RecursionError at ~1,000 levels, and every walker after it would pay for the depth);
- a string holding a UTF-16 surrogate (`"\\ud800"` alone, or CESU-8 bytes): 400 naming
  the field. Such a string cannot be encoded as UTF-8, so the tokenizer, the JSON
  response and the logs would all fail on it later.

The content type is checked before the body is read (app.Guard: 415).
"""
from __future__ import annotations

import json
import re

from starlette.requests import ClientDisconnect, Request

from .errors import APIError

MAX_JSON_DEPTH = 64        # tools' schemas nest to MAX_TOOL_SCHEMA_DEPTH (32) + 3
# what may decode to a surrogate: a \uD800-\uDFFF escape, or its UTF-8-like bytes
# (json.loads decodes bytes with "surrogatepass")
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (before reading it all)."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"request body exceeds the limit of {limit} bytes",
                       code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:      # gone, or cut off by the body deadline (limits.py)
        raise APIError(408, "the request body did not arrive", code="request_timeout") \
            from None
    return b"".join(chunks)


def parse_json(body: bytes, empty: dict | None = None) -> dict:
    """A JSON object from `body` (`empty` when the body is empty and that is allowed)."""
    if not body and empty is not None:
        return empty
    try:
        data = json.loads(body)
    except RecursionError:
        raise too_deep() from None
    except ValueError as exc:                 # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    check(data, _MAYBE_SURROGATE.search(body) is not None)
    return data


def too_deep() -> APIError:
    return APIError(400, f"request body nests more than {MAX_JSON_DEPTH} levels deep",
                    code="limit_exceeded")


def check(data: dict, surrogates: bool) -> None:
    """One walk, no recursion: the depth bound, and (when the bytes may hold one) the
    first string with a surrogate, named by its path (`messages[0].content`)."""
    stack = [(data, None, 1)]                 # (node, its path as (parent, key), depth)
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, (dict, list)):
                stack.append((value, (path, key), depth + 1))
                value = None
            if surrogates and (isinstance(value, str) and _SURROGATE.search(value)
                               or isinstance(key, str) and _SURROGATE.search(key)):
                where = printable(field_name((path, key)))
                raise APIError(400, f"{where} holds an unpaired UTF-16 surrogate (e.g. "
                                    "\\ud800), which is not valid Unicode text",
                               param=where, code="invalid_unicode")


def field_name(path) -> str:
    """`messages[0].content` from a path of (parent, key) pairs."""
    keys = []
    while path is not None:
        path, key = path
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else key
    return out


def printable(text: str) -> str:
    """`text` with surrogates escaped, so an error message can carry it."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)[:200]
