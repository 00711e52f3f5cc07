"""The keys a guard accepts (the API key, the admin key), and key files.

A key given on the command line (`--api-key`) is readable by every user of the host
in `/proc/PID/cmdline`; a key file (`--api-key-file`) is not, when its mode is 0600.
A key file holds one key per line (blank lines and `#` comments ignored), so a key
is rotated by adding the new one, moving the clients, then removing the old one:
the file is reread when it changes (its inode, size or modification time; looked at
once a second at most), and a file gone unreadable keeps the last keys, warned.
"""
from __future__ import annotations

import hmac
import logging
import os
import stat
import time
from pathlib import Path

from .regular_file import NotRegularFile, require_regular

log = logging.getLogger("pantheon.keys")

MAX_KEY_FILE_BYTES = 1 << 20
RECHECK_S = 1.0


class KeyFileError(ValueError):
    """A key file that cannot be read (missing, not a regular file, too large)."""


def read_key_file(path: str | Path) -> list[str]:
    """The keys of a file, one per line; a warning when others may read it."""
    path = Path(path).expanduser()
    try:
        st = require_regular(path)                # a FIFO would block the read
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"key file {path} is over {MAX_KEY_FILE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, NotRegularFile) as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("key file %s is open to other users (mode %o): chmod 600 %s",
                    path, stat.S_IMODE(st.st_mode), path)
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def first_key(path: str | Path) -> str:
    """A client's key from a file (its first key)."""
    keys = read_key_file(path)
    if not keys:
        raise KeyFileError(f"key file {path} holds no key")
    return keys[0]


class KeySet:
    """Keys given directly plus those of a key file, compared in constant time.

    True when any key is configured, a key file counting even while empty (then no
    token matches: a guard with an emptied file refuses everyone, never opens up)."""

    def __init__(self, keys=(), path: str | Path | None = None):
        self.fixed = [k.encode() for k in keys if k]
        self.path = Path(path).expanduser() if path else None
        self.from_file: list[bytes] = []
        self.stamp: tuple | None = None
        self.checked = 0.0
        if self.path is not None:
            self.from_file = [k.encode() for k in read_key_file(self.path)]   # raises at start
            self.stamp = self.file_stamp()

    @classmethod
    def of(cls, value) -> "KeySet | None":
        """None, one key (a str) or a KeySet, as a KeySet (None when no key is set)."""
        if value is None or isinstance(value, KeySet):
            return value or None
        return cls([value]) if value else None

    def __bool__(self) -> bool:
        return bool(self.fixed) or self.path is not None

    def file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def refresh(self) -> None:
        """Reread the key file if it changed (at most one stat a second)."""
        now = time.monotonic()
        if self.path is None or now - self.checked < RECHECK_S:
            return
        self.checked = now
        stamp = self.file_stamp()
        if stamp == self.stamp:
            return
        try:
            self.from_file = [k.encode() for k in read_key_file(self.path)]
            log.info("key file %s reread: %d key(s)", self.path, len(self.from_file))
        except KeyFileError as exc:
            log.warning("keeping the last keys: %s", exc)
        self.stamp = stamp

    def matches(self, token: bytes | str) -> bool:
        if isinstance(token, str):
            token = token.encode()
        self.refresh()
        found = False
        for key in self.fixed + self.from_file:   # every key compared: no early exit
            found |= hmac.compare_digest(token, key)
        return found
