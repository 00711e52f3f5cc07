"""`pantheon admin top`: a live view of a running server, like htop or nvidia-smi.

One admin-socket call (`top`) per refresh; on a terminal the screen is redrawn every
`--interval` seconds until `q` (curses); through a pipe, one snapshot is printed.
"""
from __future__ import annotations

import curses
import sys
import time

from ..common import protocol as p
from .admin_cli import call


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
    return lines


def snapshot(args) -> dict:
    reply = call(args.addr, "top", {}, args.key, args.timeout, keys_dir=args.keys)
    if reply.status != 200:
        message = (reply.body.get("error") or {}).get("message", reply.body)
        raise RuntimeError(f"({reply.status}) {message}")
    return reply.body


def live(screen, args) -> None:
    curses.curs_set(0)
    screen.timeout(int(args.interval * 1000))        # getch waits at most one interval
    while True:
        try:
            lines = render(snapshot(args), args.addr)
        except (TimeoutError, RuntimeError, p.ProtocolError) as exc:
            lines = [f"Pantheon at {args.addr}: {exc}"]
        lines.append("")
        lines.append("q quits")
        screen.erase()
        height, width = screen.getmaxyx()
        for y, line in enumerate(lines[:height - 1]):
            screen.addnstr(y, 0, line, width - 1)
        screen.refresh()
        if screen.getch() in (ord("q"), ord("Q")):
            return


def main(args) -> int:
    if not (sys.stdout.isatty() and sys.stdin.isatty()) or args.once:
        try:
            print("\n".join(render(snapshot(args), args.addr)))
        except (TimeoutError, RuntimeError, p.ProtocolError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    curses.wrapper(live, args)
    return 0
