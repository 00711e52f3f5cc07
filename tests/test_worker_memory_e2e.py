"""A worker gives an unloaded model's memory back: load / unload cycles through the admin
HTTP API leave its RSS where the first cycle left it, and /admin/dies reports that real
use beside the reserved bytes."""
import time

import httpx
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
SMOL = str(cached_path())
KEY = "admin-secret"
NAME = "SmolLM2-135M-Instruct"
CYCLES = 3


@pytest.fixture(scope="module")
def server():
    with Server("--ctx", "256", "--slots", "1", "--admin-key", KEY) as srv:
        yield srv


def admin(srv, path, body=None):
    headers = {"Authorization": f"Bearer {KEY}"}
    if body is None:
        return httpx.get(f"{srv.url}/admin/{path}", headers=headers, timeout=120)
    return httpx.post(f"{srv.url}/admin/models/{path}", json=body, headers=headers,
                      timeout=120)


def die(srv) -> dict:
    return admin(srv, "dies").json()["dies"][0]


def reported_after(srv, since: float) -> dict:
    """The die's row once a heartbeat sent after `since` (time.monotonic) has arrived."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = die(srv)
        if time.monotonic() - row["heartbeat_age_s"] > since + 0.05:
            return row
        time.sleep(0.1)
    raise TimeoutError("no heartbeat")


def use_it(srv) -> None:
    """A request down the paths that allocate: a prefill, decodes and a JSON grammar (its
    tokenizer is built after the load; waiting for it leaves nothing still being built
    when the unload comes)."""
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
        "model": NAME, "max_tokens": 8, "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "Give a JSON object with a name."}]})
    assert r.status_code == 200, r.text


def test_load_unload_cycles_return_the_memory_and_dies_report_it(server):
    worker = server.workers()[0]
    use_it(server)
    loaded = reported_after(server, time.monotonic())
    weights = loaded["used_bytes"]
    assert loaded["rss_bytes"] > weights > 0           # the real use holds the reserved bytes
    assert admin(server, "unload", {"name": NAME}).status_code == 200
    figures = [worker.memory_info().rss]
    for _ in range(1 + CYCLES):
        r = admin(server, "load", {"path": SMOL, "name": NAME, "ctx": 256, "slots": 1})
        assert r.status_code == 200, r.text
        use_it(server)
        assert admin(server, "unload", {"name": NAME}).status_code == 200
        figures.append(worker.memory_info().rss)
    mb = [round(f / 2**20) for f in figures]
    assert figures[0] < loaded["rss_bytes"] - weights // 2, f"RSS after each unload (MiB): {mb}"
    # each cycle held the model's ~100 MB of weights and its caches: none of it stays. The
    # first cycle sets the mark: a worker's second load keeps a few one-off buffers of the
    # libraries it uses (OpenBLAS, the grammar's tokenizer), ~50 MB whatever the model
    assert figures[-1] <= figures[1] * 1.05 + (8 << 20), f"RSS after each unload (MiB): {mb}"
    row = reported_after(server, time.monotonic())
    assert row["used_bytes"] == 0 and row["models"] == []
    assert abs(row["rss_bytes"] - worker.memory_info().rss) < 32 << 20
