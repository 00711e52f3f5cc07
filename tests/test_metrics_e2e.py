"""GET /metrics after real requests: every family moves, parsed by prometheus-client."""
import json
import os
import socket
import threading
import time

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from cluster import Server, free_port
from pantheon.common import protocol as p
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")

NO_EOS = {"2": -100, "0": -100}
HELLO = [{"role": "user", "content": "Say hello."}]


def scrape(srv: Server, **kw) -> dict:
    """{(name, frozenset(labels)): value} of one scrape."""
    r = httpx.get(srv.url + "/metrics", timeout=10, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert found, f"no sample {name}{labels}"
    return sum(found)


def chat(srv, messages, max_tokens, **extra):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=120, headers=extra.pop(
        "headers", {}), json={"model": "m", "messages": messages, "max_tokens": max_tokens,
                              **extra})


def test_every_family_moves_after_real_requests(tmp_path):
    with Server("--slots", "2", "--ctx", "512", "--queue-depth", "1",
                env={"QWEN35_BS_STATS": "1"}) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        m = {"model_name": name}
        before = scrape(srv)
        assert value(before, "pantheon:worker_up", die="cpu") == 1
        assert value(before, "vllm:num_requests_running", **m) == 0
        assert value(before, "pantheon:model_loads_total", outcome="loaded", **m) == 1
        assert value(before, "pantheon:model_load_seconds_count", **m) == 1
        assert value(before, "pantheon:die_memory_used_bytes", die="cpu") > 0
        assert value(before, "pantheon:die_memory_budget_bytes", die="cpu") > \
            value(before, "pantheon:die_memory_used_bytes", die="cpu")

        # a conversation of two turns: the second finds the first in the prefix cache
        first = chat(srv, HELLO, 8, headers={"X-Session-Id": "s1"}, logit_bias=NO_EOS).json()
        turn2 = HELLO + [{"role": "assistant", "content": first["choices"][0]["message"]
                          ["content"]}, {"role": "user", "content": "Again."}]
        second = chat(srv, turn2, 8, headers={"X-Session-Id": "s1"}, logit_bias=NO_EOS).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        # two long streams fill both slots, a third waits, a fourth is refused
        def stream():
            with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json={
                    "model": "m", "messages": HELLO, "max_tokens": 200, "stream": True,
                    "logit_bias": NO_EOS}) as r:
                for _ in r.iter_lines():
                    pass
        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            during = scrape(srv)
            if value(during, "vllm:num_requests_waiting", **m) == 1 and \
                    value(during, "pantheon:die_busy_slots", die="cpu") == 2:
                break
            time.sleep(0.2)
        assert value(during, "vllm:num_requests_running", **m) == 2
        assert value(during, "vllm:num_requests_waiting", **m) == 1
        assert 0 < value(during, "vllm:kv_cache_usage_perc", **m) <= 1
        assert value(during, "pantheon:die_slots", die="cpu") == 2
        refused = chat(srv, HELLO, 2)
        assert refused.status_code == 429
        for t in threads:
            t.join(120)

        after = scrape(srv)
        # the worker's real use holds at least the weights and KV reserved for them
        assert value(after, "pantheon:worker_resident_bytes", die="cpu") > \
            value(after, "pantheon:die_memory_used_bytes", die="cpu")
        grew = lambda name, **ls: value(after, name, **ls) > value(before, name, **ls) \
            if any(n == name for n, _ in before) else value(after, name, **ls) > 0
        for family in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                       "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                       "prompt_tokens_total", "generation_tokens_total",
                       "prefix_cache_queries_total", "prefix_cache_hits_total"):
            assert grew("pantheon:" + family, **m), family
        assert value(after, "pantheon:e2e_request_latency_seconds_count", **m) == 5
        assert value(after, "pantheon:request_success_total", finished_reason="length",
                     **m) == 5
        assert value(after, "pantheon:generation_tokens_total", **m) == 8 + 8 + 3 * 200
        assert value(after, "pantheon:requests_rejected_total", status="429",
                     reason="queue_full", **m) == 1
        assert value(after, "pantheon:step_seconds_count", die="cpu") >= 200
        assert value(after, "pantheon:step_seconds_bucket", die="cpu", le="+Inf") == \
            value(after, "pantheon:step_seconds_count", die="cpu")
        with open(srv.log.name) as fh:
            log = fh.read()
        assert "[bs_stats] die=cpu" in log and " decode=2 " in log

        # a client that goes away mid-stream is a failure, not a success
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
                "model": "m", "messages": HELLO, "max_tokens": 200, "stream": True,
                "logit_bias": NO_EOS}) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                n == "pantheon:request_failure_total" for n, _ in scrape(srv)):
            time.sleep(0.2)
        assert value(scrape(srv), "pantheon:request_failure_total", reason="cancelled", **m) == 1

        # loads and unloads are counted per model
        r = httpx.post(srv.url + "/admin/models/load", timeout=120,
                       json={"path": str(cached_path()), "name": "second"})
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/admin/models/unload", json={"name": "second"}, timeout=60)
        assert r.status_code == 200, r.text
        final = scrape(srv)
        assert value(final, "pantheon:model_loads_total", model_name="second",
                     outcome="loaded") == 1
        assert value(final, "pantheon:model_unloads_total", model_name="second") == 1


def test_metrics_key_when_protected():
    with Server("--slots", "1", "--ctx", "256", "--metrics-auth", api_key="sekret") as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(srv.url + "/metrics", headers=headers, timeout=10)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert scrape(srv, headers=srv.headers())
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_metrics_are_public_by_default_even_with_an_api_key():
    with Server("--slots", "1", "--ctx", "256", api_key="sekret") as srv:
        assert scrape(srv)
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401


def test_malformed_stats_from_a_peer_are_dropped_and_the_frontend_carries_on():
    with Server("--slots", "1", "--ctx", "256") as srv:
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.IDENTITY, b"rogue" + p.HEARTBEAT_SUFFIX)
        rogue.connect(f"tcp://127.0.0.1:{srv.zport}")
        bad = [b"\xc1garbage", p.encode(p.Heartbeat("cpu", 0, 0, 1, 1, 1, 0, 1))[:-3],
               json.dumps({"v": 1, "k": "heartbeat"}).encode()]
        import msgpack
        bad.append(msgpack.packb({"v": 1, "k": "heartbeat", "die": "cpu", "active": "x",
                                  "waiting": 0, "mem_total": 1, "mem_free": 1,
                                  "host_mem_free": 1, "pressure": 0,
                                  "step_counts": "not a list"}))
        bad.append(p.encode(p.Heartbeat("cpu", 0, 0, 1, 1, 1, 0, os.getpid(),
                                        step_counts=[1, 2, 3])))     # not a worker we know
        for frame in bad:
            rogue.send(frame)
        time.sleep(1.0)
        samples = scrape(srv)
        assert value(samples, "pantheon:worker_up", die="cpu") == 1
        assert chat(srv, HELLO, 3).status_code == 200
        rogue.close()
        ctx.term()
