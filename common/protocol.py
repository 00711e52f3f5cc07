"""The wire between the frontend and its workers: typed messages over ZeroMQ.

Every message is one msgpack map `{"v": PROTOCOL, "k": kind, ...fields}` in a
single ZeroMQ frame. The frontend binds a ROUTER socket; each worker connects
a DEALER (so a restarted worker simply rejoins). Decoding is defensive, within
the one table of common/limits.py: size limits on the raw bytes and inside
msgpack (lengths, and the count of arrays and maps, so a bomb is refused before
it is built), strict map keys, then a check of every field's type and size
(`bounded`) against the message class before anything uses it; `encode`
refuses what the peer's decoder would. No pickle, ever.

New fields go at the end of a class, with defaults, so an older peer still
decodes what a newer one sends (unknown fields are ignored).
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field

import msgpack

from . import limits as lim
from .settings import PREFILL_CHUNK

PROTOCOL = 1
MAX_MESSAGE_BYTES = lim.MAX_MESSAGE_BYTES   # a frame on the worker link: ZMQ_MAXMSGSIZE too


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol."""


def bounded(most: int, **kw):
    """A field whose value (a string, list or map) may hold at most `most` characters or
    entries (common/limits.py): the decoder refuses more, naming the field."""
    return field(metadata={"max": most}, **kw)


CRITICAL = 3


def pressure_level(free: int, total: int) -> int:
    """Memory pressure as Heartbeat.pressure carries it, from the free fraction.

    0 ok (>= 20 % free), 1 elevated, 2 high (< 10 %), 3 critical (< 5 %):
    at critical, new requests wait for memory instead of starting.
    """
    frac = free / total if total else 1.0
    return 3 if frac < 0.05 else 2 if frac < 0.10 else 1 if frac < 0.20 else 0


# -- worker → frontend ------------------------------------------------------------

@dataclass(slots=True)
class Resident:
    """A replica a worker holds, as its hello lists it."""

    model_id: str
    path: str
    slots: int
    ctx: int
    weight_bytes: int = 0
    kv_bytes: int = 0


@dataclass(slots=True)
class Hello:
    """A worker announces itself (on connect, and again after a restart)."""

    die: str                 # "cpu" or a CUDA ordinal; "cpu:1" for a second CPU die
    kind: str                # "cpu" | "cuda"
    device_name: str
    mem_total: int           # bytes of the die's memory (host RAM for a CPU die)
    mem_free: int
    slots: int               # default KV slots per model replica
    pid: int = 0
    models: list[str] = field(default_factory=list)   # replica ids already resident
    budget: int = 0          # bytes models may use on this die (0: mem_total)
    # what it holds, so that a rejoining worker is reconciled instead of reloaded
    replicas: list[Resident] = field(default_factory=list)
    running: list[str] = field(default_factory=list)  # request ids it is still generating
    # a spawned worker's proof: the secret its frontend handed it at spawn (in its
    # environment, never on a command line); "" for an external worker
    proof: str = ""
    # which host it runs on (common/host_identity.py): two stages of a split replica on
    # one host share an ipc link, else tcp
    host: str = bounded(256, default="")
    public_key: str = bounded(64, default="")   # its CURVE public key (z85); "": no keys


@dataclass(slots=True)
class ReplicaLoad:
    """One resident replica's load, as a heartbeat reports it."""

    model_id: str
    busy: int                # slots running a sequence
    slots: int
    kv_tokens: int           # KV positions those sequences hold
    kv_capacity: int         # slots x ctx


# Upper edges (seconds) of the worker's step-time histogram; a last bucket holds the rest.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class Heartbeat:
    """Liveness and load, sent every HEARTBEAT_S by a thread of its own (and from a
    socket of its own, whose identity is the worker's plus HEARTBEAT_SUFFIX), so a step
    of any length does not silence it."""

    die: str
    active: int              # sequences running on this die, all models
    waiting: int             # generate requests waiting for a free slot
    mem_total: int
    mem_free: int
    host_mem_free: int
    pressure: int            # 0 ok, 1 elevated, 2 high, 3 critical
    pid: int = 0
    step_s: float = 0.0      # age of the step (or other loop work) in progress; 0: idle
    replicas: list[ReplicaLoad] = field(default_factory=list)
    # steps since the worker started, per STEP_BUCKETS bucket (not cumulative), + 1 more
    step_counts: list[int] = field(default_factory=list)
    step_sum: float = 0.0    # seconds of all those steps
    rss: int = 0             # the worker process's resident bytes: its real use of host memory


