"""Registration with an existing LLM router in front of several instances.

With `PANTHEON_REGISTRY_URL` set, once the instance is ready it joins the router, keeps
its membership with a heartbeat every `PANTHEON_HEARTBEAT_S`, and leaves when it starts
draining and when it stops; unset, none of this module runs. It speaks the router's own
API (never one of ours):

  vllm-router (the default)  POST /add_worker?url=  POST /remove_worker?url=
                             GET /list_workers -> {"urls": [...]}
  smg (SGLang's gateway)     POST /workers {url, labels} -> 202 {worker_id}
                             GET /workers/{id}    DELETE /workers/{id}

One instance is one registration whatever it serves: the router sees one endpoint, and
the replicas behind it (same `host:port`, so the same spec instance id) are routed
inside the instance, by least in-flight with session affinity (router.py).

Invariants: nothing here can stop or slow serving. A router that is down, slow or
answers errors is retried with backoff (doubling from 0.5 s up to the heartbeat
interval) and logged once per change of state, not once per try; only `deregister()`
waits on the router, and for a bounded time.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote, urlsplit

import httpx

from .load import InstanceLoad

log = logging.getLogger("pantheon.frontend.registration")

BACKOFF_START_S = 0.5
TIMEOUT = httpx.Timeout(10.0, connect=3.0)   # vllm-router health-checks us inside add_worker
LEAVE_TIMEOUT_S = 3.0                        # a stop waits this long for the router at most


@dataclass(frozen=True, slots=True)
class Identity:
    """What a registration says about the instance: the spec's node id, endpoint,
    instance ids (`host:port:model`, one per served name), capacity (slots of the
    ready replicas, all together) and transport hint."""

    node_id: str
    endpoint: str
    models: tuple[str, ...]
    capacity: int
    transport: str

    def instance_ids(self) -> list[str]:
        return [f"{urlsplit(self.endpoint).netloc}:{m}" for m in self.models]

    def labels(self) -> dict[str, str]:
        return {"node_id": self.node_id, "instance_id": ",".join(self.instance_ids()),
                "models": ",".join(self.models), "capacity": str(self.capacity),
                "transport": self.transport}


def endpoint_url(host: str, port: int, advertised: str | None = None) -> str:
    """Where the router reaches this instance: `advertised`, else http://HOST:PORT, with
    this host's name when HOST is a wildcard (0.0.0.0, ::) that a router cannot dial."""
    if advertised:
        return advertised
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class RegistryError(Exception):
    """The router could not be reached, or answered with an error; `state` says which."""

    def __init__(self, state: str, message: str):
        super().__init__(message)
        self.state = state


async def _call(client: httpx.AsyncClient, method: str, url: str, **kw) -> httpx.Response:
    try:
        response = await client.request(method, url, **kw)
    except httpx.HTTPError as exc:
        raise RegistryError("unreachable", f"{type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        raise RegistryError(f"refused ({response.status_code})",
                            f"{method} {urlsplit(url).path} answered {response.status_code}: "
                            f"{response.text[:200]}")
    return response


class VllmRouter:
    """vllm-router 0.1.17's worker API. It keeps only a URL per worker: the identity rides
    along as query parameters it ignores, and it learns load by polling our /get_load
    (the heartbeat checks membership: a router restarted without us is joined again)."""

    def __init__(self, base: str, client: httpx.AsyncClient):
        self.base, self.client = base, client

    async def register(self, ident: Identity, load: InstanceLoad) -> None:
        params = {"url": ident.endpoint, **ident.labels(), "load": str(load.load)}
        try:
            await _call(self.client, "POST", f"{self.base}/add_worker", params=params)
        except RegistryError as exc:
            if "already exists" not in str(exc):   # still listed from before: joined
                raise

    async def heartbeat(self, ident: Identity, load: InstanceLoad) -> bool:
        response = await _call(self.client, "GET", f"{self.base}/list_workers")
        return ident.endpoint in response.json().get("urls", [])

    async def deregister(self, ident: Identity) -> None:
        await _call(self.client, "POST", f"{self.base}/remove_worker",
                    params={"url": ident.endpoint}, timeout=LEAVE_TIMEOUT_S)


