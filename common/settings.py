"""Every environment variable Pantheon reads, read here and nowhere else; and every
default a flag, a config object or a message field starts from, defined here once.

Each variable is documented in the README's configuration table, each default in its
flag table.
"""
from __future__ import annotations

import os
from pathlib import Path

# -- defaults ------------------------------------------------------------------------
HOST = "127.0.0.1"
PORT = 8000
WORKER_ADDR = "tcp://127.0.0.1:5570"     # the ZeroMQ socket the frontend binds for workers
ADMIN_ADDR = "tcp://127.0.0.1:5571"      # the ZeroMQ admin socket
SLOTS = 8                                # KV slots per replica
PREFILL_CHUNK = 128                      # prompt tokens per step
PREFIX_CACHE_MB = 512.0                  # host memory per worker for idle conversations
QUEUE_DEPTH = 32                         # requests that may wait for a slot, per model
QUEUE_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 8 << 20
WORKER_TIMEOUT_S = 5.0                   # silence (or one step) this long: a worker is slow
WORKER_LOST_AFTER_S = 60.0               # silence this long: an external worker is lost
MAX_MODELS = 16                          # resident replicas, all models together
UNLOAD_TIMEOUT_S = 30.0                  # an unload's drain deadline
# bounds on one client (frontend/limits.py)
HEADER_TIMEOUT_S = 10.0                  # a request's line and headers, first byte to last
BODY_TIMEOUT_S = 30.0                    # its body, end of headers to last byte
WRITE_TIMEOUT_S = 30.0                   # a peer that reads nothing this long is dropped
MAX_HEADER_BYTES = 32 << 10              # request line + headers
MAX_CONNECTIONS = 1024                   # open HTTP connections; a 503 beyond
SEND_BUFFER_BYTES = 64 << 10             # per connection: socket send buffer (and ours)
MAX_MESSAGES = 2048                      # chat messages per request
MAX_REQUEST_TOKENS = 262144              # n x max_tokens (x prompts) per request
MAX_STOP_CHARS = 512                     # characters per stop string
MAX_TOOL_SCHEMA_BYTES = 256 << 10        # `tools` as compact JSON
MAX_TOOL_SCHEMA_DEPTH = 32               # `tools` nesting
STREAM_BUFFER_TOKENS = 4096              # tokens held for a client not reading its stream


def cache_dir() -> Path:
    """Where fetched models live (`PANTHEON_CACHE_DIR`, default ~/.cache/pantheon)."""
    raw = os.environ.get("PANTHEON_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "pantheon"


def default_model_path() -> Path | None:
    """An explicit model to use instead of the embedded default (`PANTHEON_MODEL`)."""
    raw = os.environ.get("PANTHEON_MODEL")
    return Path(raw).expanduser() if raw else None


def log_level() -> str:
    """Logging level for every process (`PANTHEON_LOG_LEVEL`, default INFO)."""
    return os.environ.get("PANTHEON_LOG_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """The key every non-public HTTP route requires (`PANTHEON_API_KEY`; `--api-key` wins)."""
    return os.environ.get("PANTHEON_API_KEY") or None


def queue_depth() -> int:
    """Requests that may wait for a slot, per model (`BS_QUEUE_DEPTH`, default 32)."""
    raw = os.environ.get("BS_QUEUE_DEPTH", str(QUEUE_DEPTH))
    try:
        depth = int(raw)
    except ValueError:
        raise ValueError(f"BS_QUEUE_DEPTH must be a whole number, not {raw!r}") from None
    if depth < 0:
        raise ValueError("BS_QUEUE_DEPTH must be >= 0")
    return depth


def admin_key() -> str | None:
    """Key for the /admin/ routes and the ZeroMQ admin socket (`PANTHEON_ADMIN_KEY`)."""
    return os.environ.get("PANTHEON_ADMIN_KEY") or None


def keys_dir() -> str | None:
    """The CURVE keys folder of the ZeroMQ links (`PANTHEON_KEYS_DIR`; `--keys` wins)."""
    return os.environ.get("PANTHEON_KEYS_DIR") or None


def admin_addr() -> str:
    """Where `pantheon admin` finds the admin socket (`PANTHEON_ADMIN_ADDR`)."""
    return os.environ.get("PANTHEON_ADMIN_ADDR", ADMIN_ADDR)


def openai_api_key() -> str | None:
    """The key `pantheon bench serve` sends by default (`OPENAI_API_KEY`, the SDKs' name)."""
    return os.environ.get("OPENAI_API_KEY") or None


def gpu_full_logits() -> bool:
    """The spec's `QWEN35_GPU_FULL_LOGITS` (any non-empty value): copy full-vocabulary
    logits to the host every step. `pantheon serve` refuses to start with it set."""
    return bool(os.environ.get("QWEN35_GPU_FULL_LOGITS"))


def test_stall(die: str) -> tuple[int, float] | None:
    """A test hook (`PANTHEON_TEST_STALL=STEP:SECONDS[@DIE]`): a worker (only DIE's, when
    given) sleeps SECONDS inside its STEP-th scheduler step, once, as a long step on a
    contended host would take."""
    raw = os.environ.get("PANTHEON_TEST_STALL")
    if not raw:
        return None
    spec, _, only = raw.partition("@")
    try:
        step, seconds = spec.split(":")
        stall = int(step), float(seconds)
    except ValueError:
        raise ValueError(f"PANTHEON_TEST_STALL must be STEP:SECONDS[@DIE], not {raw!r}") from None
    return stall if not only or only == die else None


def c_compiler() -> str:
    """The C compiler that builds the CPU kernels on first use (`CC`, default `cc`)."""
    return os.environ.get("CC") or "cc"
