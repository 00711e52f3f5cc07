"""Router registration against fake routers (httpx.MockTransport): join once a model is
ready, heartbeats, joining again a router that forgot us, backoff and one log line per
change of state, idempotent deregistration; the settings that gate it; the load it
reports. The real vllm-router is exercised in test_multi_instance_e2e.py."""
import asyncio
import json
import logging
from types import SimpleNamespace

import httpx
import pytest

from pantheon.cli import main as cli_main
from pantheon.common import settings
from pantheon.frontend.admission import Admission
from pantheon.frontend.load import InstanceLoad, measure
from pantheon.frontend.registration import Identity, Registration, endpoint_url
from pantheon.frontend.registry import Replica, ReplicaState

ENDPOINT = "http://10.0.0.7:8001"


class FakeVllmRouter:
    """vllm-router's worker routes, as 0.1.17 answers them; `down` refuses connections."""

    def __init__(self):
        self.urls, self.calls, self.down, self.fail = [], [], False, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.method, request.url.path, dict(request.url.params)))
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.fail:
            self.fail -= 1
            return httpx.Response(500, text="internal error")
        url = request.url.params.get("url")
        if request.url.path == "/add_worker":
            if url in self.urls:
                return httpx.Response(400, text=f"Worker {url} already exists")
            self.urls.append(url)
            return httpx.Response(200, text=f"Successfully added worker: {url}")
        if request.url.path == "/remove_worker":
            if url in self.urls:
                self.urls.remove(url)
            return httpx.Response(200, text=f"Successfully removed worker: {url}")
        if request.url.path == "/list_workers":
            return httpx.Response(200, json={"urls": list(self.urls)})
        return httpx.Response(404)

    def count(self, path: str) -> int:
        return sum(1 for _, p, _ in self.calls if p == path)


def registration(router, models=("m",), heartbeat_s=0.05, kind="vllm-router"):
    ident = Identity("node7", ENDPOINT, tuple(models), 8, "local")
    state = SimpleNamespace(ident=ident)
    reg = Registration("http://router:30000", kind, lambda: state.ident,
                       lambda: InstanceLoad(3, 2, 8), heartbeat_s,
                       httpx.AsyncClient(transport=httpx.MockTransport(router)))
    return reg, state


