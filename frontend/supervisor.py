"""Worker processes that `pantheon serve` spawns itself, restarted when they die.

(Under supervisord or systemd, `--no-spawn` leaves this to them.) A CPU die
gets its own share of the host's cores; GPU dies are not pinned to cores.

Each process gets a fresh secret in its environment (never on its command line), which
its hello carries back: that is how the pool tells our workers from anyone else on the
link. A worker the pool finds hung (silent, its probes unanswered) is killed here and
started again like any worker that exited.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys

import psutil

from ..common import protocol as p
from ..common import settings
from .workers import WorkerPool

log = logging.getLogger("pantheon.frontend.supervisor")


def die_names(spec: list[str]) -> list[str]:
    """`cpu,cpu,0` → ["cpu", "cpu:1", "0"]: every die id unique."""
    names, seen = [], {}
    for die in spec:
        n = seen.get(die, 0)
        seen[die] = n + 1
        names.append(die if n == 0 else f"{die}:{n}")
    return names


def core_sets(dies: list[str]) -> dict[str, list[int]]:
    """Split this process's cores evenly over the CPU dies."""
    cores = sorted(os.sched_getaffinity(0))
    cpu = [d for d in dies if d.split(":")[0] == "cpu"]
    if not cpu:
        return {}
    share = max(1, len(cores) // len(cpu))
    return {d: cores[(i * share) % len(cores):][:share] for i, d in enumerate(cpu)}


class Supervisor:
    def __init__(self, dies: list[str], frontend_addr: str, pool: WorkerPool, slots: int = settings.SLOTS,
                 extra_args: list[str] | None = None):
        self.dies, self.addr, self.pool, self.slots = dies, frontend_addr, pool, slots
        self.cores = core_sets(dies)
        self.extra = extra_args or []
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.tasks: list[asyncio.Task] = []
        self.stopping = False
        pool.on_hung.append(self.kill)

    def command(self, die: str) -> list[str]:
        cmd = [sys.executable, "-m", "pantheon.cli", "worker", "--die", die,
               "--frontend", self.addr, "--slots", str(self.slots),
               "--parent-pid", str(os.getpid()), *self.extra]
        if die in self.cores:       # CPU dies share the host: cores and RAM are split
            cpu_dies = len(self.cores)
            cmd += ["--cores", ",".join(map(str, self.cores[die])),
                    "--budget-mb", str(psutil.virtual_memory().total // cpu_dies >> 20)]
        return cmd

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.keep_alive(die), name=f"worker-{die}")
                      for die in self.dies]

    async def keep_alive(self, die: str) -> None:
        backoff = 1.0
        loop = asyncio.get_running_loop()
        while not self.stopping:
            proof = secrets.token_urlsafe(32)
            env = {**os.environ, settings.SPAWN_PROOF_ENV: proof}
            proc = await asyncio.create_subprocess_exec(*self.command(die), env=env)
            self.procs[die] = proc
            self.pool.expect(proof, die, proc.pid)   # before its hello can be read
            started = loop.time()
            log.info("spawned worker for die %s (pid %d)", die, proc.pid)
            code = await proc.wait()
            self.pool.spawn_proofs.pop(proof, None)  # its successor gets a new one
            if self.stopping:
                return
            self.pool.process_exited(proc.pid, code)
            if loop.time() - started > 60:      # it had been healthy: restart promptly
                backoff = 1.0
            log.warning("worker for die %s exited with code %s; restarting in %.0f s",
                        die, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    def kill(self, worker) -> None:
        """SIGKILL a spawned worker the pool found hung; keep_alive starts it again."""
        proc = self.procs.get(worker.die)
        if proc is not None and proc.pid == worker.hello.pid and proc.returncode is None:
            log.warning("killing the hung worker for die %s (pid %d)", worker.die, proc.pid)
            proc.send_signal(signal.SIGKILL)

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask every worker to shut down; terminate what does not."""
        self.stopping = True
        for worker in self.pool.live():
            try:                   # a worker whose queue stays full is terminated below
                await asyncio.wait_for(self.pool.send(worker, p.Shutdown()), 1.0)
            except Exception:
                pass
        procs = [proc for proc in self.procs.values() if proc.returncode is None]
        try:
            await asyncio.wait_for(asyncio.gather(*(proc.wait() for proc in procs)), timeout)
        except asyncio.TimeoutError:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
