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

from ..common import protocol as p
from ..common.keys import curve_client, server_public


def request_args(args) -> dict:
    if args.admin_command == "load":
        # the server takes absolute paths only: a relative one is the caller's, resolved here
        out = {"path": os.path.abspath(args.path), "name": args.name, "ctx": args.ctx,
               "slots": args.slots}
        if args.dies:
            out["dies"] = args.dies
        return {k: v for k, v in out.items() if v is not None}
    if args.admin_command == "unload":
        out = {"name": args.name, "timeout_s": args.timeout_s}
        if args.die:
            out["die"] = args.die
        return out
    return {}


def bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} layers"


def call(addr: str, cmd: str, args: dict, key: str | None, timeout: float,
         on_progress=None, keys_dir: str | None = None) -> p.AdminReply:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir:                  # CURVE: encrypted to the server; our key is ephemeral
        curve_client(sock, server_public(keys_dir))
    sock.connect(addr)
    try:
        sock.send(p.encode(p.AdminRequest(cmd, args, key or "")))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            msg = p.decode(sock.recv())
            if isinstance(msg, p.LoadProgress):
                if on_progress:
                    on_progress(msg)
                continue
            return msg
        raise TimeoutError(f"no answer from {addr} within {timeout:g} s (is the server "
                           "running? with `serve --keys`, pass --keys DIR)")
    finally:
        sock.close()


def main(args) -> int:
    def progress(msg: p.LoadProgress):
        sys.stderr.write(bar(msg.done, msg.total))
        sys.stderr.flush()
    try:
        reply = call(args.addr, args.admin_command, request_args(args), args.key, args.timeout,
                     progress if sys.stderr.isatty() or args.admin_command == "load" else None,
                     args.keys)
    except (TimeoutError, p.ProtocolError) as exc:
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
