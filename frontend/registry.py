"""Served models and their replicas on workers (router.py picks one per request).

A *served model* is a name clients use; it has a tokenizer and a chat
template (read from the model file, without weights) and one or more
*replicas*, each a copy resident on one worker's die. The registry also
keeps the desired placement: a replica that was on a die whose worker went
away is loaded again when a worker for that die comes back.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..common import settings
from ..common.chat_template import ChatTemplate
from ..common.kv_cache import KVCacheTypes
from ..common.model_file import ModelConfig, ModelFileError, check_tensors, read_config
from ..common.weight_format import READABLE, tensor_list, unreadable
from ..common.tokenizer import Tokenizer, open_tokenizer
from .errors import APIError

log = logging.getLogger("pantheon.frontend.registry")


MAX_ENTRIES = settings.MAX_MODELS   # resident replicas, all models (the spec's MR_MAX_MODELS)


class ReplicaState:
    PLACED = "placed"        # assigned to a die, not (yet) loaded there
    LOADING = "loading"      # weights on their way to the die
    READY = "ready"          # takes requests
    UNLOADING = "unloading"  # takes no new requests; draining, then gone
    FAILED = "failed"        # the load failed; `error` says why


class Change:
    """A moment anyone may wait for: `fire()` wakes every waiter of the moment, and each
    later waiter waits for the next one. A waiter takes `event` *before* it looks at the
    state it waits on, then waits on that event: a change between the look and the wait
    has set it already, so none is missed (only the event loop fires and waits)."""

    def __init__(self):
        self.event = asyncio.Event()

    def fire(self) -> None:
        self.event.set()
        self.event = asyncio.Event()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> bool:
        """True when `event` fired within `timeout_s` seconds."""
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
            return True
        except asyncio.TimeoutError:
            return False


def idle_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass
class Replica:
    model_id: str
    die: str
    state: str = ReplicaState.PLACED
    inflight: int = 0
    slots: int = 0                 # as loaded (the worker's answer)
    ctx: int = 0
    error: str = ""
    error_code: str = ""           # protocol.BAD_MODEL_FILE / OUT_OF_MEMORY: why a load failed
    worker: object = None          # WorkerInfo while loaded
    want_slots: int = 0            # as asked (0: the server's default)
    want_ctx: int = 0
    want_quantize: str = ""        # "" : the server's --quantize
    want_activations: str = ""     # "" : the server's --activations
    want_kv: KVCacheTypes = KVCacheTypes()   # "" halves: the server's --kv-cache
    want_spec: object = None       # protocol.Speculation (kind "": none); None: the server's
    spec: str = ""                 # the speculation its worker runs (as loaded)
    activations: str = ""          # what its CPU products take, as loaded (int8, int16)
    reserved: int = 0              # bytes admitted on its die
    weight_bytes: int = 0          # of which its weights (the worker's figure, once loaded)
    progress: tuple[int, int] = (0, 0)
    served: int = 0                # requests routed here, for the record
    loads: int = 0                 # uploads that completed (a kept replica adds none)
    path: str = ""                 # its own file (a copy of the model's); "": the model's
    last_used: float = 0.0         # monotonic time a request last took or left a slot
    reason: str = "start"          # why it was loaded: start, request, admin (autoload.py)
    stages: list | None = None     # split across two dies: split_placement.StagePlan each
    want_dies: list | None = None  # serve --model-dies: the two dies to split it across
    want_link: str = ""            # a split's stage link: "ipc", "tcp"; "": by the hosts
    placement: str = ""            # why it was placed so (an automatic split says why)
    idle: asyncio.Event = field(default_factory=lambda: idle_event(), repr=False,
                                compare=False)   # set while nothing is in flight


    def as_json(self) -> dict:
        return {"id": self.model_id, "die": self.die, "state": self.state,
                "in_flight": self.inflight, "served": self.served, "loads": self.loads,
                "slots": self.slots,
                "ctx": self.ctx, "reserved_bytes": self.reserved,
                "progress": {"done": self.progress[0], "total": self.progress[1]},
                "error": self.error or None, "spec": self.spec or None,
                "activations": self.activations or None,
                **({"stages": [s.as_json() for s in self.stages]} if self.stages else {}),
                **({"placement": self.placement} if self.placement else {})}


@dataclass
class ServedModel:
    name: str
    path: str
    config: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate
    created: int
    replicas: list[Replica] = field(default_factory=list)

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == ReplicaState.READY]

    def context(self) -> int:
        """Context positions a request may use: the largest of the ready replicas' (the
        router sends a request only to a replica whose context holds it)."""
        return max((r.ctx for r in self.ready()), default=0)

    def render_text(self, messages: list[dict], tools=None, prefill: str | None = None,
                    args: dict | None = None) -> str:
        """The chat template's prompt text (CPU work: call off the event loop); `prefill`
        the reply's start, to be continued; `args` reach the template as variables, those
        it reads (enable_thinking, reasoning_effort...)."""
        extra = {k: v for k, v in (args or {}).items() if self.template.reads(k)}
        return self.template.render(messages, tools=tools, add_generation_prompt=True,
                                    prefill=prefill, **extra)


def open_model(path: str, name: str | None, created: int) -> ServedModel:
    """Read a model's metadata and tokenizer (no weights); raises on a bad file."""
    config = read_config(path)
    check_tensors(config, tensor_list(path))
    bad = unreadable(path)
    if bad is not None:
        raise ModelFileError(f"tensor {bad[0]} has type {bad[1]}, which Pantheon cannot load; "
                             f"supported: {', '.join(sorted(READABLE))}")
    tokenizer = open_tokenizer(path)
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_text, tokenizer.eos_text,
                            tokenizer.control_texts)
    return ServedModel(name or Path(path).stem, str(path), config, tokenizer, template, created)


