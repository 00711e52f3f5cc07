"""Every environment variable Pantheon reads, read here and nowhere else; and every
default a flag, a config object or a message field starts from, defined here once.

Each variable is documented in docs/configuration.md, each default in its
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
WORKER_LOST_AFTER_S = 60.0               # silent, probes unanswered, this long: lost
MAX_MODELS = 16                          # resident replicas, all models together
UNLOAD_TIMEOUT_S = 30.0                  # an unload's drain deadline
ADMIN_TIMEOUT_S = 10.0                   # `pantheon admin`: wait this long for the server
SHUTDOWN_TIMEOUT_S = 30.0                # SIGTERM: how long requests may run on
ASYNC_POLL_US = 500                      # a GPU worker's longest sleep polling its step
# bounds on one client (frontend/limits.py)
HEADER_TIMEOUT_S = 10.0                  # a request's line and headers, first byte to last
BODY_TIMEOUT_S = 30.0                    # its body, end of headers to last byte
WRITE_TIMEOUT_S = 30.0                   # a peer that reads nothing this long is dropped
MAX_HEADER_BYTES = 32 << 10              # request line + headers
MAX_CONNECTIONS = 1024                   # open HTTP connections; a 503 beyond
MAX_CONNECTIONS_PER_CLIENT = 512         # from one IP address (idle ones closed first)
PREPARE_TIMEOUT_S = 30.0                 # a request's templating + tokenization, queue too
RESPONSES_TTL_S = 3600.0                 # how long a stored Responses-API response is kept
RESPONSES_MAX_MB = 64.0                  # stored responses, all together (oldest go first)
SEND_BUFFER_BYTES = 64 << 10             # per connection: socket send buffer (and ours)
MAX_MESSAGES = 2048                      # chat messages per request
MAX_REQUEST_TOKENS = 262144              # n x max_tokens (x prompts) per request
MAX_REQUEST_CHOICES = 2048               # n x prompts per request
MAX_STOP_CHARS = 512                     # characters per stop string
MAX_TOOL_SCHEMA_BYTES = 256 << 10        # `tools` as compact JSON
MAX_TOOL_SCHEMA_DEPTH = 32               # `tools` nesting
STREAM_BUFFER_TOKENS = 4096              # tokens held for a client not reading its stream
HEARTBEAT_S = 5.0                        # between heartbeats to the router registry
REGISTRY_KINDS = ("vllm-router", "smg")  # router registration APIs spoken


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


def log_format() -> str:
    """`text` or `json` (`PANTHEON_LOG_FORMAT`, default text; `--log-format` wins)."""
    raw = os.environ.get("PANTHEON_LOG_FORMAT", "").strip().lower() or "text"
    if raw not in ("text", "json"):
        raise ValueError(f"PANTHEON_LOG_FORMAT must be text or json, not {raw!r}")
    return raw


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


def env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {raw!r}") from None
    if value < low:
        raise ValueError(f"{name} must be >= {low}, not {value}")
    return value


def prefill_chunk() -> int:
    """Prompt tokens per step (`QWEN35_BS_PREFILL_CHUNK`, default 128; `--prefill-chunk`
    wins). The spec's `QWEN35_BS_PREFILL_BATCH=0` (token-by-token prefill) means 1."""
    batch = os.environ.get("QWEN35_BS_PREFILL_BATCH", "")
    if batch not in ("", "0", "1"):
        raise ValueError(f"QWEN35_BS_PREFILL_BATCH must be 0 or 1, not {batch!r}")
    chunk = env_int("QWEN35_BS_PREFILL_CHUNK", PREFILL_CHUNK, 1)
    return 1 if batch == "0" else chunk


def batch_slots() -> None:
    """The spec's `QWEN35_BATCH_SLOTS` switch (unset: single-user; 1: 8 batched slots).
    Pantheon always batches (`--slots`, default 8; `--slots 1` is single-user mode), so
    unset, 0 and 1 all leave the slot count alone; anything else is refused."""
    raw = os.environ.get("QWEN35_BATCH_SLOTS", "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"QWEN35_BATCH_SLOTS={raw!r}: the original server's switch takes 0 "
                         "or 1 and Pantheon always batches; set the slots per replica with "
                         "--slots N (1 = single-user mode)")


def bs_stats() -> bool:
    """`QWEN35_BS_STATS=1`: a worker prints one line of timing per step to stderr."""
    return os.environ.get("QWEN35_BS_STATS", "") == "1"


