"""The admin API: load, unload, dies, models, status — over HTTP and ZeroMQ.

One set of handlers answers both transports with the same codes, as the
spec's `status_for_reason`: admission failure or a full table → 507, a
duplicate load in progress or an unload under way → 409, not found → 404,
a malformed request → 400, anything else → 500. Every error body is an
OpenAI-style error object.

A load runs the spec's four phases: reserve the name, place and admit
(before any byte is uploaded), upload (one at a time across the fleet, in
the worker's loader thread, so everything else keeps answering), publish.
An unload stops new requests at once, lets in-flight ones drain up to a
deadline, then aborts the rest with a clear error: never an unbounded wait.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path

import zmq
import zmq.asyncio

from ..common import limits as wire
from ..common import protocol as p
from ..common import settings, speculation
from ..common.key_set import KeySet
from ..common.kv_cache import KV_TYPE_NAMES, KV_TYPES, KVCacheTypes
from ..common.keys import KeyPair, curve_server
from ..common.model_file import ModelFileError
from ..common.weight_format import QUANTIZE_MODES, weight_bytes
from .admission import Admission
from .model_policy import Want
from . import split_placement
from .dies import DieTable, PlacementError
from .placement import Placer
from .registry import MAX_ENTRIES, Registry, ReplicaState, open_model, same_model
from .security import ModelDirs
from .workers import WorkerLost, WorkerPool

log = logging.getLogger("pantheon.frontend.admin")

ERROR_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
               409: "conflict_error", 507: "insufficient_storage", 500: "server_error",
               401: "authentication_error", 503: "service_unavailable"}



def kv_cache_field(body: dict) -> KVCacheTypes:
    """The load body's KV types: "kv_cache" for keys and values, "kv_cache_k" /
    "kv_cache_v" for one of them; absent or "": the server's --kv-cache."""
    values = {}
    for name in ("kv_cache", "kv_cache_k", "kv_cache_v"):
        value = body.get(name)
        if value is not None and value != "" and (not isinstance(value, str)
                                                 or value.strip().lower() not in KV_TYPES):
            raise AdminError(400, f"{name} must be one of {', '.join(KV_TYPE_NAMES)}, "
                                  f"not {value!r}", name)
        values[name] = value or None
    return KVCacheTypes.of(values["kv_cache"], values["kv_cache_k"], values["kv_cache_v"])

class AdminError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def field(body: dict, name: str, kind, default=None, required=False):
    value = body.get(name, default)
    if value is None:
        if required:
            raise AdminError(400, f"'{name}' is required", name)
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise AdminError(400, f"'{name}' must be {getattr(kind, '__name__', kind)}", name)
    return value


def action_record(cmd: str, args, status: int, body: dict) -> dict:
    """A load or unload as the dashboard lists it: what was asked, and how it ended."""
    args = args if isinstance(args, dict) else {}
    target = {k: str(args[k])[:200] for k in ("name", "id", "path", "die") if args.get(k)}
    if isinstance(args.get("dies"), list):
        target["die"] = ",".join(str(d) for d in args["dies"])[:200]
    error = body.get("error") if isinstance(body, dict) else None
    return {"time": time.time(), "action": cmd, **target, "status": status,
            "error": str(error.get("message", ""))[:300] if isinstance(error, dict) else None}


