"""What the frontend refuses to expose, and how it authenticates its ZeroMQ peers.

On loopback (and `ipc://`) everything stays as it always was: keyless and open to
this host's users. Off loopback nothing is open by default:

- `Exposure.problems` lists each bind that would be reachable from other hosts
  without its guard (the HTTP API without an API key, the HTTP admin routes or the
  admin socket without an admin key, the worker link or the admin socket without
  CURVE keys); `serve` refuses to start on any, unless `--insecure`, which then logs
  each one as a warning at every start.
- `LinkAuth` is the CURVE side of the frontend (ZAP through pyzmq's asyncio
  authenticator), on both ZeroMQ sockets whenever `--keys DIR` is given, on
  loopback too. A worker joins only with a public key in the allow list
  (DIR/authorized/, reread when a key in it is added, removed or rewritten) or with the server's own pair
  (the workers this frontend spawns read its keys folder, as it does). The admin
  socket takes any client key: the channel is encrypted, the admin token
  authenticates.
- `ModelDirs` confines `/admin/models/load` to the model folders.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..common import keys
from ..common.keys import is_local_address, is_loopback_host

log = logging.getLogger("pantheon.frontend.security")

WORKER_DOMAIN = "workers"
ADMIN_DOMAIN = "admin"


@dataclass(frozen=True)
class Exposure:
    """The binds of one `serve`, and what guards them."""

    host: str
    worker_addr: str
    admin_addr: str
    api_key: str | None
    admin_key: str | None
    keys_dir: str | None
    http_admin: bool = True
    spawn: bool = True          # False: --no-spawn, every worker is an external one

    def problems(self) -> list[str]:
        out = []
        if not is_loopback_host(self.host):
            if not self.api_key:
                out.append(f"--host {self.host} is reachable from other hosts and no API key "
                           "is set: pass --api-key KEY (or PANTHEON_API_KEY)")
            if self.http_admin and not self.admin_key:
                out.append(f"--host {self.host} exposes the /admin/ routes (which load model "
                           "files) and no admin key is set: pass --admin-key KEY (or "
                           "PANTHEON_ADMIN_KEY), or --no-http-admin")
        if not is_local_address(self.admin_addr):
            if not self.admin_key:
                out.append(f"--admin-addr {self.admin_addr} is reachable from other hosts and "
                           "no admin key is set: pass --admin-key KEY (or PANTHEON_ADMIN_KEY)")
            if not self.keys_dir:
                out.append(f"--admin-addr {self.admin_addr} is reachable from other hosts and "
                           "would carry the admin key in clear: pass --keys DIR (CURVE; "
                           "`pantheon keys generate DIR` writes it)")
        if not is_local_address(self.worker_addr) and not self.keys_dir:
            out.append(f"--worker-addr {self.worker_addr} is reachable from other hosts: any "
                       "process there could join as a worker and receive prompts; pass --keys "
                       "DIR (CURVE; `pantheon keys generate DIR` writes it)")
        elif not self.keys_dir and not self.spawn:   # no worker could ever prove itself
            out.append("--no-spawn and the worker link has no keys: workers this server did "
                       "not spawn (`pantheon worker`) are refused, on loopback too; pass "
                       "--keys DIR (CURVE; `pantheon keys generate DIR`, and the workers' "
                       "--keys) to let them in, or --insecure to let any process on this "
                       "host join as a worker")
        return out


def enforce(problems: list[str], insecure: bool) -> None:
    """Refuse to start on any problem, or (with --insecure) warn of each."""
    if problems and not insecure:
        raise RuntimeError("refusing to start:\n  - " + "\n  - ".join(problems) +
                           "\n  (or --insecure to start anyway, warned at every start)")
    if insecure:
        for problem in problems or ["nothing is exposed without its guard now"]:
            log.warning("--insecure: %s", problem)


class LinkAuth:
    """ZAP for the frontend's CURVE sockets. Started before any socket binds, so no
    handshake is ever judged without it."""

    def __init__(self, keys_dir: str | os.PathLike):
        self.dir = Path(keys_dir)
        self.pair = keys.server_pair(self.dir)
        self.server_key_file = self.dir / f"{keys.SERVER}.key"
        if keys.server_public(self.dir) != self.pair.public:
            raise keys.KeyFileError(f"{self.server_key_file} does not match "
                                    f"{keys.SERVER}.key_secret")
        self.allowed, self.stamp = keys.authorized_keys(self.dir), self.folder_stamp()
        self.refused: set[bytes] = set()        # logged once each
        self.auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None

    def start(self, ctx: zmq.Context) -> None:
        self.auth = zmq.auth.asyncio.AsyncioAuthenticator(ctx, log=log.getChild("zap"))
        self.auth.start()
        for domain in (WORKER_DOMAIN, ADMIN_DOMAIN):
            self.auth.configure_curve_callback(domain, self)
        log.info("CURVE on: workers need a key in %s (%d allowed)",
                 self.dir / keys.AUTHORIZED, len(self.allowed))

    def folder_stamp(self) -> tuple:
        """What changes when a key is added, removed or rewritten in place (a rotated
        key file keeps its name, and the folder's time with it): the files themselves,
        a few hundred bytes each, read at each connection ZAP judges."""
        folder = self.dir / keys.AUTHORIZED
        stamp = []
        for f in sorted(folder.glob("*.key")) if folder.is_dir() else []:
            try:
                if not f.is_file():          # a FIFO would block this loop: not a key
                    continue
                with f.open("rb") as fh:
                    stamp.append((f.name, fh.read(4096)))
            except OSError:
                stamp.append((f.name, b""))
        return tuple(stamp)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question: may the peer with this (z85) public key connect?"""
        if domain == ADMIN_DOMAIN:
            return True                          # the admin token authenticates
        if self.folder_stamp() != self.stamp:    # keys added, removed, rotated: reread
            try:
                self.allowed, self.stamp = keys.authorized_keys(self.dir), self.folder_stamp()
            except keys.KeyFileError as exc:
                log.warning("keeping the old allow list: %s", exc)
        if key in self.allowed or key == self.pair.public:    # or a spawned worker
            return True
        if key not in self.refused and len(self.refused) < 1024:
            self.refused.add(key)
            log.warning("refused a worker connection: public key %s is not in %s",
                        key.decode(errors="replace"), self.dir / keys.AUTHORIZED)
        return False

    async def watch(self, sock: zmq.Socket, what: str) -> None:
        """Log the peers that fail the CURVE handshake on `sock` (no keys, or another
        server's public key: they never reach ZAP), at most once a minute each socket."""
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        failed, since = 0, None
        loop = asyncio.get_running_loop()
        try:
            while True:
                parse_monitor_message(await monitor.recv_multipart())
                failed += 1
                if since is None or loop.time() - since >= 60:
                    log.warning("%d peer(s) failed the CURVE handshake on the %s socket "
                                "(no keys, or another server's key)", failed, what)
                    failed, since = 0, loop.time()
        finally:
            sock.disable_monitor()
            monitor.close(0)

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()


class ModelDirs:
    """The folders `/admin/models/load` may open a model from. A path is judged as
    resolved (symlinks followed), so a link inside a folder cannot point out of it."""

    def __init__(self, dirs: list[str]):
        self.dirs = [Path(d).expanduser().resolve() for d in dirs]

    @classmethod
    def default(cls, cache_dir: Path, model_paths: list[str]) -> "ModelDirs":
        """The cache folder and the folder of each model given at start."""
        return cls([str(cache_dir)] + [str(Path(p).expanduser().resolve().parent)
                                       for p in model_paths])

    def allows(self, path: str) -> bool:
        try:
            real = Path(path).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):   # a loop of links, a NUL byte
            return False
        return any(real == d or real.is_relative_to(d) for d in self.dirs)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


