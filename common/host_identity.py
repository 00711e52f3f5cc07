"""Which host a process runs on, as two workers compare it.

A split replica's two stages share an ipc link only when their workers see the same
filesystem and kernel: the host name (containers on one machine have their own) and the
kernel's boot id (two machines, or a machine and its reboot, never share one; a host name
alone does not tell two cloned VMs apart). Anything else gets a tcp link.
"""
from __future__ import annotations

import socket
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_identity() -> str:
    """`hostname/boot-id`; the host name alone where the kernel has no boot id."""
    try:
        boot = BOOT_ID.read_text(encoding="ascii").strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"[:256]


def same_host(a: str, b: str) -> bool:
    """Two identities of one host (an unknown one, from an older worker, is another)."""
    return bool(a) and a == b