HEAD_BYTES = 4 << 20      # a GGUF's header, metadata and tensor table, and more


@functools.lru_cache(maxsize=64)
def _fingerprint(path: str, stamp: tuple) -> tuple[int, str]:
    """(bytes, sha256 of the head of every file) of a model file or folder."""
    root = Path(path)
    files = sorted(f for f in root.iterdir() if f.is_file()) if root.is_dir() else [root]
    digest, size = hashlib.sha256(), 0
    for f in files:
        n = f.stat().st_size
        size += n
        digest.update(f"{f.name if root.is_dir() else ''}:{n}:".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(HEAD_BYTES))
    return size, digest.hexdigest()


def fingerprint(path: str) -> tuple[int, str]:
    real = Path(path).resolve()
    st = real.stat()
    return _fingerprint(str(real), (st.st_size, st.st_mtime_ns))


def same_model(a: str, b: str) -> str | None:
    """None when the two paths hold the same model: the same file (through a symlink, or
    the same resolved path), or files of the same size whose heads (header, metadata,
    tensor table, first tensors) are byte-identical; else what differs."""
    try:
        if Path(a).resolve() == Path(b).resolve():
            return None
        (size_a, head_a), (size_b, head_b) = fingerprint(a), fingerprint(b)
    except OSError as exc:
        return f"cannot read it: {exc}"
    if size_a != size_b:
        return f"{size_b:,} bytes against {size_a:,}"
    if head_a != head_b:
        return "the same size, but different header or tensor data"
    return None


class Registry:
    def __init__(self):
        self.models: dict[str, ServedModel] = {}
        self.ids = itertools.count(1)
        self.autoload = None       # autoload.AutoLoader: the catalog, loads on request
        self.change = Change()     # fired when a replica is ready, failed or gone, and when
                                   # a request lets go of a model (what load waiters wait on)

    async def want(self, name: str | None, keep_alive: float | None = None) -> ServedModel:
        """resolve(), loading a catalog model first when the server has an AutoLoader."""
        if self.autoload is not None:
            return await self.autoload.resolve(name, keep_alive)
        return self.resolve(name)

    def shown_name(self, asked: str | None, model: ServedModel) -> str:
        """The `model` a reply shows: the name the client asked by when it names this
        model (its own name, or a catalog alias of it), as Ollama and llama-swap echo it;
        else (no name, or the single-model shortcut's other name) the model's own."""
        if not asked or asked == model.name:
            return model.name
        entry = self.autoload.catalog.lookup(asked) if self.autoload is not None else None
        return asked if entry is not None and entry.name == model.name else model.name

    def add(self, model: ServedModel, die: str | None) -> Replica:
        """A new replica of `model` (a new served name, or one more copy of it, whose file
        may be another path to the same model: see same_model)."""
        served = self.models.setdefault(model.name, model)
        replica = Replica(f"{model.name}#{next(self.ids)}", die,
                          path="" if served is model else model.path)
        served.replicas.append(replica)
        return replica

    def remove(self, model: ServedModel, replica: Replica) -> None:
        if replica in model.replicas:
            model.replicas.remove(replica)
        if not model.replicas:
            self.models.pop(model.name, None)
        self.change.fire()

    def count(self) -> int:
        return sum(len(m.replicas) for m in self.models.values())

    def replicas(self):
        for model in self.models.values():
            for replica in model.replicas:
                yield model, replica

    def ready_models(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.ready()]

    def resolve(self, name: str | None) -> ServedModel:
        """The served model a request names (404 unknown, 503 none ready).

        With one resident model, every request goes to it whatever its `model`
        field says (the spec's single-model shortcut); with several, the name
        is required (400 without one) and must match exactly.
        """
        ready = self.ready_models()
        if not ready:
            raise APIError(503, "no model is loaded and ready yet; retry shortly",
                           type="service_unavailable", code="model_not_ready",
                           headers={"Retry-After": "2"})
        if len(self.models) == 1:
            return ready[0]
        if not name:
            raise APIError(400, f"model is required: this server serves several models "
                           f"({', '.join(sorted(self.models))})", param="model",
                           code="model_required")
        model = self.models.get(name)
        if model is None:
            raise APIError(404, f"model {name!r} does not exist; available: "
                           f"{', '.join(sorted(self.models))}", param="model",
                           code="model_not_found")
        if not model.ready():
            raise APIError(503, f"model {name!r} is not ready yet; retry shortly",
                           type="service_unavailable", code="model_not_ready",
                           headers={"Retry-After": "2"})
        return model
