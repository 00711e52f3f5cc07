"""`pantheon admin top`: a live view of a running server, like htop or nvidia-smi.

One admin-socket call (`top`) per refresh; on a terminal the screen is redrawn every
`--interval` seconds until `q` (curses), which quits at any time; an error (no server
answering within `--timeout`) is shown on the screen; through a pipe, one snapshot is printed.
"""
from __future__ import annotations

import curses
import sys
import threading
import time

from ..common import protocol as p
from .admin_cli import call

FAILURES = (TimeoutError, ConnectionError, RuntimeError, p.ProtocolError)


def gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def render(snap: dict, addr: str) -> list[str]:
    """The screen's lines for one snapshot."""
    head = f"Pantheon at {addr}  {time.strftime('%H:%M:%S')}"
    lines = [head + ("  DRAINING" if snap.get("draining") else ""), ""]
    lines.append(f"{'DIE':<8}{'STATE':<7}{'PID':>8}  {'SLOTS':>7}  {'MEMORY GiB':>13}  STEP")
    for d in snap["dies"]:
        step = f"{d['step_s']:.2f} s" if d["step_s"] else "idle"
        lines.append(f"{d['die']:<8}{d['state']:<7}{d['pid']:>8}  "
                     f"{d['busy']:>3}/{d['slots']:<3}  "
                     f"{gib(d['used_bytes']):>6}/{gib(d['budget_bytes']):<6}  {step}")
    lines += ["", f"{'MODEL':<28}{'REPL':>5}{'SLOTS':>9}{'RUN':>5}{'QUEUE':>6}"
                  f"{'TOK/S 1m':>10}{'TTFT p50 1m':>13}{'REQ 1m':>8}"]
    for m in snap["models"]:
        ttft = m.get("ttft_p50_s_1m")
        lines.append(f"{m['name'][:27]:<28}{m['replicas']:>3}/{m['replicas_total']:<1}"
                     f"{m['busy']:>5}/{m['slots']:<3}{m['running']:>5}{m['queued']:>6}"
                     f"{m.get('tokens_per_s_1m', 0):>10.1f}"
                     f"{(f'{ttft:.3f} s' if ttft is not None else '-'):>13}"
                     f"{m.get('requests_1m', 0):>8}")
    if "lifecycle" in snap:                # loads and unloads by reason (autoload.py)
        life = snap["lifecycle"]

        def counts(by: dict) -> str:
            return "  ".join(f"{reason} {n}" for reason, n in by.items()) or "none"
        lines += ["", f"LOADS    {counts(life['loads'])}",
                  f"UNLOADS  {counts(life['unloads'])}"]
        if life["loading"]:
            lines.append("LOADING  " + "  ".join(
                f"{name} ({life['waiting'].get(name, 0)} waiting)" for name in life["loading"]))
    return lines


def snapshot(args) -> dict:
    reply = call(args.addr, "top", {}, args.key, args.timeout, keys_dir=args.keys)
    if reply.status != 200:
        message = (reply.body.get("error") or {}).get("message", reply.body)
        raise RuntimeError(f"({reply.status}) {message}")
    return reply.body


class Fetcher:
    """Snapshots in a thread of their own, so that the screen shows at once (connecting,
    then each snapshot or error) and `q` quits at any time, even while no server answers."""

    def __init__(self, args):
        self.args = args
        self.lines = [f"Pantheon at {args.addr}: connecting…"]
        self.version = 0
        self.stop = threading.Event()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                lines = render(snapshot(self.args), self.args.addr)
            except FAILURES as exc:
                lines = [f"Pantheon at {self.args.addr}", "", f"error: {exc}"]
            self.lines, self.version = lines, self.version + 1
            self.stop.wait(self.args.interval)


def live(screen, args) -> None:
    curses.curs_set(0)
    screen.timeout(100)                              # getch: a key or 0.1 s, whichever first
    fetcher, shown = Fetcher(args), None
    try:
        while True:
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return
            if fetcher.version == shown and key != curses.KEY_RESIZE:
                continue
            shown = fetcher.version
            lines = fetcher.lines + ["", "q quits"]
            screen.erase()
            height, width = screen.getmaxyx()
            for y, line in enumerate(lines[:height - 1]):
                screen.addnstr(y, 0, line, width - 1)
            screen.refresh()
    finally:
        fetcher.stop.set()


def main(args) -> int:
    if not (sys.stdout.isatty() and sys.stdin.isatty()) or args.once:
        try:
            print("\n".join(render(snapshot(args), args.addr)))
        except FAILURES as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    curses.wrapper(live, args)
    return 0