def async_poll_us() -> int:
    """`PN_ASYNC_POLL_US` (default 500): the longest a GPU worker sleeps between polls of
    the step it has queued on the device, instead of spinning a host core on it."""
    return env_int("PN_ASYNC_POLL_US", ASYNC_POLL_US, 0)


def refused_knobs() -> list[str]:
    """Why each of the spec's variables set here cannot be honoured (empty: all fine)."""
    refused = []
    if os.environ.get("QWEN35_BS_DRIVER_SAMPLE", "") == "0":
        refused.append("QWEN35_BS_DRIVER_SAMPLE=0 asks for the legacy lockstep sampling "
                       "outside the step; Pantheon always samples in the worker, on the die: "
                       "unset the variable")
    if gpu_full_logits():
        refused.append(FULL_LOGITS_REFUSED)
    try:
        batch_slots()
        prefill_chunk()
        async_poll_us()
        kv_cache()
    except ValueError as exc:
        refused.append(str(exc))
    return refused


FULL_LOGITS_REFUSED = (
    "QWEN35_GPU_FULL_LOGITS is set, but Pantheon samples on the die: copying full-vocabulary "
    "logits to the host every step (8 rows x 151,936 x 4 B) caps a K80's ~0.4 GB/s host "
    "link, so only sampled ids and logprobs cross it; unset the variable")


def admin_key() -> str | None:
    """Key for the /admin/ routes and the ZeroMQ admin socket (`PANTHEON_ADMIN_KEY`)."""
    return os.environ.get("PANTHEON_ADMIN_KEY") or None


def keys_dir() -> str | None:
    """The CURVE keys folder of the ZeroMQ links (`PANTHEON_KEYS_DIR`; `--keys` wins)."""
    return os.environ.get("PANTHEON_KEYS_DIR") or None


SPAWN_PROOF_ENV = "PANTHEON_SPAWN_PROOF"   # set by `serve` for the workers it spawns


def spawn_proof() -> str | None:
    """The secret a spawning frontend handed this worker (its hello carries it back).
    Taken out of the environment as it is read, so nothing this process starts inherits
    it; /proc/PID/environ shows it to this user only."""
    return os.environ.pop(SPAWN_PROOF_ENV, None) or None


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


def test_step_floor() -> float:
    """A test hook (`PANTHEON_TEST_STEP_FLOOR=SECONDS`): every scheduler step of a worker
    lasts at least SECONDS (it sleeps out the rest), so that a test can hold a stream
    open for a known time with few tokens, whatever the host's speed."""
    raw = os.environ.get("PANTHEON_TEST_STEP_FLOOR")
    try:
        floor = float(raw) if raw else 0.0
    except ValueError:
        floor = -1.0
    if not 0.0 <= floor <= 10.0:
        raise ValueError(f"PANTHEON_TEST_STEP_FLOOR must be seconds in [0, 10], not {raw!r}")
    return floor


def test_load_stall() -> float:
    """A test hook (`PANTHEON_TEST_LOAD_STALL=SECONDS`): a worker's model load sleeps
    SECONDS before it starts, so that a test can act while a load is under way."""
    raw = os.environ.get("PANTHEON_TEST_LOAD_STALL")
    try:
        return float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"PANTHEON_TEST_LOAD_STALL must be seconds, not {raw!r}") from None
def registry_url() -> str | None:
    """The router this instance registers with (`PANTHEON_REGISTRY_URL`, an http(s) URL
    like `http://router:30000`); unset: no registration at all. A malformed value is a
    startup error."""
    raw = os.environ.get("PANTHEON_REGISTRY_URL")
    return _http_url("PANTHEON_REGISTRY_URL", raw) if raw else None


def registry_kind() -> str:
    """Which router's registration API to speak (`PANTHEON_REGISTRY_KIND`, default
    `vllm-router`; or `smg`, the SGLang model gateway)."""
    kind = os.environ.get("PANTHEON_REGISTRY_KIND", REGISTRY_KINDS[0]).strip().lower()
    if kind not in REGISTRY_KINDS:
        raise ValueError(f"PANTHEON_REGISTRY_KIND must be one of {', '.join(REGISTRY_KINDS)}, "
                         f"not {kind!r}")
    return kind


def registry_transport() -> str:
    """The spec's transport hint sent along with a registration (`PANTHEON_REGISTRY_TRANSPORT`,
    default `local`)."""
    return os.environ.get("PANTHEON_REGISTRY_TRANSPORT") or "local"


