"""Real `pantheon serve` processes on 127.0.0.1 for end-to-end tests."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil


class Stream(threading.Thread):
    """One streamed chat request, read to its end in a thread; `first` is set at its first
    chunk (or its end). `body` is the request without its stream fields."""

    def __init__(self, url: str, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.headers = url, headers or {}
        self.body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.first, self.events, self.status = threading.Event(), [], None

    def run(self):
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body,
                          headers=self.headers, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
        self.first.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def usage(self) -> dict | None:
        return next((c["usage"] for c in self.chunks() if c.get("usage")), None)

    def error(self) -> dict | None:
        return next((c["error"] for c in self.chunks() if "error" in c), None)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_LOW = 12000
_HIGH = max(_LOW + 1000, min(_ephemeral_low(), 32768))


def _worker_slice(low: int, high: int) -> tuple[int, int]:
    """Under pytest-xdist each worker process takes its own part of the range, so two
    workers never hand out the same port between its check and the server's bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count < 2:
        return low, high
    index, width = int(worker[2:]), (high - low) // count
    return low + index * width, low + (index + 1) * width


_LOW, _HIGH = _worker_slice(_LOW, _HIGH)
_next = [_LOW + os.getpid() % (_HIGH - _LOW)]


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: a port the kernel picked
    there (bind to 0) could be taken by an outgoing connection (a worker's, a client's)
    between this check and the server's own bind (seen once: "Address already in use").
    Ports are handed out in turn, so one test process never gets the same one twice."""
    for _ in range(_HIGH - _LOW):
        _next[0] = _LOW + (_next[0] + 1 - _LOW) % (_HIGH - _LOW)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", _next[0]))
            except OSError:
                continue
            return _next[0]
    raise RuntimeError(f"no free port in {_LOW}-{_HIGH}")


class Server:
    """`pantheon serve ARGS` in its own process group, logging to a temp file."""

    def __init__(self, *args: str, api_key: str | None = None, env: dict | None = None):
        self.port, self.zport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.args = ["serve", "--port", str(self.port),
                     "--worker-addr", f"tcp://127.0.0.1:{self.zport}", *args]
        if "--admin-addr" not in args:
            self.args += ["--admin-addr", f"tcp://127.0.0.1:{free_port()}"]
        if api_key:
            self.args += ["--api-key", api_key]
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(prefix="pantheon-serve-", suffix=".log",
                                               delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> "Server":
        self.launch()
        self.wait_healthy(timeout)
        return self

    def launch(self) -> "Server":
        """Start the process without waiting for it (several start side by side)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", *self.args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as fh:
            return fh.read()[-5000:]

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=kw.pop("timeout", 60), **kw)

    def workers(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "worker" in p.cmdline()]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        if self.proc:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.unlink(self.log.name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


ROUTER_VERSION = "0.1.17"


def router_bin() -> str | None:
    """vllm-router's launcher in this venv, installed from PyPI when absent (bounded);
    None when it cannot be had (offline)."""
    import shutil
    bin_dir = os.path.dirname(sys.executable)
    found = shutil.which("vllm-router", path=bin_dir)
    if found:
        return found
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                        f"vllm-router=={ROUTER_VERSION}"], check=True, timeout=240,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (subprocess.SubprocessError, OSError):
        return None
    return shutil.which("vllm-router", path=bin_dir)


class Router:
    """vllm-router (consistent_hash on X-Session-Id) in its own process group on a free
    port, with a short health interval so a dead instance leaves the ring quickly."""

    def __init__(self, binary: str, *args: str, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [binary, "--host", "127.0.0.1", "--port", str(self.port),
                     "--policy", "consistent_hash", "--prometheus-port", str(free_port()),
                     "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                     "--health-success-threshold", "1", "--log-level", "warning", *args]
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log",
                                               delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> "Router":
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/list_workers", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"router not up after {timeout} s:\n{self.logs()}")

    def workers(self) -> list[str]:
        return httpx.get(self.url + "/list_workers", timeout=5).json()["urls"]

    def healthy(self) -> list[str]:
        listing = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
        return [w["url"] for w in listing if w["is_healthy"]]

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as fh:
            return fh.read()[-5000:]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        os.unlink(self.log.name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