class Smg:
    """SMG's worker API (1.13): a registration is a worker id, the identity travels as
    labels. SMG adds (and on DELETE drains for 5 s, then removes) in the background; a
    second POST of a listed URL is a 409, which finds our id in its listing."""

    def __init__(self, base: str, client: httpx.AsyncClient):
        self.base, self.client = base, client
        self.worker_id: str | None = None

    async def register(self, ident: Identity, load: InstanceLoad) -> None:
        body = {"url": ident.endpoint, "labels": ident.labels(), "worker_type": "regular"}
        try:
            response = await _call(self.client, "POST", f"{self.base}/workers", json=body)
        except RegistryError as exc:
            if exc.state != "refused (409)":
                raise
            self.worker_id = await self.listed_id(ident.endpoint)   # still there: ours
            return
        self.worker_id = response.json()["worker_id"]     # 202: added in the background

    async def listed_id(self, url: str) -> str:
        response = await _call(self.client, "GET", f"{self.base}/workers")
        for worker in response.json().get("workers", []):
            if worker.get("url") == url:
                return worker["id"]
        raise RegistryError("refused (409)", f"SMG refused {url} but does not list it")

    async def heartbeat(self, ident: Identity, load: InstanceLoad) -> bool:
        try:
            await _call(self.client, "GET", f"{self.base}/workers/{quote(self.worker_id, '')}")
        except RegistryError as exc:
            if exc.state == "refused (404)":
                return False
            raise
        return True

    async def deregister(self, ident: Identity) -> None:
        if self.worker_id is not None:
            await _call(self.client, "DELETE",
                        f"{self.base}/workers/{quote(self.worker_id, '')}",
                        timeout=LEAVE_TIMEOUT_S)


APIS = {"vllm-router": VllmRouter, "smg": Smg}


class Registration:
    """This instance's membership of one router: `start()` once ready, `deregister()` when
    draining or stopping (idempotent), `close()` last."""

    def __init__(self, url: str, kind: str, identity: Callable[[], Identity],
                 load: Callable[[], InstanceLoad], heartbeat_s: float,
                 client: httpx.AsyncClient | None = None):
        self.url, self.kind, self.heartbeat_s = url, kind, heartbeat_s
        self.identity, self.load = identity, load
        self.client = client or httpx.AsyncClient(timeout=TIMEOUT)
        self.api = APIS[kind](url, self.client)
        self.state = "unregistered"     # registered | unreachable | refused (N) | deregistered
        self.task: asyncio.Task | None = None
        self.leaving: asyncio.Task | None = None

    def start(self) -> None:
        if self.task is None and self.leaving is None:
            self.task = asyncio.create_task(self.run(), name="registration")

    async def run(self) -> None:
        delay, joined = BACKOFF_START_S, False
        while True:
            ident, load = self.identity(), self.load()
            if not ident.models:               # nothing ready to serve: nothing to offer
                self.enter("waiting", "no model is ready yet")
                await asyncio.sleep(self.heartbeat_s)
                continue
            try:
                if not (joined and await self.api.heartbeat(ident, load)):
                    if joined:
                        self.enter("unregistered", "the router no longer lists this instance")
                    await self.api.register(ident, load)
                    joined = True
                self.enter("registered", f"as {ident.endpoint} ({', '.join(ident.models)}; "
                                         f"{ident.capacity} slots, node {ident.node_id})")
                delay = BACKOFF_START_S
                await asyncio.sleep(self.heartbeat_s)
            except RegistryError as exc:
                self.enter(exc.state, str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, max(self.heartbeat_s, BACKOFF_START_S))
            except Exception as exc:           # a bug here must not end registration
                self.enter("failing", f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self.heartbeat_s)

    def enter(self, state: str, detail: str) -> None:
        """Log a change of state once; the same state again is silent."""
        if state != self.state:
            level = logging.WARNING if state.startswith(("unreachable", "refused", "failing")) \
                else logging.INFO
            log.log(level, "router %s (%s): %s: %s; %s", self.url, self.kind, state, detail,
                    f"heartbeat every {self.heartbeat_s:g} s" if state == "registered"
                    else "done" if state == "deregistered" else "retrying")
            self.state = state

    async def deregister(self) -> None:
        """Leave the router (the first call; later ones wait for it). Stops the heartbeat
        first, so nothing joins again afterwards."""
        if self.leaving is None:
            self.leaving = asyncio.ensure_future(self._leave())
        await asyncio.shield(self.leaving)

    async def _leave(self) -> None:
        started, self.task = self.task, None
        if started is None:
            return                              # never started: nothing to undo
        started.cancel()
        await asyncio.gather(started, return_exceptions=True)
        try:
            await self.api.deregister(self.identity())
            self.enter("deregistered", "removed from the router")
        except RegistryError as exc:
            log.warning("router %s: could not deregister: %s", self.url, exc)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        await self.client.aclose()
