"""Key files: several keys, comments, a warning when others may read them, reread when
they change, the last keys kept when one goes unreadable; the HTTP guard uses them."""
import asyncio
import logging
import os

import pytest

from pantheon.common import key_set
from pantheon.common.key_set import KeyFileError, KeySet, first_key, read_key_file


def write(path, text, mode=0o600):
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_a_key_file_holds_keys_one_per_line(tmp_path, caplog):
    path = write(tmp_path / "keys", "# clients\nk-one\n\n  k-two  \n")
    with caplog.at_level(logging.WARNING, "pantheon.keys"):
        assert read_key_file(path) == ["k-one", "k-two"]
    assert not caplog.records
    assert first_key(path) == "k-one"
    keys = KeySet(["direct"], path)
    assert keys and all(keys.matches(k) for k in ("k-one", b"k-two", "direct"))
    assert not keys.matches("k-three") and not keys.matches("")


def test_others_reading_a_key_file_is_warned(tmp_path, caplog):
    path = write(tmp_path / "keys", "k\n", 0o644)
    with caplog.at_level(logging.WARNING, "pantheon.keys"):
        read_key_file(path)
    assert "open to other users (mode 644)" in caplog.text and "chmod 600" in caplog.text


def test_an_empty_key_file_refuses_everyone(tmp_path):
    keys = KeySet(path=write(tmp_path / "keys", "# none yet\n"))
    assert keys and not keys.matches("") and not keys.matches("anything")
    with pytest.raises(KeyFileError, match="holds no key"):
        first_key(tmp_path / "keys")


def test_bad_key_files_are_refused_at_start(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read key file"):
        KeySet(path=tmp_path / "missing")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(KeyFileError, match="FIFO"):
            KeySet(path=tmp_path / "fifo")


def test_a_changed_key_file_is_reread_and_a_broken_one_keeps_the_last_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(key_set, "RECHECK_S", 0.0)
    path = write(tmp_path / "keys", "old\n")
    keys = KeySet(path=path)
    assert keys.matches("old") and not keys.matches("new")
    write(tmp_path / "next", "old\nnew\n").replace(path)       # an atomic rotation
    assert keys.matches("new") and keys.matches("old")
    write(path, "new\n")
    assert keys.matches("new") and not keys.matches("old")
    path.unlink()
    assert keys.matches("new")                                  # kept, warned


def test_the_http_guard_takes_keys_from_a_file(tmp_path, monkeypatch):
    from pantheon.frontend.app import Guard
    monkeypatch.setattr(key_set, "RECHECK_S", 0.0)
    path = write(tmp_path / "keys", "k-one\nk-two\n")

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = Guard(app, KeySet(path=path))

    def status(token: str) -> int:
        sent = []

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "GET", "path": "/v1/models",
                 "headers": [(b"authorization", f"Bearer {token}".encode())]}
        asyncio.run(guard(scope, None, send))
        return sent[0]["status"]

    assert status("k-one") == status("k-two") == 200 and status("k-three") == 401
    write(path, "k-three\n")
    assert status("k-three") == 200 and status("k-one") == 401