async def until(check, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_registers_with_identity_then_heartbeats_and_deregisters_once():
    async def go():
        router = FakeVllmRouter()
        reg, _ = registration(router)
        reg.start()
        await until(lambda: router.count("/list_workers") >= 3)
        assert router.urls == [ENDPOINT] and router.count("/add_worker") == 1
        (params,) = [p for _, path, p in router.calls if path == "/add_worker"]
        assert params == {"url": ENDPOINT, "node_id": "node7", "instance_id": "10.0.0.7:8001:m",
                          "models": "m", "capacity": "8", "transport": "local", "load": "5"}
        await asyncio.gather(reg.deregister(), reg.deregister())
        await reg.deregister()
        assert router.urls == [] and router.count("/remove_worker") == 1
        calls = len(router.calls)
        await asyncio.sleep(0.2)                   # no heartbeat, no join after leaving
        assert len(router.calls) == calls and reg.state == "deregistered"
        await reg.close()
    asyncio.run(go())


def test_joins_again_a_router_that_forgot_it():
    async def go():
        router = FakeVllmRouter()
        reg, _ = registration(router)
        reg.start()
        await until(lambda: router.urls == [ENDPOINT])
        router.urls.clear()                        # the router restarted without us
        await until(lambda: router.urls == [ENDPOINT])
        assert router.count("/add_worker") == 2
        await reg.close()
    asyncio.run(go())


def test_already_listed_counts_as_joined():
    async def go():
        router = FakeVllmRouter()
        router.urls.append(ENDPOINT)               # left over from before our restart
        reg, _ = registration(router)
        reg.start()
        await until(lambda: router.count("/list_workers") >= 2)
        assert router.count("/add_worker") == 1 and reg.state == "registered"
        await reg.close()
    asyncio.run(go())


def test_waits_for_a_ready_model_before_joining():
    async def go():
        router = FakeVllmRouter()
        reg, state = registration(router, models=())
        reg.start()
        await asyncio.sleep(0.2)
        assert router.calls == [] and reg.state == "waiting"
        state.ident = Identity("node7", ENDPOINT, ("m",), 8, "local")
        await until(lambda: router.urls == [ENDPOINT])
        await reg.close()
    asyncio.run(go())


def test_router_down_then_up_and_errors_are_retried_and_logged_once_per_change(caplog):
    async def go():
        router = FakeVllmRouter()
        router.down = True
        reg, _ = registration(router, heartbeat_s=0.2)
        reg.start()
        await until(lambda: len(router.calls) >= 3, timeout=5)   # 0.5 s backoff, then 0.2
        assert reg.state == "unreachable" and router.urls == []
        router.down, router.fail = False, 2
        await until(lambda: router.urls == [ENDPOINT], timeout=5)
        await reg.deregister()
        await reg.close()
    with caplog.at_level(logging.INFO, logger="pantheon.frontend.registration"):
        asyncio.run(go())
    states = [r.getMessage().split(": ")[1] for r in caplog.records]
    assert states == ["unreachable", "refused (500)", "registered", "deregistered"], states


def test_deregister_before_start_or_with_router_down_returns_promptly():
    async def go():
        router = FakeVllmRouter()
        reg, _ = registration(router)
        await reg.deregister()                     # never started: nothing sent
        assert router.calls == []
        reg.start()                                # after leaving, start does nothing
        await asyncio.sleep(0.1)
        assert router.calls == []
        await reg.close()

        router = FakeVllmRouter()
        reg, _ = registration(router)
        reg.start()
        await until(lambda: router.urls == [ENDPOINT])
        router.down = True
        await asyncio.wait_for(reg.deregister(), 5)   # logged, not raised
        await reg.close()
    asyncio.run(go())


def test_smg_registers_by_worker_id_and_deletes_it():
    async def go():
        workers, calls = {}, []

        def smg(request: httpx.Request) -> httpx.Response:
            calls.append((request.method, request.url.path))
            if request.method == "POST" and request.url.path == "/workers":
                body = json.loads(request.content)
                if any(w["url"] == body["url"] for w in workers.values()):
                    return httpx.Response(409, json={"error": "exists"})
                workers["w-1"] = body
                return httpx.Response(202, json={"status": "accepted", "worker_id": "w-1"})
            if request.url.path == "/workers":
                return httpx.Response(200, json={"workers": [
                    {"id": k, **w} for k, w in workers.items()]})
            wid = request.url.path.rsplit("/", 1)[-1]
            if request.method == "GET":
                return httpx.Response(200 if wid in workers else 404, json={})
            if request.method == "DELETE":
                workers.pop(wid, None)
                return httpx.Response(202, json={})
            return httpx.Response(404)
        reg = Registration("http://smg:30000", "smg",
                           lambda: Identity("n", ENDPOINT, ("m",), 4, "local"),
                           lambda: InstanceLoad(0, 0, 4), 0.05,
                           httpx.AsyncClient(transport=httpx.MockTransport(smg)))
        reg.start()
        await until(lambda: calls.count(("GET", "/workers/w-1")) >= 2)
        assert workers["w-1"]["url"] == ENDPOINT
        assert workers["w-1"]["labels"]["instance_id"] == "10.0.0.7:8001:m"
        await reg.deregister()
        assert workers == {} and ("DELETE", "/workers/w-1") in calls
        await reg.close()

        workers["w-1"] = {"url": ENDPOINT}          # listed from before our restart: a 409
        reg = Registration("http://smg:30000", "smg",
                           lambda: Identity("n", ENDPOINT, ("m",), 4, "local"),
                           lambda: InstanceLoad(0, 0, 4), 0.05,
                           httpx.AsyncClient(transport=httpx.MockTransport(smg)))
        reg.start()
        await until(lambda: reg.state == "registered")
        assert reg.api.worker_id == "w-1"
        await reg.deregister()
        assert workers == {}
        await reg.close()
    asyncio.run(go())


def test_endpoint_url():
    assert endpoint_url("127.0.0.1", 8001) == "http://127.0.0.1:8001"
    assert endpoint_url("::1", 8001) == "http://[::1]:8001"
    assert endpoint_url("0.0.0.0", 8001).endswith(":8001")
    assert "0.0.0.0" not in endpoint_url("0.0.0.0", 8001)
    assert endpoint_url("0.0.0.0", 8001, "https://me.example") == "https://me.example"


@pytest.mark.parametrize("value", ["router:30000", "http://", "ftp://r", "http://r:99999",
                                   "http://r:port", "http://r/?x=1", " "])
def test_a_malformed_registry_url_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("PANTHEON_REGISTRY_URL", value)
    with pytest.raises(ValueError, match="PANTHEON_REGISTRY_URL must be an http"):
        settings.registry_url()


def test_registry_settings(monkeypatch):
    monkeypatch.delenv("PANTHEON_REGISTRY_URL", raising=False)
    assert settings.registry_url() is None
    monkeypatch.setenv("PANTHEON_REGISTRY_URL", "http://router:30000/")
    assert settings.registry_url() == "http://router:30000"
    assert settings.registry_kind() == "vllm-router" and settings.heartbeat_s() == 5.0
    assert settings.node_id() == "node0" and settings.registry_transport() == "local"
    monkeypatch.setenv("PANTHEON_REGISTRY_KIND", "SMG")
    assert settings.registry_kind() == "smg"
    for name, value in [("PANTHEON_REGISTRY_KIND", "nginx"), ("PANTHEON_HEARTBEAT_S", "0"),
                        ("PANTHEON_HEARTBEAT_S", "soon")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            getattr(settings, "registry_kind" if "KIND" in name else "heartbeat_s")()
        monkeypatch.delenv(name)


def test_serve_refuses_a_malformed_registry_url_before_starting(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PANTHEON_REGISTRY_URL", "router:30000")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert cli_main(["serve", "--model", str(model), "--port", "1"]) == 1
    assert "PANTHEON_REGISTRY_URL must be an http:// or https:// URL" in capsys.readouterr().err


def test_load_counts_running_and_waiting_over_ready_slots():
    replicas = [Replica("m#1", "cpu", ReplicaState.READY, inflight=8, slots=8),
                Replica("m#2", "cpu", ReplicaState.READY, inflight=3, slots=8),
                Replica("m#3", "cpu", ReplicaState.LOADING, slots=8)]
    model = SimpleNamespace(name="m", replicas=replicas, ready=lambda: replicas[:2])
    adm = Admission()
    adm.queues["m"].extend([object(), object()])
    load = measure(SimpleNamespace(models={"m": model}), adm)
    assert load == InstanceLoad(running=11, waiting=2, capacity=16)
    assert load.get_load() == {"load": 13, "running": 11, "waiting": 2, "capacity": 16}
    (rank,) = load.v1_loads()["loads"]
    assert rank["num_running_reqs"] == 11 and rank["num_waiting_reqs"] == 2
    assert rank["max_running_requests"] == 16 and rank["token_usage"] == 0.6875
