"""`pantheon serve`: the frontend process, and the workers it spawns."""
from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
import zmq
import zmq.asyncio

from ..common import protocol as p
from ..common import options, settings, speculation
from ..common.key_set import KeySet
from ..common.kv_cache import KVCacheTypes
from ..common.stage_bind import StageBind
from ..common.weight_format import weight_bytes
from .admission import Admission
from .admin import Admin, AdminSocket
from .app import build_app
from .autoload import AutoLoader, LifecycleConfig
from .catalog import parse_alias
from .dies import DieTable
from .drain import Drain, DrainingServer, shutting_down
from .lifecycle import Lifecycle
from .metrics import Metrics
from .limits import ConnectionLimits, RequestLimits
from .load import measure
from .placement import Placer
from .preparer import Preparer
from .registration import Identity, Registration, endpoint_url
from .registry import Registry, ReplicaState, open_model
from .response_store import ResponseStore
from .security import BrowserPolicy, Exposure, LinkAuth, ModelDirs, enforce
from ..common.die_spec import parse_die
from .supervisor import Supervisor, die_names
from .workers import WorkerPool

log = logging.getLogger("pantheon.frontend")


@dataclass(kw_only=True)
class ServeConfig:
    """Everything `pantheon serve` runs with; built by name, defaults from settings."""

    models: list[tuple[str, str | None]]          # (path, served name or None)
    model_dies: list = field(default_factory=list)  # per --model: [a, b] to split it, or None
    host: str = settings.HOST
    port: int = settings.PORT
    worker_addr: str = settings.WORKER_ADDR
    spawn: list[str] = field(default_factory=lambda: ["cpu"])   # [] = --no-spawn
    slots: int = settings.SLOTS
    ctx: int = 0
    api_key: KeySet | str | None = None           # a KeySet: --api-key and --api-key-file
    max_body_bytes: int = settings.MAX_BODY_BYTES
    worker_timeout_s: float = settings.WORKER_TIMEOUT_S     # silence (or a step): slow
    prefill_chunk: int = settings.PREFILL_CHUNK
    prefix_cache_mb: float = settings.PREFIX_CACHE_MB
    queue_depth: int = settings.QUEUE_DEPTH
    queue_timeout_s: float = settings.QUEUE_TIMEOUT_S
    admin_addr: str = settings.ADMIN_ADDR
    admin_key: KeySet | str | None = None
    max_models: int = settings.MAX_MODELS
    context_cap: bool = True
    worker_lost_after_s: float = settings.WORKER_LOST_AFTER_S   # unanswered silence: lost
    quantize: str = "auto"
    activations: str = "auto"             # the CPU products' activations (auto, int8, int16)
    kv_cache: KVCacheTypes = KVCacheTypes()   # --kv-cache: "" halves, each worker's default
    spec: str = ""                        # speculative decoding of every --model: "" or a kind
    spec_n: int = speculation.DEFAULT_N   # prompt lookup's longest n-gram
    spec_k: int = speculation.DEFAULT_K   # the longest proposal
    draft_model: str = ""                 # --spec draft: the draft model's path
    shutdown_timeout_s: float = settings.SHUTDOWN_TIMEOUT_S
    metrics_auth: bool = False                 # /metrics takes the API key
    log_format: str = "text"
    log_prompts: bool = False
    keys_dir: str | None = None           # CURVE on both ZeroMQ sockets (security.py)
    insecure: bool = False                # start despite exposure problems, warning
    stage_bind: StageBind | None = None   # spawned workers' --stage-bind
    http_admin: bool = True               # the /admin/ routes on the HTTP server
    dashboard: str = "on"                 # GET /dashboard: on, readonly (no buttons) or off
    model_dirs: list[str] | None = None   # where loads may open; None: the defaults
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    stream_buffer_tokens: int = settings.STREAM_BUFFER_TOKENS
    registry_url: str | None = None             # None: no router registration at all
    registry_kind: str = settings.REGISTRY_KINDS[0]
    heartbeat_s: float = settings.HEARTBEAT_S
    node_id: str = "node0"
    registry_transport: str = "local"
    advertise_url: str | None = None
    allowed_hosts: list[str] = field(default_factory=list)    # beyond the bind's own
    cors_origins: list[str] = field(default_factory=list)     # none: no CORS headers
    max_request_slots: int = 0            # one request's choices at once; 0: half a replica
    prepare_timeout_s: float = settings.PREPARE_TIMEOUT_S
    lifecycle: LifecycleConfig = field(default_factory=lambda: LifecycleConfig())
    responses_ttl_s: float = settings.RESPONSES_TTL_S
    responses_max_mb: float = settings.RESPONSES_MAX_MB
    pooling: str = "auto"                 # /v1/embeddings: auto (the model file's), mean, last

    def __post_init__(self):
        """Settings that cannot serve are refused here, before anything starts, each with
        one line naming the flag and what would work."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is out of range: a TCP port is 1-65535 "
                             "(0: any free one)")
        if self.slots < 1:
            raise ValueError(f"--slots {self.slots}: a replica needs at least 1 slot (1 is "
                             f"single-user mode; default {settings.SLOTS})")
        if self.ctx < 0 or self.ctx == 1:
            raise ValueError(f"--ctx {self.ctx}: a context holds at least 2 positions (0: "
                             "the model's, at most 4096)")
        if self.prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk {self.prefill_chunk}: at least 1 token a step")
        if self.responses_ttl_s < 0 or self.responses_max_mb < 0:
            raise ValueError("--responses-ttl and --responses-max-mb must be >= 0 (0: "
                             "responses are not kept)")
        if self.worker_lost_after_s < self.worker_timeout_s:
            raise ValueError("--worker-lost-after must be at least --worker-timeout")
        if self.worker_lost_after_s < 2.0:       # probes start after 1 s of silence
            raise ValueError("--worker-lost-after must be at least 2 seconds")
        if self.spec or self.spec_n != speculation.DEFAULT_N \
                or self.spec_k != speculation.DEFAULT_K:
            try:
                speculation.check(self.spec or "ngram", self.spec_n, self.spec_k,
                                  self.draft_model)
            except ValueError as exc:
                raise ValueError("--" + str(exc).replace(".", "-", 1).replace(
                    "spec-kind", "spec", 1).replace("spec-draft", "draft-model", 1)) from None
        elif self.draft_model:
            raise ValueError("--draft-model goes with --spec draft")
        if self.shutdown_timeout_s < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.metrics_auth and not self.api_key:
            raise ValueError("--metrics-auth protects /metrics with the API key: set one "
                             "(--api-key or PANTHEON_API_KEY)")


async def serve(cfg: ServeConfig) -> int:
    enforce(Exposure(cfg.host, cfg.worker_addr, cfg.admin_addr, cfg.api_key, cfg.admin_key,
                     cfg.keys_dir, cfg.http_admin, spawn=bool(cfg.spawn)).problems(),
            cfg.insecure)
    created = int(time.time())
    registry = Registry()
    for at, (path, name) in enumerate(cfg.models):   # metadata, tokenizers: bad files stop
        model = await asyncio.to_thread(open_model, path, name, created)
        if cfg.lifecycle.preload:        # else loaded on its first request
            replica = registry.add(model, die=None)
            if at < len(cfg.model_dies) and cfg.model_dies[at]:
                replica.want_dies = cfg.model_dies[at]     # split_placement.py
        if cfg.spec == "draft":          # a draft that cannot serve this model: exit 1 now
            target = weight_bytes(path, cfg.quantize)
            try:
                speculation.check_draft(model.config, cfg.draft_model, target,
                                        weight_bytes(cfg.draft_model, cfg.quantize))
            except ValueError as exc:
                raise ValueError(str(exc).replace("spec.draft", "--draft-model", 1)) from None
    catalog = await asyncio.to_thread(cfg.lifecycle.catalog, cfg.models, cfg.model_dirs)
    policy = cfg.lifecycle.policy(catalog, [name or Path(path).stem for path, name in cfg.models])
    model_dirs = ModelDirs(cfg.model_dirs) if cfg.model_dirs else \
        ModelDirs.default(settings.cache_dir(), [path for path, _ in cfg.models]
                          + ([cfg.draft_model] if cfg.draft_model else []))
    link = LinkAuth(cfg.keys_dir) if cfg.keys_dir else None
    if link is not None:                 # ZAP answers before any socket can be reached
        link.start(zmq.asyncio.Context.instance())
    curve = link.pair if link else None
    # bind every socket before anything starts, so a taken address fails fast and clean
    try:
        # workers we did not spawn join over CURVE, or with --insecure
        pool = bind("worker", cfg.worker_addr, lambda: WorkerPool(
            cfg.worker_addr, cfg.worker_timeout_s, cfg.worker_lost_after_s, curve,
            cfg.stream_buffer_tokens, external=curve is not None or cfg.insecure))
    except RuntimeError:
        if link:
            link.close()
        raise
    addr = pool.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    dies = die_names(cfg.spawn)
    die_table = DieTable(registry, pool, cfg.slots)
    metrics = Metrics()
    placer = Placer(registry, pool, die_table, cfg.slots, cfg.ctx, cfg.prefill_chunk,
                    expected_dies=dies, quantize=cfg.quantize, metrics=metrics,
                    kv_cache=cfg.kv_cache,
                    spec=p.Speculation(cfg.spec, cfg.spec_n, cfg.spec_k,
                                       str(Path(cfg.draft_model).resolve())
                                       if cfg.draft_model else "") if cfg.spec else None,
                    activations=cfg.activations)
    admission = Admission(cfg.queue_depth, cfg.queue_timeout_s,
                          max_request_slots=cfg.max_request_slots)
    pool.on_change.append(admission.wake_all)
    admin = Admin(registry, pool, placer, die_table, admission, cfg.max_models, model_dirs,
                  metrics)
    autoload = AutoLoader(catalog, registry, admin, admission, policy, metrics)
    try:
        admin_socket = bind("admin", cfg.admin_addr,
                            lambda: AdminSocket(admin, cfg.admin_addr, cfg.admin_key, curve))
        http = http_socket(cfg.host, cfg.port)
    except RuntimeError:
        await pool.close()
        if link:
            link.close()
        raise
    lifecycle = Lifecycle(pool, admission, metrics)
    drain = drain_for(cfg, lifecycle, admission, admin)
    metrics.watch(registry, pool, admission, lifecycle, drain)
    app = build_app(registry, lifecycle, admin, cfg.api_key, cfg.admin_key,
                    cfg.max_body_bytes, cfg.context_cap, drain, cfg.metrics_auth,
                    cfg.log_prompts, cfg.request_limits, cfg.http_admin,
                    BrowserPolicy.build(cfg.host, cfg.allowed_hosts, cfg.cors_origins),
                    Preparer(cfg.prepare_timeout_s), cfg.dashboard,
                    ResponseStore(cfg.responses_ttl_s, int(cfg.responses_max_mb * (1 << 20))),
                    cfg.pooling)
    server = DrainingServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, lifespan="off",
                                           log_level="warning", timeout_graceful_shutdown=5,
                                           http=cfg.connection_limits.protocol()),
                            drain)
    pool.start()
    autoload.start()
    worker_args = ["--prefix-cache-mb", str(cfg.prefix_cache_mb), "--log-format", cfg.log_format]
    if link is not None:
        worker_args += ["--keys", cfg.keys_dir]     # they join with the server's own pair
    if cfg.stage_bind is not None:
        worker_args += ["--stage-bind", cfg.stage_bind.text()]
    supervisor = Supervisor(dies, addr, pool, cfg.slots, worker_args)
    supervisor.start()
    registration = registration_for(cfg, registry, admission)
    if registration is not None:               # the router stops sending before we refuse
        drain.on_start.insert(0, registration.deregister)
    refused = []

    def refuse() -> None:                      # a --model cannot serve: stop, exit 1
        refused.append(True)
        server.should_exit = True
    tasks = [asyncio.create_task(admin_socket.serve(), name="admin-socket"),
             asyncio.create_task(announce_when_ready(cfg, placer, registry, addr,
                                                     registration, refuse))]
    if link is not None:
        tasks += [asyncio.create_task(link.watch(pool.sock, "worker"), name="curve-workers"),
                  asyncio.create_task(link.watch(admin_socket.sock, "admin"),
                                      name="curve-admin")]
    try:
        await server.serve(sockets=[http])
    finally:
        if drain.task is not None:
            drain.task.cancel()
        if registration is not None:           # leave the router before anything stops
            await registration.deregister()
            await registration.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        admin_socket.close()
        admission.close()
        await autoload.close()
        await placer.close()
        await supervisor.stop()
        await pool.close()
        if link:
            link.close()
    return 0 if server.started and not refused else 1


def drain_for(cfg: ServeConfig, lifecycle: Lifecycle, admission: Admission,
              admin: Admin) -> Drain:
    """The drain of this server: busy while any request runs or waits; at its deadline
    the queued ones get a 503 and the running ones an error."""
    def stop_rest() -> None:
        admission.close()
        lifecycle.stop_all(shutting_down("the server shut down before this request ended"))
    drain = Drain(cfg.shutdown_timeout_s, lambda: lifecycle.running, stop_rest)
    drain.on_start += [admission.drain, admin.drain]
    lifecycle.on_end.append(drain.changed)
    return drain


def http_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: without, a response written as headers then body
    # waits for the client's delayed ACK (~40 ms) on every reused connection, which a
    # router's connection pool (and the openai SDK) always reuses
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def bind(what: str, address: str, make):
    try:
        return make()
    except zmq.ZMQError as exc:
        raise RuntimeError(f"cannot bind the {what} socket at {address}: {exc}") from None


def registration_for(cfg: ServeConfig, registry: Registry,
                     admission: Admission) -> Registration | None:
    """The router membership `PANTHEON_REGISTRY_URL` asks for, or None (no registration)."""
    if cfg.registry_url is None:
        return None
    endpoint = endpoint_url(cfg.host, cfg.port, cfg.advertise_url)

    def identity() -> Identity:
        ready = registry.ready_models()
        return Identity(cfg.node_id, endpoint, tuple(m.name for m in ready),
                        sum(max(r.slots, 1) for m in ready for r in m.ready()),
                        cfg.registry_transport)
    return Registration(cfg.registry_url, cfg.registry_kind, identity,
                        lambda: measure(registry, admission), cfg.heartbeat_s)


async def announce_when_ready(cfg: ServeConfig, placer: Placer, registry: Registry,
                              addr: str, registration: Registration | None = None,
                              refuse=lambda: None) -> None:
    """"ready" once every --model is loaded; a --model that failed to load is one line
    (its error) on stderr, then `refuse()`: the server stops and exits 1."""
    log.info("workers connect to %s; admin socket at %s", addr, cfg.admin_addr)
    await placer.wait_settled()
    failed = [(m, r) for m, r in registry.replicas() if r.state == ReplicaState.FAILED]
    if failed:
        for m, r in failed:
            print(f"error: cannot serve --model {m.path} ({m.name}): {r.error}",
                  file=sys.stderr, flush=True)
        refuse()
        return
    names = ", ".join(m.name for m in registry.ready_models())
    print(f"Pantheon ready at http://{cfg.host}:{cfg.port} (models: {names})", flush=True)
    if registration is not None:
        registration.start()


def main(args) -> int:
    from ..common.default_model import DEFAULT_NAME, default_model_path
    if refused := settings.refused_knobs():
        raise RuntimeError("; ".join(refused))
    paths, names = args.model, list(args.name or [])
    if not paths:
        paths = [str(default_model_path(log=lambda m: print(m, file=sys.stderr)))]
        names = names or [DEFAULT_NAME]
    if len(names) > len(paths):
        raise ValueError("more --name than --model flags")
    models = [(path, names[i] if i < len(names) else None) for i, path in enumerate(paths)]
    spawn = [] if args.no_spawn else [d.strip() for d in args.spawn_workers.split(",") if d.strip()]
    for die in spawn:                       # a bad name stops here, with the accepted forms
        if parse_die(die).kind == "emu" and spawn.count(die) > 1:
            raise ValueError(f"die {die!r} twice: give each emulated die its own index")
    cfg = options.config(
        ServeConfig, args, options.SERVE, models=models, spawn=spawn,
        api_key=KeySet.of(KeySet([args.api_key], args.api_key_file)),
        admin_key=KeySet.of(KeySet([args.admin_key], args.admin_key_file)),
        kv_cache=getattr(args, "kv", None) or KVCacheTypes.of(settings.kv_cache()),
        request_limits=options.config(RequestLimits, args, options.SERVE),
        connection_limits=options.config(ConnectionLimits, args, options.SERVE),
        lifecycle=options.config(LifecycleConfig, args, options.SERVE,
                                 aliases=[parse_alias(a) for a in args.alias or []]),
        **registry_settings())
    return asyncio.run(serve(cfg))


def registry_settings() -> dict:
    """ServeConfig's router fields from the environment; none read (and none can fail)
    unless PANTHEON_REGISTRY_URL is set."""
    url = settings.registry_url()
    if url is None:
        return {}
    return dict(registry_url=url, registry_kind=settings.registry_kind(),
                heartbeat_s=settings.heartbeat_s(), node_id=settings.node_id(),
                registry_transport=settings.registry_transport(),
                advertise_url=settings.advertise_url())
