"""`pantheon admin …`: the ops client of the frontend's ZeroMQ admin socket.

Prints the server's JSON answer; while a load runs, a progress bar on
stderr. Exits 0 on success, 1 with the server's message otherwise.
"""
from __future__ import annotations

import json
import os
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..common import protocol as p
from ..common.keys import curve_client, server_public


def request_args(args) -> dict:
    if args.admin_command == "load":
        # the server takes absolute paths only: a relative one is the caller's, resolved here
        out = {"path": os.path.abspath(args.path), "name": args.name, "ctx": args.ctx,
               "slots": args.slots, "kv_cache": getattr(args, "kv_cache", None),
               "kv_cache_k": getattr(args, "kv_cache_k", None),
               "kv_cache_v": getattr(args, "kv_cache_v", None)}
        if args.dies or getattr(args, "dies_split", None):
            out["dies"] = (args.dies or []) + (getattr(args, "dies_split", None) or [])
        if getattr(args, "split", None) is not None:
            out["split"] = [args.split]
        if getattr(args, "link", None):
            out["link"] = args.link
        if args.pin:
            out["pin"] = True
        if getattr(args, "no_evict", False):
            out["evict"] = False
        if args.activations:
            out["activations"] = args.activations
        out = {k: v for k, v in out.items() if v is not None}
        if args.spec is not None or args.draft_model or args.spec_n or args.spec_k:
            kind = args.spec if args.spec is not None else ("draft" if args.draft_model
                                                            else "ngram")
            spec = {"kind": kind, "n": args.spec_n, "k": args.spec_k,
                    "draft": os.path.abspath(args.draft_model) if args.draft_model else None}
            # "none": this replica decodes without speculation whatever the server's is
            out["spec"] = None if kind in ("", "none") else \
                {k: v for k, v in spec.items() if v is not None}
        return out
    if args.admin_command == "unload":
        if args.name is None and args.replica_id is None:
            raise SystemExit("error: admin unload takes a NAME, or --id REPLICA")
        out = {"name": args.name, "id": args.replica_id, "die": args.die,
               "timeout_s": args.timeout_s}
        return {k: v for k, v in out.items() if v is not None}
    return {}


def bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} layers"


# commands that may run long on a live server: they wait as long as its socket answers
LONG = ("load", "unload")
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def not_answering(addr: str, timeout: float) -> TimeoutError:
    return TimeoutError(f"the server is not answering at {addr} (waited {timeout:g} s; is it "
                        "running there? --addr or PANTHEON_ADMIN_ADDR names another)")


def call(addr: str, cmd: str, args: dict, key: str | None, timeout: float,
         on_progress=None, keys_dir: str | None = None) -> p.AdminReply:
    """One admin command. Nobody answering at `addr` (no ZeroMQ handshake) within `timeout`
    is a TimeoutError naming it; a short command's reply is due within `timeout` too; a load
    or unload waits for its reply as long as the server's socket answers ZeroMQ heartbeats,
    which its I/O thread does however long the command runs."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(int(timeout * 1000), 1000))
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
    if keys_dir:                  # CURVE: encrypted to the server; our key is ephemeral
        curve_client(sock, server_public(keys_dir))
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                      | HANDSHAKE_FAILED)
    sock.connect(addr)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    answered = False              # the server's socket completed the handshake
    deadline = time.monotonic() + timeout
    try:
        # the token in a frame of its own: the server checks it before reading the request
        sock.send_multipart([(key or "").encode(), p.encode(p.AdminRequest(cmd, args))])
        while True:
            if time.monotonic() > deadline and not (answered and cmd in LONG):
                if not answered:
                    raise not_answering(addr, timeout)
                raise TimeoutError(f"the server at {addr} did not answer `{cmd}` within "
                                   f"{timeout:g} s")
            ready = dict(poller.poll(100))
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    answered = True
                elif event & HANDSHAKE_FAILED:
                    raise ConnectionError(f"the handshake with {addr} failed (with `serve "
                                          "--keys`, pass --keys DIR)")
                elif answered:    # gone, or silent past the heartbeat timeout
                    raise ConnectionError(f"the server at {addr} stopped answering")
            if sock in ready:
                msg = p.decode(sock.recv())
                if isinstance(msg, p.LoadProgress):
                    if on_progress:
                        on_progress(msg)
                    continue
                return msg
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


def main(args) -> int:
    def progress(msg: p.LoadProgress):
        sys.stderr.write(bar(msg.done, msg.total))
        sys.stderr.flush()
    try:
        reply = call(args.addr, args.admin_command, request_args(args), args.key, args.timeout,
                     progress if sys.stderr.isatty() or args.admin_command == "load" else None,
                     args.keys)
    except (TimeoutError, ConnectionError, p.ProtocolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.admin_command == "load":
        sys.stderr.write("\n")
    if reply.status != 200:
        message = (reply.body.get("error") or {}).get("message", reply.body)
        print(f"error ({reply.status}): {message}", file=sys.stderr)
        return 1
    print(json.dumps(reply.body, indent=2))
    return 0