class Admin:
    def __init__(self, registry: Registry, pool: WorkerPool, placer: Placer, dies: DieTable,
                 admission: Admission, max_entries: int = MAX_ENTRIES,
                 model_dirs: ModelDirs | None = None, metrics=None):
        self.registry, self.pool, self.placer = registry, pool, placer
        self.metrics = metrics                  # metrics.Metrics: unloads
        self.die_table, self.admission, self.max_entries = dies, admission, max_entries
        self.model_dirs = model_dirs          # None: any path (only tests build it so)
        self.autoload = None                  # autoload.AutoLoader, told of admin loads
        self.loading: set[str] = set()
        self.load_tasks: set[asyncio.Task] = set()
        self.actions: deque = deque(maxlen=20)  # the last loads and unloads, for the dashboard
        self.draining = False

    def drain(self) -> None:
        """The server is shutting down: refuse new loads, cancel those under way."""
        self.draining = True
        for task in list(self.load_tasks):
            task.cancel()

    async def call(self, cmd: str, args: dict, on_progress=None) -> tuple[int, dict]:
        """Run one command; (status, JSON body), errors included."""
        handlers = {"load": self.load, "unload": self.unload, "dies": self.dies,
                    "models": self.models, "status": self.status, "top": self.top,
                    "rescan": self.rescan}
        if cmd not in handlers:
            return 400, AdminError(400, f"unknown command {cmd!r}; one of "
                                        f"{', '.join(handlers)}").body()
        status, body = await self.run(cmd, handlers[cmd], args, on_progress)
        if cmd in ("load", "unload"):
            self.actions.append(action_record(cmd, args, status, body))
        return status, body

    async def run(self, cmd: str, handler, args: dict, on_progress) -> tuple[int, dict]:
        try:
            if cmd == "load":
                return 200, await self.load(args, on_progress)
            result = handler(args)
            return 200, (await result) if asyncio.iscoroutine(result) else result
        except AdminError as exc:
            return exc.status, exc.body()
        except Exception as exc:  # one failed command must not hurt the server
            log.exception("admin %s failed", cmd)
            return 500, AdminError(500, f"{cmd} failed: {exc}").body()

    # -- reads -------------------------------------------------------------------------
    def dies(self, args=None) -> dict:
        return {"dies": [d.as_json() for d in self.die_table.snapshot()]}

    def models(self, args=None) -> dict:
        out = []
        for model in self.registry.models.values():
            for r in model.replicas:
                if r.state == ReplicaState.LOADING:
                    r.progress = self.pool.progress.get(r.model_id, r.progress)
            out.append({"name": model.name, "path": model.path, "queued":
                        self.admission.queued(model),
                        "replicas": [r.as_json() for r in model.replicas]})
        return {"models": out, "loading": sorted(self.loading)}

    def status(self, args=None) -> dict:
        return {"service": "pantheon", "models": len(self.registry.models),
                "replicas": self.registry.count(), "max_replicas": self.max_entries,
                "ready": [m.name for m in self.registry.ready_models()],
                "workers": len(self.pool.live()), "loading": sorted(self.loading)}

    def top(self, args=None) -> dict:
        """What `pantheon admin top` shows: dies, and per model slots, queue, tok/s and
        TTFT over the last minute (from heartbeats and the frontend's own counts)."""
        now = time.monotonic()
        loads = {x.model_id: x for w in self.pool.live() if w.heartbeat
                 for x in w.heartbeat.replicas}
        dies = []
        for d in self.die_table.snapshot():
            held = [r for _, r in self.registry.replicas()
                    if r.die == d.die and r.state == ReplicaState.READY]
            dies.append({"die": d.die, "state": d.worker["state"], "pid": d.worker["pid"],
                         "busy": sum(loads[r.model_id].busy for r in held
                                     if r.model_id in loads),
                         "slots": sum(r.slots for r in held),
                         "used_bytes": d.reserved, "budget_bytes": d.budget,
                         "step_s": d.worker["step_s"]})
        models = []
        waiting = self.autoload.waiting if self.autoload is not None else {}
        for model in self.registry.models.values():
            ready = model.ready()
            window = self.metrics.window.summary(model.name, now) if self.metrics else {}
            models.append({"name": model.name, "replicas": len(ready),
                           "replicas_total": len(model.replicas),
                           "busy": sum(loads[r.model_id].busy for r in ready
                                       if r.model_id in loads),
                           "slots": sum(r.slots for r in ready),
                           "running": sum(r.inflight for r in model.replicas),
                           "queued": self.admission.queued(model) + waiting.get(model.name, 0),
                           **window})
        out = {"dies": dies, "models": models, "draining": self.draining}
        if self.autoload is not None:          # loads and unloads by reason, since the start
            out["lifecycle"] = self.autoload.summary()
        return out

    async def rescan(self, args=None) -> dict:
        """Scan the --model-dir folders again (a file added or removed since the start)."""
        if self.autoload is None:
            raise AdminError(400, "this server has no model catalog")
        return await self.autoload.rescan()

    # -- load --------------------------------------------------------------------------
    async def load(self, body: dict, on_progress=None, trusted: bool = False,
                   reason: str = "admin") -> dict:
        """`trusted`: a catalog model the autoloader loads (its folders, not --model-dir's
        rule, say what it may open); `reason` goes to the log and the load metrics."""
        path = field(body, "path", str, required=True)
        pin = field(body, "pin", bool, False)
        evict = field(body, "evict", bool, True)
        if not Path(path).is_absolute():       # the server's folder is not the caller's
            raise AdminError(400, f"model path must be absolute, got {path!r}", "path")
        if not trusted and self.model_dirs is not None and not self.model_dirs.allows(path):
            # the same answer whether the path exists or not: no probing of the host
            raise AdminError(403, "model path is outside the folders loads may open "
                                  "(--model-dir)", "path")
        name = field(body, "name", str) or Path(path).stem
        dies = field(body, "dies", list)
        split = field(body, "split", list)
        link = field(body, "link", str) or ""
        if link not in ("", "auto", "ipc", "tcp"):
            raise AdminError(400, f"link must be auto, ipc or tcp, not {link!r}", "link")
        if link not in ("", "auto") and (dies is None or len(dies) != 2):
            raise AdminError(400, "link names a split's stage link: give \"dies\": [a, b]",
                             "link")
        ctx, slots = field(body, "ctx", int, 0), field(body, "slots", int, 0)
        quantize = body.get("quantize") or ""
        if quantize is True:                           # the spec's boolean: true = q8_0
            quantize = "q8_0"
        if not isinstance(quantize, str) or quantize and quantize not in QUANTIZE_MODES:
            raise AdminError(400, f"quantize must be one of {', '.join(QUANTIZE_MODES)}, "
                                  f"not {quantize!r}", "quantize")
        kv = kv_cache_field(body)
        if ctx < 0 or slots < 0:
            raise AdminError(400, "ctx and slots must be >= 0")
        activations = body.get("activations") or ""
        if not isinstance(activations, str) or activations and \
                activations not in settings.ACTIVATIONS:
            raise AdminError(400, f"activations must be one of "
                                  f"{', '.join(settings.ACTIVATIONS)}, not {activations!r}",
                             "activations")
        spec = None
        if "spec" in body:                             # absent: the server's --spec
            try:
                spec = speculation.parse(body["spec"]) or p.Speculation("")
            except ValueError as exc:
                field_name = str(exc).split(" ", 1)[0]
                raise AdminError(400, str(exc), field_name if field_name.startswith("spec")
                                 else "spec") from None
            if spec.draft:
                if not Path(spec.draft).is_absolute():
                    raise AdminError(400, f"spec.draft must be an absolute path, got "
                                          f"{spec.draft!r}", "spec.draft")
                if self.model_dirs is not None and not self.model_dirs.allows(spec.draft):
                    raise AdminError(403, "spec.draft is outside the folders loads may open "
                                          "(--model-dir)", "spec.draft")
                if not Path(spec.draft).exists():
                    raise AdminError(404, f"draft model not found: {spec.draft}", "spec.draft")
        if dies is not None:
            dies = [str(d) for d in dies]
        # phase 1: reserve the name
        if name in self.loading:
            raise AdminError(409, f"a load of {name!r} is already in progress")
        existing = self.registry.models.get(name)
        if existing and any(r.state == ReplicaState.UNLOADING for r in existing.replicas):
            raise AdminError(409, f"{name!r} is being unloaded; retry when it is gone")
        if self.registry.count() + len(self.loading) >= self.max_entries:
            raise AdminError(507, f"the model table is full ({self.max_entries} replicas); "
                                  "unload one first")
        if self.draining:
            raise AdminError(503, "the server is shutting down: no new loads")
        self.loading.add(name)

        def upload():
            return self.place_and_upload(path, name, dies, ctx, slots, on_progress, quantize,
                                         reason, spec, split=split, activations=activations,
                                         link=link, kv=kv)
        one_die = split is None and (dies is None or len(dies) == 1)
        # a request's load makes room itself (it holds the autoloader's room already)
        if self.autoload is not None and reason == "admin" and one_die:
            want = Want(name=name, path=path, dies=dies, slots=slots, ctx=ctx,
                        quantize=quantize, kv=kv)
            task = asyncio.ensure_future(self.upload_evicting(want, upload) if evict
                                         else self.upload_saying_what_could_go(want, upload))
        else:
            task = asyncio.ensure_future(upload())
        self.load_tasks.add(task)
        try:
            loaded = await task
            if self.autoload is not None and reason == "admin":
                self.autoload.admin_loaded(name, path, pin)
            return loaded
        except asyncio.CancelledError:
            if self.draining and task.cancelled():
                raise AdminError(503, f"the load of {name!r} was cancelled: the server is "
                                      "shutting down") from None
            raise
        finally:
            self.load_tasks.discard(task)
            self.loading.discard(name)
            self.registry.change.fire()             # its end: load waiters look again

    async def upload_saying_what_could_go(self, want, upload) -> dict:
        """An admin load with "evict": false: its 507 names the replicas that could go."""
        try:
            return await upload()
        except AdminError as exc:
            try:
                could = await self.autoload.could_go(want) if exc.status == 507 else []
            except Exception:              # only a hint: the 507 stands as it is
                could = []
            if not could:
                raise
            raise AdminError(507, f"{exc}; evicting {', '.join(could)} (idle, not pinned) "
                                  "would make room: load without \"evict\": false",
                             exc.param) from None

    async def upload_evicting(self, want, upload) -> dict:
        """An admin load that does not fit any die makes room as a request's load does:
        the least recently used idle, unpinned replicas are evicted (a busy one is waited
        for up to --queue-timeout), then it is placed again; the answer's `evicted` lists
        them. One room-maker at a time: the autoloader's `room`."""
        async with self.autoload.room:
            try:
                return await upload() | {"evicted": []}
            except AdminError as exc:
                if exc.status != 507:
                    raise
                first = exc
            deadline = time.monotonic() + self.admission.timeout_s
            evicted = await self.autoload.make_room(want, deadline, cap=False)
            if not evicted:           # it fits by the budget, yet the die refused it
                raise first
            log.info("made room for %s: evicted %s", want.name,
                     ", ".join(e["id"] for e in evicted))
            return await upload() | {"evicted": evicted}

    async def place_and_upload(self, path, name, dies, ctx, slots, on_progress,
                               quantize="", reason="admin", spec=None,
                               activations="", split=None, link="",
                               kv: KVCacheTypes = KVCacheTypes()) -> dict:
        if not Path(path).exists():
            raise AdminError(404, f"model file not found: {path}", "path")
        try:
            model = await asyncio.to_thread(open_model, path, name, int(time.time()))
        except FileNotFoundError as exc:
            raise AdminError(404, str(exc), "path") from exc
        except (ModelFileError, ValueError) as exc:
            raise AdminError(400, str(exc), "path") from exc
        existing = self.registry.models.get(name)
        differs = existing and await asyncio.to_thread(same_model, existing.path, model.path)
        if differs:
            raise AdminError(409, f"{name!r} already serves {existing.path}, and {path} is a "
                                  f"different model ({differs}); a replica must be the same "
                                  "model", "name")
        # phase 2: place and admit, before any upload
        try:
            runs = speculation.effective(spec, self.placer.spec)
            draft = None
            if runs is not None and runs.kind == "draft":
                target = await asyncio.to_thread(weight_bytes, model.path,
                                                 quantize or self.placer.quantize)
                size = await asyncio.to_thread(weight_bytes, runs.draft,
                                               quantize or self.placer.quantize)
                draft = runs.draft, await asyncio.to_thread(
                    speculation.check_draft, model.config, runs.draft, target, size)
        except ValueError as exc:
            raise AdminError(400, str(exc), "spec.draft") from exc
        stages, why = None, ""
        try:
            if split is not None or (dies is not None and len(dies) != 1):
                stages = await asyncio.to_thread(
                    split_placement.plan, self.die_table, model.path, model.config, dies,
                    split, slots or self.placer.slots, ctx or self.placer.ctx,
                    quantize or self.placer.quantize, kv.over(self.placer.kv_cache))
                die, need = stages[0].die, stages[0].reserved
            else:
                die, need = self.die_table.choose(model.path, model.config, dies,
                                                  slots or self.placer.slots,
                                                  ctx or self.placer.ctx,
                                                  quantize or self.placer.quantize, draft,
                                                  kv=kv.over(self.placer.kv_cache))
        except PlacementError as exc:
            if dies is not None or exc.status != 507 or draft is not None:
                raise AdminError(exc.status, str(exc), "split" if split else "dies") from exc
            try:                           # no single die fits: two, if two do
                stages = await asyncio.to_thread(
                    split_placement.plan, self.die_table, model.path, model.config, None,
                    None, slots or self.placer.slots, ctx or self.placer.ctx,
                    quantize or self.placer.quantize)
            except PlacementError:
                raise AdminError(exc.status, str(exc), "dies") from exc
            die, need = stages[0].die, stages[0].reserved
            why = (f"no single die has room ({exc}); split across dies {stages[0].die} and "
                   f"{stages[1].die}")
        worker = next(w for w in self.pool.live() if w.die == die)
        replica = self.registry.add(model, die)
        if stages:
            split_placement.apply(replica, stages)
            replica.placement = why or f"split across dies {stages[0].die} and {stages[1].die}"
        replica.reserved, replica.want_slots, replica.want_ctx = need, slots, ctx
        replica.want_quantize, replica.reason, replica.want_kv = quantize, reason, kv
        replica.want_activations = activations
        replica.want_spec = spec
        replica.want_link = "" if link == "auto" else link
        replica.state = ReplicaState.LOADING
        # phase 3: upload (the placer holds the fleet-wide upload lock); phase 4: publish
        sent = [None]
        watcher = asyncio.ensure_future(self.watch(replica, on_progress, sent)) \
            if on_progress else None
        try:
            await self.placer.load(self.registry.models[name], replica, worker)
        except asyncio.CancelledError:
            self.registry.remove(self.registry.models.get(name, model), replica)
            raise
        finally:
            self.pool.progress_queues.pop(replica.model_id, None)
            if watcher:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        if on_progress and replica.progress[1] and replica.progress != sent[0]:
            await on_progress(replica.model_id, *replica.progress)    # the last step
        if replica.state != ReplicaState.READY:
            self.registry.remove(self.registry.models.get(name, model), replica)
            if replica.error_code == p.BAD_MODEL_FILE:      # the file cannot serve
                raise AdminError(400, f"{path} cannot be loaded: {replica.error}", "path")
            if replica.error_code == p.OUT_OF_MEMORY:       # no room, as admission's 507
                raise AdminError(507, f"loading {name!r} on die {die} failed: {replica.error}")
            if replica.error_code == split_placement.LINK_REFUSED:   # keys, --insecure, hosts
                raise AdminError(400, f"loading {name!r} failed: {replica.error}", "link")
            if replica.error_code == p.STAGE_LINK:          # a port in use, keys missing
                raise AdminError(503, f"loading {name!r} across dies failed: {replica.error}")
            raise AdminError(500, f"loading {name!r} on die {die} failed: {replica.error}")
        return {"loaded": {"name": name, "die": die, **replica.as_json()}}

    async def watch(self, replica, on_progress, sent: list) -> None:
        """Pass each progress report of the load on, as it arrives."""
        queue = self.pool.watch_progress(replica.model_id)
        while True:
            now = await queue.get()
            if now != sent[0]:
                sent[0] = now
                await on_progress(replica.model_id, *now)

    # -- unload ------------------------------------------------------------------------
    async def unload(self, body: dict, reason: str = "admin") -> dict:
        """Every replica of `name`, those on `die`, or the one replica `id` (as
        /admin/models lists them). `reason`: admin, or the autoloader's idle / evicted."""
        rid = field(body, "id", str)
        name = field(body, "name", str, required=rid is None)
        die = field(body, "die", (str, int))
        timeout_s = field(body, "timeout_s", (int, float), settings.UNLOAD_TIMEOUT_S)
        if timeout_s < 0:
            raise AdminError(400, "timeout_s must be >= 0", "timeout_s")
        if rid is not None:
            found = [(m, r) for m, r in self.registry.replicas() if r.model_id == rid]
            if not found or name not in (None, found[0][0].name):
                raise AdminError(404, f"no replica {rid!r}" + (f" of {name!r}" if name else "")
                                 + "; /admin/models lists them", "id")
            model, name = found[0][0], found[0][0].name
        else:
            model = self.registry.models.get(name)
            if model is None:
                raise AdminError(404, f"no model named {name!r}", "name")
        targets = [r for r in model.replicas if (die is None or r.die == str(die))
                   and rid in (None, r.model_id)]
        if not targets:
            raise AdminError(404, f"{name!r} has no replica on die {die}", "die")
        if any(r.state == ReplicaState.UNLOADING for r in targets):
            raise AdminError(409, f"{name!r} is already being unloaded")
        for r in targets:
            r.state = ReplicaState.UNLOADING          # no new requests from now on
        if not model.ready():
            self.admission.fail_waiters(model, f"model {name!r} was unloaded")
        try:                # the drain: admission sets `idle` when the last one leaves
            await asyncio.wait_for(asyncio.gather(*(r.idle.wait() for r in targets)),
                                   timeout_s)
        except asyncio.TimeoutError:
            pass
        aborted = sum(r.inflight for r in targets)
        for r in targets:
            if r.worker is not None and r.worker.alive:
                try:      # the worker aborts what still runs there, then frees it all
                    await self.pool.unload(r.worker, r.model_id)
                except (WorkerLost, asyncio.TimeoutError) as exc:
                    log.warning("unloading %s: %s", r.model_id, exc)
            await split_placement.unload_tail(self.pool, r)     # a split replica's stage 1
            self.registry.remove(model, r)
            if self.metrics is not None:
                self.metrics.unloads.labels(name, reason).inc()
        log.info("unloaded %s (%d replica(s), %d request(s) aborted; reason: %s)", name,
                 len(targets), aborted, reason)
        if self.autoload is not None:
            self.autoload.count("unload", reason)
            if reason == "admin":
                self.autoload.admin_unloaded(name)
        return {"unloaded": [{"id": r.model_id, "die": r.die} for r in targets],
                "aborted": aborted}