def node_id() -> str:
    """This node's name in a registration (`PANTHEON_NODE_ID`, default `node0`)."""
    return os.environ.get("PANTHEON_NODE_ID") or "node0"


def heartbeat_s() -> float:
    """Seconds between heartbeats to the router (`PANTHEON_HEARTBEAT_S`, default 5)."""
    raw = os.environ.get("PANTHEON_HEARTBEAT_S", str(HEARTBEAT_S))
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < 86400:
        raise ValueError(f"PANTHEON_HEARTBEAT_S must be a number of seconds > 0, not {raw!r}")
    return value


def advertise_url() -> str | None:
    """The URL the router should send requests to (`PANTHEON_ADVERTISE_URL`); unset:
    `http://HOST:PORT` of `serve`, with this host's name when bound to all interfaces."""
    raw = os.environ.get("PANTHEON_ADVERTISE_URL")
    return _http_url("PANTHEON_ADVERTISE_URL", raw) if raw else None


def _http_url(name: str, raw: str) -> str:
    """`raw` as `scheme://host[:port][/path]` without a trailing slash, or a ValueError
    that says what is wrong with it."""
    from urllib.parse import urlsplit
    bad = f"{name} must be an http:// or https:// URL like http://router:30000, not {raw!r}"
    try:
        url = urlsplit(raw.strip())
        port = url.port                     # raises on a port that is not a number
    except ValueError:
        raise ValueError(bad) from None
    if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment \
            or (port is not None and not 0 < port < 65536):
        raise ValueError(bad)
    return raw.strip().rstrip("/")


KV_CACHE_TYPES = ("f32", "f16", "q8_0", "q4_0")     # common/kv_cache.KV_TYPE_NAMES
# what a CPU die's K-quant products take as activations (worker/activations.py)
ACTIVATIONS = ("auto", "int8", "int16")


def kv_cache() -> str:
    """The default KV cache type of keys and values (`--kv-cache` overrides it, and
    `--kv-cache-k` / `--kv-cache-v` each half): `PANTHEON_KV_CACHE` (f32, f16, q8_0,
    q4_0), else q4_0 where `QWEN35_KV_Q4=1` (the spec's variable), else "" (the die's
    default: fp32 on a CPU, fp16 on a GPU). Read once at start; the choice then travels
    in each load message."""
    raw = os.environ.get("PANTHEON_KV_CACHE", "").strip().lower()
    if raw:
        if raw not in KV_CACHE_TYPES:
            raise ValueError(f"PANTHEON_KV_CACHE must be one of {', '.join(KV_CACHE_TYPES)}, "
                             f"not {raw!r}")
        return raw
    q4 = os.environ.get("QWEN35_KV_Q4", "").strip()
    if q4 not in ("", "0", "1"):
        raise ValueError(f"QWEN35_KV_Q4 must be 1 (keys and values in q4_0) or 0 (the "
                         f"default), not {q4!r}")
    return "q4_0" if q4 == "1" else ""


AMX_MODES = ("auto", "off")


def amx() -> str:
    """Whether the CPU kernels may use AMX tiles (`PANTHEON_AMX`): auto (the default: where
    the CPU and the kernel have them) or off (the integer and BLAS paths only)."""
    raw = os.environ.get("PANTHEON_AMX", "").strip().lower() or "auto"
    if raw not in AMX_MODES:
        raise ValueError(f"PANTHEON_AMX must be one of {', '.join(AMX_MODES)}, not {raw!r}")
    return raw


ISAS = ("native", "avx2", "generic")


def isa() -> str:
    """The instruction set the CPU kernels are compiled for (`PANTHEON_ISA`): native (the
    default: everything this CPU has), avx2 (AVX2, FMA, F16C: the 256-bit paths an AVX2-
    only host such as a Haswell or Zen 3 runs, on any host that has AVX2) or generic
    (x86-64 without AVX: the portable paths)."""
    raw = os.environ.get("PANTHEON_ISA", "").strip().lower() or "native"
    if raw not in ISAS:
        raise ValueError(f"PANTHEON_ISA must be one of {', '.join(ISAS)}, not {raw!r}")
    return raw


def c_compiler() -> str:
    """The C compiler that builds the CPU kernels on first use (`CC`, default `cc`)."""
    return os.environ.get("CC") or "cc"
