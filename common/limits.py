"""The one table of what may cross a ZeroMQ socket: frame sizes, msgpack bounds, field sizes.

Both sides read it: each socket sets ZMQ_MAXMSGSIZE from it (a larger frame drops the
peer's connection before a byte of it is kept), `protocol.decode` gives msgpack its
bounds and checks every field against it, and the HTTP edge refuses (400) whatever would
not pass there, so nothing the frontend accepts is refused by a worker's decoder.

String limits count characters (a session id of 256 characters may take 1 KiB of UTF-8);
msgpack's own string bound is wider than any field's, so the field check, which names the
field, is the one that refuses.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_MESSAGE_BYTES = 64 << 20        # one frame on the worker link (a prompt of millions)
MAX_ADMIN_MESSAGE_BYTES = 1 << 20   # one frame on the admin socket
MAX_ADMIN_TOKEN_BYTES = 4096        # the admin socket's first frame: the token

MAX_ID_CHARS = 256                  # request, model and replica ids, traces, cache salts
MAX_SESSION_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 1024               # entries of one request's logit_bias
MAX_TOKEN_ID = 2**31 - 1            # any token id on the wire (a vocabulary is smaller)
MAX_GRAMMAR_CHARS = 1 << 20         # a constrained request's grammar (llguidance's text)
MAX_PROMPT_TOKENS = 1 << 21
MAX_STOP_IDS = 256
MAX_PREDICTION_CHARS = 1 << 20      # OpenAI's `prediction` (a predicted output's text)
MAX_TEXT_CHARS = 64 << 10           # paths, names, error messages


@dataclass(frozen=True)
class DecodeLimits:
    """What msgpack may build from one message: every count is checked as msgpack reads
    its header, so a bomb is refused before its containers exist."""

    max_bytes: int
    max_str: int                    # bytes of one string
    max_array: int                  # elements of one array
    max_map: int                    # entries of one map
    max_containers: int             # arrays and maps in one message, all levels together
    max_depth: int = 0              # nesting of arrays and maps (0: msgpack's own, 1024)


# The worker link: a Generate's prompt is the longest array, a grammar the longest string;
# an Outputs message of a 256-slot batch asking for 20 logprobs holds ~6,000 containers.
LINK = DecodeLimits(MAX_MESSAGE_BYTES, 4 * MAX_GRAMMAR_CHARS, MAX_PROMPT_TOKENS,
                    4 * MAX_LOGIT_BIAS, 1 << 16)
# What a worker sends the frontend (hellos, heartbeats, a step's outputs): never a prompt,
# so far tighter, and the frontend's ROUTER drops a larger frame. It is read from any peer
# that reaches the worker port, before its hello has been judged.
FROM_WORKER = DecodeLimits(16 << 20, 1 << 20, 1 << 16, 4096, 1 << 16)
# The admin socket: small commands, read before anything is trusted.
ADMIN = DecodeLimits(MAX_ADMIN_MESSAGE_BYTES, MAX_TEXT_CHARS, 1024, 256, 4096, 16)
