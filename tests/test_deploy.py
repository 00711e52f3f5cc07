"""deploy/supervisord.conf, really started: frontend + worker under supervisord."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from cluster import free_port
from pantheon.common.default_model import cached_path

CONF = Path(__file__).resolve().parents[1] / "deploy" / "supervisord.conf"
pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")


def healthy(url, timeout=90) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


def stop(sup: subprocess.Popen) -> None:
    """Stop supervisord (it drains what it runs), then kill whatever is left of its group."""
    sup.send_signal(signal.SIGTERM)
    try:
        sup.wait(30)                      # a supervisord that does not stop fails the test
    finally:
        try:
            os.killpg(sup.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_of(sup: psutil.Process) -> psutil.Process:
    (worker,) = [p for p in sup.children(recursive=True) if "worker" in p.cmdline()]
    return worker


def test_supervisord_runs_and_restarts_the_cluster(tmp_path):
    pytest.importorskip("supervisor")
    port = free_port()
    keys = subprocess.run([sys.executable, "-m", "pantheon.cli", "keys", "generate",
                           str(tmp_path / "keys")], capture_output=True, text=True)
    assert keys.returncode == 0, keys.stderr
    env = {**os.environ, "PANTHEON_BIN": str(Path(sys.executable).parent),
           "PANTHEON_PORT": str(port), "PANTHEON_RUN": str(tmp_path),
           "PANTHEON_WORKER_ADDR": f"tcp://127.0.0.1:{free_port()}",
           "PANTHEON_ADMIN_ADDR": f"tcp://127.0.0.1:{free_port()}",
           "PANTHEON_KEYS_DIR": str(tmp_path / "keys")}
    sup = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(CONF)],
                           env=env, cwd=tmp_path, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert healthy(url), (tmp_path / "frontend.log").read_text()[-3000:]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
        first = worker_of(psutil.Process(sup.pid))
        first.kill()                                   # supervisord brings it back
        first.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:             # the restarted worker, loaded again
            try:
                health = httpx.get(url + "/health", timeout=2)
                dies = httpx.get(url + "/admin/dies", timeout=2)        # /health has no pids
                workers = dies.json().get("dies", []) if health.status_code == 200 else []
                if workers and workers[0]["pid"] == worker_of(psutil.Process(sup.pid)).pid \
                        != first.pid:
                    break
            except (ValueError, httpx.HTTPError):
                pass
            time.sleep(0.2)
        # the new worker is known before its model is loaded again: a 503 (model_not_ready)
        # until then, as a client retrying after Retry-After sees it
        while True:
            r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        # stopping supervisord drains: the frontend stops first, its stream completes
        stream = {**chat, "max_tokens": 40, "stream": True, "logit_bias": {"2": -100, "0": -100},
                  "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/chat/completions", json=stream,
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            sup.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        usage = [json.loads(e)["usage"] for e in events[:-1] if '"usage"' in e]
        assert usage and usage[-1]["completion_tokens"] == 40, events[-3:]
        assert sup.wait(60) == 0
        log = (tmp_path / "frontend.log").read_text()
        assert "draining" in log and "every request finished" in log, log[-2000:]
    finally:
        stop(sup)


ROUTER_CONF = CONF.parent / "supervisord-router.conf"


def test_supervisord_runs_two_instances_behind_the_router(tmp_path):
    pytest.importorskip("supervisor")
    from cluster import router_bin
    if router_bin() is None:
        pytest.skip("vllm-router==0.1.17 is not installed and `pip install` failed (offline?)")
    ports = {k: free_port() for k in ("ROUTER_PORT", "ROUTER_METRICS_PORT", "PORT_A", "PORT_B")}
    env = {**os.environ, "PANTHEON_BIN": str(Path(sys.executable).parent),
           "PANTHEON_RUN": str(tmp_path), **{f"PANTHEON_{k}": str(v) for k, v in ports.items()}}
    env.pop("PANTHEON_REGISTRY_URL", None)
    sup = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c",
                            str(ROUTER_CONF)], env=env, cwd=tmp_path, start_new_session=True)
    router = f"http://127.0.0.1:{ports['ROUTER_PORT']}"
    instances = sorted(f"http://127.0.0.1:{ports[k]}" for k in ("PORT_A", "PORT_B"))

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in tmp_path.glob("*.log"))
    try:
        deadline = time.monotonic() + 120
        while True:                                # both instances joined by themselves
            assert time.monotonic() < deadline, logs()
            try:
                listed = httpx.get(router + "/workers", timeout=2).json()["workers"]
                if sorted(w["url"] for w in listed if w["is_healthy"]) == instances:
                    break
            except (ValueError, KeyError, httpx.HTTPError):
                pass
            time.sleep(0.3)
        messages = [{"role": "user", "content": "Tell me about harbors and lighthouses."}]
        head = {"X-Session-Id": "deploy-1"}
        r1 = httpx.post(router + "/v1/chat/completions", headers=head, timeout=60,
                        json={"messages": messages, "max_tokens": 4})
        assert r1.status_code == 200, r1.text
        messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
        r2 = httpx.post(router + "/v1/chat/completions", headers=head, timeout=60,
                        json={"messages": messages, "max_tokens": 4})
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= r1.json()["usage"]["prompt_tokens"]
        sup.send_signal(signal.SIGTERM)             # instances drain and leave, then the router
        assert sup.wait(60) == 0
        for name in ("pantheon-a.log", "pantheon-b.log"):
            log = (tmp_path / name).read_text()
            assert "registered" in log and "deregistered" in log, logs()
    finally:
        stop(sup)