HEARTBEAT_S = 0.5
HEARTBEAT_SUFFIX = b"~hb"    # identity of a worker's heartbeat socket: its own + this


@dataclass(slots=True)
class Loaded:
    """A model replica is resident and warm: ready for requests."""

    model_id: str
    name: str
    slots: int
    ctx: int
    vocab_size: int
    weight_bytes: int
    kv_bytes: int
    load_s: float
    spec: str = ""           # the speculation it runs ("" none: off, or refused by its layers)
    activations: str = ""    # what its CPU products take: int8 or int16 ("": a GPU die's own)
    link: str = bounded(lim.MAX_TEXT_CHARS, default="")   # a split replica's stage 1: the
    # address its stage link bound (ipc:// or tcp://), which stage 0 connects to


@dataclass(slots=True)
class LoadProgress:
    """A load under way: `done` of `total` layers are on the die (worker → frontend, and
    frontend → an admin client while its load command runs)."""

    model_id: str
    done: int
    total: int


BAD_MODEL_FILE = "bad_model_file"
OUT_OF_MEMORY = "out_of_memory"
STAGE_LINK = "stage_link"    # a split replica's stage link could not be set up (port, keys)


@dataclass(slots=True)
class LoadFailed:
    model_id: str
    message: str
    code: str = ""       # BAD_MODEL_FILE: the file cannot serve (400); OUT_OF_MEMORY: the die's memory ran out (507)


@dataclass(slots=True)
class Unloaded:
    model_id: str


@dataclass(slots=True)
class Tokens:
    """New token ids of one request; `finish` is set on its last message."""

    request_id: str
    tokens: list[int]
    finish: str | None = None        # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # per token when asked: [logprob, [[token id, logprob], ... top N]]
    logprobs: list[list[object]] = field(default_factory=list)
    # an embedding request's pooled hidden state, d_model values (the link carries no
    # raw binary: msgpack floats)
    embedding: list[float] = field(default_factory=list)
    # speculation in the step(s) this message reports: tokens proposed and verified, and of
    # those the ones accepted (the rest were rejected and rolled back)
    proposed: int = 0
    accepted: int = 0


@dataclass(slots=True)
class Accepted:
    """A Generate was taken (answered at once, before any token): the frontend's deadline
    for a first answer stops. A refused one is answered with an Error instead."""

    request_id: str = bounded(lim.MAX_ID_CHARS)


@dataclass(slots=True)
class Outputs:
    """Every request's new tokens from one worker step, in one message (vLLM's
    EngineCoreOutputs): the frontend decodes one message per step, not one per request."""

    outputs: list[Tokens]


@dataclass(slots=True)
class Error:
    """A message could not be handled; `request_id` when it concerned one."""

    message: str
    code: str = "bad_message"
    request_id: str | None = None


@dataclass(slots=True)
class Stopping:
    """The worker is shutting down cleanly."""

    die: str


# -- frontend → worker ------------------------------------------------------------

@dataclass(slots=True)
class Speculation:
    """A replica's speculative decoding (worker/spec.py): `kind` "" (none) or "ngram"
    (prompt lookup) or "draft" (a small model's greedy tokens, `draft` its path), the
    longest n-gram matched `n`, the longest proposal `k` (1-16)."""

    kind: str = bounded(16, default="")
    n: int = 3
    k: int = 8
    draft: str = bounded(lim.MAX_TEXT_CHARS, default="")   # kind "draft": its model's path


@dataclass(slots=True)
class Stage:
    """One stage of a replica split across two dies (worker/stage_link.py): layers
    [first_layer, end_layer) of the stack. Stage 0 (the embedding, the scheduler, sampling)
    connects to `link`; stage 1 (the last layers and the head) binds it. Stage 1's `link`
    is what to bind: "ipc" (a private folder of its own), "tcp" (its worker's
    `--stage-bind` address) or a whole address; its Loaded says the address it bound,
    which stage 0's `link` then names. CURVE when `server_key` is set (z85 public keys,
    never a secret: each worker serves or dials with its own pair): `server_key` is stage
    1's worker's key, `client_key` stage 0's, the one key stage 1 lets in."""

    index: int
    first_layer: int
    end_layer: int
    link: str = bounded(lim.MAX_TEXT_CHARS, default="")
    server_key: str = bounded(64, default="")
    client_key: str = bounded(64, default="")


