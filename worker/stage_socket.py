"""The stage link's sockets: where a split replica's second stage binds, and CURVE on both
ends (worker/stage_link.py runs the link over them).

The frontend's load message says what stage 1 binds (frontend/split_placement.py picks):

- "ipc": a socket file in a folder of its own (mode 0700, removed with the stage; a
  killed worker's by the next tail on the host), when both stages' workers run on one host;
- "tcp": the worker's `--stage-bind HOST[:PORT[-PORT]]`, as llama.cpp's `rpc-server -H
  HOST -p PORT` or vLLM's `VLLM_HOST_IP` name what a peer on another host dials. HOST is
  bound and advertised (0.0.0.0 binds every interface and advertises the address this
  host reaches its frontend from); no HOST: that address; no PORT: any free port. A
  range takes its first free port (a firewall opens the range); none free is a load
  error naming it;
- a whole address: bound as given (benchmarks, tests).

CURVE: stage 1 serves with its worker's own key pair and lets in one key, stage 0's
worker's (ZAP, in a context of its own); stage 0 dials with its worker's pair. The
frontend sends public keys only: no secret crosses any link.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import zmq
from zmq.auth.thread import ThreadAuthenticator

from ..common.keys import KeyPair, curve_client, curve_server
from ..common.stage_bind import StageBind

log = logging.getLogger("pantheon.worker.stage")

ZAP_DOMAIN = "stage"
IPC_PREFIX = "pantheon-link-"    # + the worker's pid: a killed worker's folder is swept
HEARTBEAT_MS = 1000              # a tcp link's ZMTP heartbeat (the head's end)


class StageError(RuntimeError):
    """The stage link failed: the peer is gone, slow past the timeout, or refused."""


class StageLinkError(StageError):
    """The stage link cannot be set up: a port in use, keys missing, a refused handshake
    (the load fails with protocol.STAGE_LINK)."""


@dataclass(frozen=True)
class StageNet:
    """What a worker's stage links need of it: its CURVE pair, its bind, its frontend."""

    pair: KeyPair | None = None
    bind: StageBind = StageBind()
    frontend: str = ""                        # the frontend's address (the default host)


def route_address(frontend: str) -> str:
    """The address this host reaches `frontend` from (what a peer that reaches the
    frontend's network most likely reaches us by); loopback for an ipc frontend."""
    scheme, _, rest = frontend.partition("://")
    if scheme != "tcp":
        return "127.0.0.1"
    host = rest[1:rest.find("]")] if rest.startswith("[") else rest.rsplit(":", 1)[0]
    host = host.split(";")[-1]
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)                   # no packet: only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def endpoint(host: str, port) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class TailAuth:
    """ZAP for one tail's socket: its own context, one key let in."""

    def __init__(self, allowed: str):
        self.allowed = allowed.encode()
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx, log=log.getChild("zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, self)
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.allowed:
            return True
        if not self.refused:
            log.warning("stage link: refused a peer with public key %s (not the first "
                        "stage's worker)", key.decode(errors="replace"))
        self.refused += 1
        return False

    def close(self) -> None:
        self.auth.stop()
        self.ctx.term()


class TailSocket:
    """Stage 1's bound ROUTER: made before its weights are read, so a port in use or
    missing keys fail the load at once. `address` is what stage 0 dials."""

    def __init__(self, stage, max_bytes: int, net: StageNet = StageNet()):
        self.folder: Path | None = None
        self.auth: TailAuth | None = None
        if stage.server_key:
            if net.pair is None:
                raise StageLinkError("keys missing: the load asks for a CURVE stage link and "
                                     "this worker has no keys (pantheon worker --keys DIR)")
            if net.pair.public.decode() != stage.server_key:
                raise StageLinkError("the load names another server key than this worker's "
                                     "own (its --keys changed since it joined?)")
            if not stage.client_key:
                raise StageLinkError("keys missing: a CURVE stage link needs the first "
                                     "stage's public key")
            self.auth = TailAuth(stage.client_key)
        ctx = self.auth.ctx if self.auth else zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)   # a larger frame: its peer dropped
        if self.auth:
            curve_server(self.sock, net.pair, ZAP_DOMAIN)
        try:
            self.address = self.bind(stage.link, net)
        except BaseException:
            self.close()
            raise

    def bind(self, what: str, net: StageNet) -> str:
        if what == "ipc":
            sweep_orphans()
            self.folder = Path(tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-"))  # 0700
            address = f"ipc://{self.folder}/link"
            self.sock.bind(address)
            return address
        if what != "tcp":                          # a whole address
            try:
                self.sock.bind(what)
            except zmq.ZMQError as exc:
                raise StageLinkError(f"the stage link {what} cannot be bound: {exc}") from None
            return self.sock.last_endpoint.decode()
        host = net.bind.host or route_address(net.frontend)
        told = route_address(net.frontend) if host in ("0.0.0.0", "::", "*") else host
        if net.bind.ports is None:
            try:
                self.sock.bind(endpoint(host, "*"))
            except zmq.ZMQError as exc:
                raise StageLinkError(f"the stage link cannot bind {host}: {exc} "
                                     "(--stage-bind)") from None
            return endpoint(told, self.sock.last_endpoint.decode().rsplit(":", 1)[1])
        low, high = net.bind.ports
        last = None
        for port in range(low, high + 1):
            try:
                self.sock.bind(endpoint(host, port))
                return endpoint(told, port)
            except zmq.ZMQError as exc:
                last = exc
                if exc.errno != errno.EADDRINUSE:
                    break
        where = f"{host}:{low}" + (f"-{high}" if high > low else "")
        why = ("in use" if high == low else "all in use") if last.errno == errno.EADDRINUSE \
            else str(last)
        raise StageLinkError(f"the stage link cannot bind tcp {where}: {why} "
                             "(the worker's --stage-bind)")

    def close(self) -> None:
        self.sock.close(0)
        if self.auth is not None:
            threading.Thread(target=self.auth.close, daemon=True).start()   # ctx.term waits
            self.auth = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def sweep_orphans() -> None:
    """Remove the ipc folders of tails whose worker was killed (SIGKILL closes nothing):
    each folder is named after its worker's pid, and only a dead pid's go."""
    for folder in Path(tempfile.gettempdir()).glob(f"{IPC_PREFIX}*-*"):
        pid = folder.name[len(IPC_PREFIX):].split("-", 1)[0]
        try:
            ours = folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if ours and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def head_socket(stage, max_bytes: int, net: StageNet = StageNet(),
                context: zmq.Context | None = None) -> zmq.Socket:
    """Stage 0's DEALER, CURVE with its worker's pair when the load names a server key."""
    if stage.server_key and net.pair is None:
        raise StageLinkError("keys missing: the load asks for a CURVE stage link and this "
                             "worker has no keys (pantheon worker --keys DIR)")
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if stage.link.startswith("tcp://"):
        # a peer host that vanishes (power, network) sends no FIN: libzmq's heartbeats
        # (answered by the tail's I/O thread, however long its step) close the connection,
        # so the step fails within seconds instead of LINK_TIMEOUT_S
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * HEARTBEAT_MS)
    if stage.server_key:
        curve_client(sock, stage.server_key.encode(), net.pair)
    return sock
