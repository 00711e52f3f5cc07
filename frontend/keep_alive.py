"""Ollama's `keep_alive`: how long a model stays loaded after a request.

Seconds (a number), or a duration string as Go writes them ("300ms", "30s", "5m",
"1h30m"); `0` unloads the model once the request is over, `-1` (or "-1") keeps it
until it is evicted or unloaded. Anything else (another negative, past a month, a
boolean) is a 400 naming the field.
"""
from __future__ import annotations

import math
import re

from .errors import APIError

FOREVER = -1.0
MAX_KEEP_ALIVE_S = 30 * 86400.0        # past a month: surely a mistake (use -1)
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h))+")


def bad(why: str) -> APIError:
    return APIError(400, f"keep_alive {why}: give seconds (a number; 0 unloads after this "
                         "request, -1 never) or a duration such as \"30s\", \"5m\", \"1h\"",
                    param="keep_alive")


def parse_keep_alive(value) -> float | None:
    """Seconds (FOREVER for never), None when absent; APIError(400) when malformed."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad("must be a number or a duration string, not a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+(?:\.\d+)?", text):
            seconds = float(text)
        elif len(text) <= 64 and DURATION.fullmatch(text):
            seconds = sum(float(n) * UNITS[u] for n, u in PART.findall(text))
        else:
            raise bad(f"{value[:64]!r} is not a duration")
    else:
        raise bad(f"must be a number or a duration string, not {type(value).__name__}")
    if not math.isfinite(seconds):
        raise bad("must be finite")
    if seconds < 0:
        if seconds == -1:
            return FOREVER
        raise bad(f"{seconds:g} is out of range (-1, or 0 to {MAX_KEEP_ALIVE_S:g} s)")
    if seconds > MAX_KEEP_ALIVE_S:
        raise bad(f"{seconds:g} s is out of range (at most {MAX_KEEP_ALIVE_S:g} s; -1: never "
                  "unload)")
    return seconds