@dataclass(slots=True)
class Load:
    model_id: str            # the replica's id, unique in the fleet
    path: str
    name: str
    slots: int = 0           # 0: the worker's default
    ctx: int = 0             # 0: the model's trained context, capped by the worker
    prefill_chunk: int = PREFILL_CHUNK
    quantize: str = "auto"   # common/weight_format.QUANTIZE_MODES
    spec: Speculation | None = None   # None: none
    activations: str = "auto"  # the CPU products' activations: common/settings.ACTIVATIONS
    stage: Stage | None = None        # None: the whole model on this die
    kv_cache_k: str = ""     # common/kv_cache.KV_TYPE_NAMES; "": the worker's default
    kv_cache_v: str = ""


@dataclass(slots=True)
class Unload:
    model_id: str


SEED_LIMIT = 2**63 - 1

# The one table of sampling ranges: the HTTP edge validates a request against it (its
# error messages use `what`), the worker checks what arrives against it again.
# field: (integers only, accepts the value, what it must be). Booleans are never numbers.
SAMPLING_RANGES = {
    "temperature": (False, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
    "top_p": (False, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (True, lambda v: v >= -1, "an integer >= -1 (0 or -1 = off)"),
    "min_p": (False, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "presence_penalty": (False, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (False, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (False, lambda v: 0 < v <= 10, "a number in (0, 10]"),
    "seed": (True, lambda v: abs(v) <= SEED_LIMIT,
             f"an integer with absolute value <= {SEED_LIMIT}"),
    "repeat_last_n": (True, lambda v: v >= 0, "an integer >= 0"),
}


@dataclass(slots=True)
class Sampling:
    """One request's sampling settings: the only declaration of them. The HTTP edge
    builds it (openai_api), the wire carries it, the worker's sampler reads it."""

    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = bounded(lim.MAX_LOGIT_BIAS, default_factory=dict)
    seed: int | None = None
    repeat_last_n: int = 64       # tokens the repetition penalty looks back on

    def check(self, vocab_size: int) -> "Sampling":
        """Itself, if every field is in SAMPLING_RANGES and the biased ids are in the
        vocabulary; ValueError naming the first field that is not."""
        for name, (_, ok, what) in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise ValueError(f"{name} must be {what}, got {value!r}")
        if not all(0 <= int(t) < vocab_size for t in self.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        return self


@dataclass(slots=True)
class Generate:
    request_id: str = bounded(lim.MAX_ID_CHARS)
    model_id: str = bounded(lim.MAX_ID_CHARS)
    prompt: list[int] = bounded(lim.MAX_PROMPT_TOKENS)
    sampling: Sampling = field()
    max_tokens: int = field()
    stop_ids: list[int] = bounded(lim.MAX_STOP_IDS, default_factory=list)
    session_id: str | None = bounded(lim.MAX_SESSION_ID_CHARS, default=None)
    # llguidance grammar the output must follow
    grammar: str | None = bounded(lim.MAX_GRAMMAR_CHARS, default=None)
    logprobs: int = -1               # -1: none; N >= 0: the chosen token's and the top N
    # the client's request id (X-Request-Id), for logs
    trace: str = bounded(lim.MAX_ID_CHARS, default="")
    # prefix-cache scope: a warm state (slot or host cache) serves only requests with the
    # same salt, sessions included. The frontend derives it from the caller's API key and
    # the request's `cache_salt`, so no client learns from another's cached_tokens.
    cache_salt: str = bounded(lim.MAX_ID_CHARS, default="")
    # "": generate; "mean" / "last": an embedding (the prompt's final hidden states
    # pooled, sent back in Tokens.embedding), prefilled with no decode
    pooling: str = bounded(8, default="")
    # a predicted output (OpenAI's `prediction`), as token ids: seeds speculation's proposals
    prediction: list[int] = bounded(lim.MAX_PROMPT_TOKENS, default_factory=list)


@dataclass(slots=True)
class Abort:
    request_id: str = bounded(lim.MAX_ID_CHARS)


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class Ping:
    """A probe of the link: a dropped connection fails to take it; sent to a worker's
    heartbeat socket, it is answered at once with a heartbeat (a live process answers,
    a hung one cannot)."""


# -- ops script → frontend admin socket, and back ----------------------------------

@dataclass(slots=True)
class AdminRequest:
    """A command. The admin token travels in a frame of its own before this message,
    compared before this one is decoded (frontend/admin.AdminSocket); `token` is read only
    from a one-frame request (older clients), which a server with a token refuses unread."""

    cmd: str = bounded(64)                     # load | unload | dies | models | status
    args: dict[str, object] = field(default_factory=dict)
    token: str = ""


@dataclass(slots=True)
class AdminReply:
    """The final answer: an HTTP-like status and the same JSON body as the HTTP route."""

    status: int
    body: dict[str, object] = field(default_factory=dict)


MESSAGES: dict[str, type] = {
    "hello": Hello, "heartbeat": Heartbeat, "loaded": Loaded, "load_failed": LoadFailed,
    "load_progress": LoadProgress,
    "unloaded": Unloaded, "tokens": Tokens, "outputs": Outputs, "error": Error,
    "accepted": Accepted,
    "stopping": Stopping,
    "load": Load, "unload": Unload, "generate": Generate, "abort": Abort, "shutdown": Shutdown,
    "ping": Ping,
    "admin_request": AdminRequest, "admin_reply": AdminReply,
}
KIND_OF = {cls: kind for kind, cls in MESSAGES.items()}
NESTED = {Sampling, Resident, Tokens, ReplicaLoad, Speculation, Stage}


def encode(msg) -> bytes:
    """The message's bytes; ProtocolError for one its peer's decoder would refuse (a field
    past its limit, a value msgpack cannot carry, more than MAX_MESSAGE_BYTES)."""
    kind = KIND_OF.get(type(msg))
    if kind is None:
        raise TypeError(f"{type(msg).__name__} is not a protocol message")
    if (found := oversized(msg)) is not None:
        raise ProtocolError(found[1])
    body = {"v": PROTOCOL, "k": kind}
    body.update(as_map(msg))
    try:
        data = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:   # an int past 64 bits, ...
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{type(msg).__name__} of {len(data)} bytes exceeds "
                            f"{MAX_MESSAGE_BYTES}")
    return data


@functools.lru_cache(maxsize=None)
def limits_of(cls) -> tuple[tuple[str, int], ...]:
    return tuple((f.name, f.metadata["max"]) for f in dataclasses.fields(cls)
                 if "max" in f.metadata)


def oversized(msg) -> tuple[str, str] | None:
    """(field, why) for the first field of `msg`, or of a message nested in it, past its
    limit (`bounded`); None when every one fits. The frontend asks this of each Generate
    before sending it, the decoder of each message it builds: the same table both ways."""
    for name, most in limits_of(type(msg)):
        value = getattr(msg, name)
        if value is not None and len(value) > most:
            what = "characters" if isinstance(value, str) else "entries"
            return name, f"{name} has {len(value)} {what}, more than the {most} allowed"
    for name in field_names(type(msg)):
        value = getattr(msg, name)
        if type(value) in NESTED and (found := oversized(value)) is not None:
            return found
    return None


@functools.lru_cache(maxsize=None)
def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def as_map(msg) -> dict:
    return {name: plain(getattr(msg, name)) for name in field_names(type(msg))}


def plain(value):
    """A field's value as msgpack takes it: nested messages become maps."""
    if type(value) in NESTED:
        return as_map(value)
    if type(value) is list and value and type(value[0]) in NESTED:
        return [as_map(v) for v in value]
    return value


class TooMany(ValueError):
    """More containers than a message may hold (raised inside msgpack's hooks)."""


def unpack(data: bytes, limits: lim.DecodeLimits = lim.LINK):
    """msgpack → Python within `limits`: every length is checked as its header is read,
    and the count of arrays and maps is bounded (msgpack has no such bound of its own:
    a message of empty maps costs ~64 bytes of memory per byte on the wire)."""
    if len(data) > limits.max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {limits.max_bytes}")
    left = [limits.max_containers]

    def count(container):
        left[0] -= 1
        if left[0] < 0:
            raise TooMany(f"more than {limits.max_containers} arrays and maps")
        return container
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=0,
                               max_ext_len=0, max_str_len=limits.max_str,
                               max_map_len=limits.max_map, max_array_len=limits.max_array,
                               object_hook=count, list_hook=count)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {str(exc)[:200]}") from None
    if limits.max_depth and nesting(body) > limits.max_depth:
        raise ProtocolError(f"a message may nest at most {limits.max_depth} levels")
    return body


def nesting(value) -> int:
    """Depth of nested lists and dicts, without recursion (a scalar: 0); its cost is
    bounded by the containers the decoder let through."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node if isinstance(child, (list, dict)))
    return deepest


def decode(data: bytes, limits: lim.DecodeLimits = lim.LINK):
    """A validated message object from untrusted bytes; ProtocolError otherwise."""
    body = unpack(data, limits)
    if not isinstance(body, dict):
        raise ProtocolError("a message must be a map")
    if body.get("v") != PROTOCOL:
        raise ProtocolError(f"protocol version {str(body.get('v'))[:20]!r}, expected {PROTOCOL}")
    cls = MESSAGES.get(body.get("k")) if isinstance(body.get("k"), str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {str(body.get('k'))[:40]!r}")
    msg = build(cls, body)
    if (found := oversized(msg)) is not None:
        raise ProtocolError(f"{cls.__name__}.{found[1]}")
    return msg


def peek_request_id(data: bytes) -> str | None:
    """The `request_id` of a message that failed to decode, if one can be read cheaply and
    safely (so its sender learns which request was refused): the top-level map's keys are
    read one by one and every other value skipped unbuilt."""
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    reader = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1),
                              max_str_len=4 * lim.MAX_ID_CHARS, max_bin_len=0, max_ext_len=0,
                              max_array_len=0, max_map_len=0)
    try:
        reader.feed(data)
        for _ in range(min(reader.read_map_header(), 64)):
            key = reader.unpack()
            if key != "request_id":
                reader.skip()
                continue
            value = reader.unpack()
            return value if isinstance(value, str) and len(value) <= lim.MAX_ID_CHARS \
                else None
    except Exception:  # anything unreadable: no id
        return None
    return None


def build(cls, body: dict):
    return builder(cls)(body)


@functools.lru_cache(maxsize=None)
def builder(cls):
    """A function body → validated `cls`, planned once per class: its fields' type hints
    are resolved and turned into checkers here, not per message (typing.get_type_hints
    costs ~190 us, on the frontend's only event loop)."""
    hints = typing.get_type_hints(cls)
    plan = tuple((f.name, checker(hints[f.name], f"{cls.__name__}.{f.name}"),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))

    def build_one(body: dict):
        kwargs = {}
        for name, check_value, required in plan:
            if name in body:
                kwargs[name] = check_value(body[name])
            elif required:
                raise ProtocolError(f"{cls.__name__} lacks field {name!r}")
        return cls(**kwargs)
    return build_one


def checker(hint, where: str):
    """A function returning its value if it matches the annotation `hint` (recursively),
    else raising ProtocolError naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)

    def refuse(value):
        raise ProtocolError(f"{where}: expected {getattr(hint, '__name__', hint)}, "
                            f"got {type(value).__name__}")
    if origin in (typing.Union, types.UnionType):
        options = [checker(option, where) for option in args]

        def union(value):
            for option in options:
                try:
                    return option(value)
                except ProtocolError:
                    pass
            raise ProtocolError(f"{where}: unexpected {type(value).__name__}")
        return union
    if hint is type(None):
        return lambda value: None if value is None else refuse(value)
    if hint in NESTED:
        return lambda value: builder(hint)(value) if isinstance(value, dict) else refuse(value)
    if origin is list:
        item = checker(args[0], where)
        if args[0] is int:           # token ids: the hot case, one type test per element
            def ints(value):
                if type(value) is not list:
                    refuse(value)
                for v in value:
                    if type(v) is not int:
                        raise ProtocolError(f"{where}: expected int, got {type(v).__name__}")
                return value
            return ints
        return lambda value: [item(v) for v in value] if isinstance(value, list) \
            else refuse(value)
    if origin is dict:
        key, val = checker(args[0], where), checker(args[1], where)
        return lambda value: {key(k): val(v) for k, v in value.items()} \
            if isinstance(value, dict) else refuse(value)
    if hint is float:
        return lambda value: float(value) if isinstance(value, (int, float)) \
            and not isinstance(value, bool) else refuse(value)
    if hint is int:
        return lambda value: value if isinstance(value, int) \
            and not isinstance(value, bool) else refuse(value)
    return lambda value: value if isinstance(value, hint) else refuse(value)