class AdminSocket:
    """The ZeroMQ admin endpoint: [token, AdminRequest] in; LoadProgress…, AdminReply out.

    Nothing is decoded before it is allowed: a frame past MAX_ADMIN_MESSAGE_BYTES drops
    its peer inside libzmq (MAXMSGSIZE), the token (a frame of its own) is compared before
    the request is read, and the request is then decoded within the ADMIN limits. A
    one-frame request (older clients: the token inside) is decoded only by a server
    without a token; one with a token answers it 401 unread."""

    def __init__(self, admin: Admin, address: str, token: str | KeySet | None,
                 curve: KeyPair | None = None):
        self.admin, self.token = admin, KeySet.of(token)     # a key file is reread on change
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        if curve is not None:        # encrypted; any client key: the token authenticates
            curve_server(self.sock, curve, "admin")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_ADMIN_MESSAGE_BYTES)
        self.sock.bind(address)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if not 2 <= len(frames) <= 3:
                continue
            ident, *rest = (f.bytes for f in frames)
            token, data = rest if len(rest) == 2 else (None, rest[0])
            task = asyncio.ensure_future(self.handle(ident, data, token))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def handle(self, ident: bytes, data: bytes, token: bytes | None) -> None:
        async def send(msg):
            await self.sock.send_multipart([ident, p.encode(msg)])
        if self.token and (token is None or len(token) > wire.MAX_ADMIN_TOKEN_BYTES or
                           not self.token.matches(token)):
            why = "invalid admin token" if token is not None else \
                "the admin token goes in a frame of its own before the request (an older " \
                "client?)"
            await send(p.AdminReply(401, AdminError(401, why).body()))
            return
        try:
            req = p.decode(data, wire.ADMIN)
            if not isinstance(req, p.AdminRequest):
                raise p.ProtocolError(f"expected an admin request, got {type(req).__name__}")
        except p.ProtocolError as exc:
            await send(p.AdminReply(400, AdminError(400, str(exc)).body()))
            return

        async def progress(model_id, done, total):
            await send(p.LoadProgress(model_id, done, total))
        status, body = await self.admin.call(req.cmd, req.args, progress)
        await send(p.AdminReply(status, body))

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.sock.close(0)
