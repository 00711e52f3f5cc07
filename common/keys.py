"""CURVE key files for the ZeroMQ links, and which addresses need them.

A link that stays on this host (loopback TCP, `ipc://`, `inproc://`) runs keyless, as
it always has. A link off the host is encrypted and authenticated with ZeroMQ CURVE
(libsodium, through pyzmq): the frontend holds the server key pair and an allow list
of worker public keys; each worker holds the server's public key and its own pair.
`pantheon keys generate DIR` writes this layout (files in zmq.auth's certificate
format, secrets mode 0600):

    DIR/server.key              the server's public key (copy it to workers, admins)
    DIR/server.key_secret       the server's key pair: stays with the frontend
    DIR/authorized/NAME.key     worker public keys the frontend accepts
    DIR/NAME/server.key         a worker's folder, `pantheon worker --keys DIR/NAME`:
    DIR/NAME/worker.key           the server's public key and the worker's own pair
    DIR/NAME/worker.key_secret

Workers the frontend spawns itself get DIR and join with the server's own pair.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

SERVER = "server"
WORKER = "worker"
AUTHORIZED = "authorized"


class KeyFileError(ValueError):
    """A keys folder that lacks a file, or holds an unreadable one."""


def is_loopback_host(host: str) -> bool:
    """An HTTP bind address that only this host can reach."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False                       # a host name or "0.0.0.0"-like: reachable


def is_local_address(address: str) -> bool:
    """A ZeroMQ endpoint only this host can reach: ipc://, inproc://, loopback tcp://."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0] if not rest.startswith("[") else rest[1:rest.find("]")]
    return is_loopback_host(host.split(";")[-1])     # tcp://src;dst: the destination


@dataclass(frozen=True)
class KeyPair:
    public: bytes          # z85, 40 bytes
    secret: bytes | None   # z85; None for a public key file


def read_key(path: Path, secret: bool) -> KeyPair:
    if not path.is_file():
        raise KeyFileError(f"key file {path} not found (`pantheon keys generate` writes it)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"key file {path} is unreadable: {exc}") from None
    if len(public) != 40 or secret and (secret_key is None or len(secret_key) != 40):
        raise KeyFileError(f"key file {path} does not hold a CURVE "
                        f"{'key pair' if secret else 'public key'}")
    return KeyPair(public, secret_key)


def server_pair(keys_dir: Path) -> KeyPair:
    return read_key(Path(keys_dir) / f"{SERVER}.key_secret", secret=True)


def server_public(keys_dir: Path) -> bytes:
    return read_key(Path(keys_dir) / f"{SERVER}.key", secret=False).public


def worker_pair(keys_dir: Path) -> KeyPair:
    """A worker folder's own pair; in the frontend's folder, the server's pair (what a
    worker the frontend spawns joins with: it reads the secret the frontend reads)."""
    own = Path(keys_dir) / f"{WORKER}.key_secret"
    if not own.exists() and (Path(keys_dir) / f"{SERVER}.key_secret").exists():
        return server_pair(keys_dir)
    return read_key(own, secret=True)


def authorized_keys(keys_dir: Path) -> set[bytes]:
    """The worker public keys in DIR/authorized/ (an absent folder: none)."""
    folder = Path(keys_dir) / AUTHORIZED
    if not folder.is_dir():
        return set()
    return {read_key(f, secret=False).public for f in sorted(folder.glob("*.key"))}


def write_pair(folder: Path, name: str) -> Path:
    """A new key pair as folder/name.key and folder/name.key_secret (0600)."""
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return Path(public)


def worker_folder(folder: Path, server_key_file: Path) -> Path:
    """A worker's folder: the server's public key and a new pair of its own; returns
    the worker's public key file."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=False)
    shutil.copyfile(server_key_file, folder / f"{SERVER}.key")
    return write_pair(folder, WORKER)


def generate(keys_dir: Path, workers: list[str]) -> list[str]:
    """Write the layout above (the server pair only if absent; each named worker anew).
    Returns what it wrote, one line each."""
    keys_dir = Path(keys_dir)
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    wrote = []
    if not (keys_dir / f"{SERVER}.key_secret").exists():
        write_pair(keys_dir, SERVER)
        wrote.append(f"server key pair: {keys_dir / SERVER}.key, {SERVER}.key_secret")
    for name in workers:
        if not name or "/" in name or name.startswith(".") or name in (SERVER, AUTHORIZED):
            raise KeyFileError(f"bad worker name {name!r}")
        target = keys_dir / name
        if target.exists():
            raise KeyFileError(f"{target} already exists; pick another worker name")
        public = worker_folder(target, keys_dir / f"{SERVER}.key")
        (keys_dir / AUTHORIZED).mkdir(exist_ok=True)
        shutil.copyfile(public, keys_dir / AUTHORIZED / f"{name}.key")
        wrote.append(f"worker {name}: {target}/ (give it to `pantheon worker --keys`), "
                     f"allowed as {keys_dir / AUTHORIZED / name}.key")
    return wrote


def curve_client(sock: zmq.Socket, server_key: bytes, pair: KeyPair | None = None) -> None:
    """Make `sock` a CURVE client of the server with public key `server_key` (an
    ephemeral pair when `pair` is None: encryption without a known client)."""
    if pair is None:
        public, secret = zmq.curve_keypair()
        pair = KeyPair(public, secret)
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_serverkey = server_key


def curve_server(sock: zmq.Socket, pair: KeyPair, domain: str) -> None:
    """Make `sock` a CURVE server; its peers' keys are judged by the ZAP `domain`."""
    sock.zap_domain = domain.encode()
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_server = True