@dataclass(frozen=True)
class BrowserPolicy:
    """What a web page may do with this server (HTTP): by default, nothing.

    - Host: a DNS-rebinding page reaches a loopback server under its own name, so on a
      loopback bind only `localhost`, `127.0.0.1`, `[::1]` (any port) and the bind
      address are accepted, plus `--allowed-hosts`; off loopback the Host is checked
      only when `--allowed-hosts` names some (`*`: no check).
    - Cross-site: a request whose `Origin` is not this server's own and not in
      `--cors-origins`, or that a browser marks `Sec-Fetch-Site: cross-site` /
      `same-site` without such an Origin, is refused; on `/admin/` routes every
      foreign Origin is, whatever `--cors-origins` says.
    - CORS headers only for the origins in `--cors-origins` (`*`: any), never on
      `/admin/`; none at all by default.
    """

    hosts: frozenset[str] | None          # None: any Host
    cors: frozenset[str] = frozenset()

    @classmethod
    def build(cls, bind: str, allowed_hosts: list[str] | None = None,
              cors_origins: list[str] | None = None) -> "BrowserPolicy":
        extra = {h.strip().lower().rstrip(".") for h in allowed_hosts or [] if h.strip()}
        cors = frozenset(o.strip().rstrip("/") for o in cors_origins or [] if o.strip())
        if "*" in extra or (not extra and not is_loopback_host(bind)):
            return cls(None, cors)
        own = f"[{bind.strip('[]')}]" if ":" in bind else bind
        names = extra | set(LOOPBACK_NAMES)
        if own not in ("0.0.0.0", "[::]"):
            names.add(own.lower())
        return cls(frozenset(names), cors)

    def host_allowed(self, host: str | None) -> bool:
        if self.hosts is None:
            return True
        if not host:
            return False
        host = host.strip().lower()
        if host.startswith("["):
            name, _, port = host.partition("]")
            name += "]"
            port = port[1:] if port.startswith(":") else None if not port else "x"
        else:
            name, sep, port = host.partition(":")
            port = port if sep else None
        if port is not None and not port.isdigit():
            return False
        return name.rstrip(".") in self.hosts

    def cors_allowed(self, origin: str | None, path: str) -> bool:
        return origin is not None and not path.startswith("/admin/") and \
            ("*" in self.cors or origin.rstrip("/") in self.cors)

    def cross_site(self, headers: dict, path: str) -> bool:
        """Refuse: a page of another site sent this (see the class's note)."""
        origin, host = headers.get(b"origin"), headers.get(b"host", b"")
        if origin is not None:
            text = origin.decode("latin-1")
            own = text in (f"http://{host.decode('latin-1')}",
                           f"https://{host.decode('latin-1')}")
            return not own and not self.cors_allowed(text, path)
        site = headers.get(b"sec-fetch-site")
        return site is not None and site not in (b"same-origin", b"none")
