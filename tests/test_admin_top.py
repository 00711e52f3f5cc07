"""`pantheon admin top` against a real server: a snapshot through a pipe, a live view
on a terminal (a pty) that `q` quits."""
import os
import pty
import select
import subprocess
import sys
import time

import httpx
import pytest

from cluster import Server
from pantheon.common.default_model import cached_path

pytestmark = pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")


def admin_addr(srv: Server) -> str:
    return srv.args[srv.args.index("--admin-addr") + 1]


def test_top_prints_one_snapshot_through_a_pipe_and_runs_live_on_a_terminal():
    with Server("--slots", "2", "--ctx", "256") as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert r.status_code == 200
        cmd = [sys.executable, "-m", "pantheon.cli", "admin", "--addr", admin_addr(srv), "top"]
        piped = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert piped.returncode == 0, piped.stderr
        lines = piped.stdout.splitlines()
        assert lines[0].startswith("Pantheon at tcp://127.0.0.1:")
        die = next(line for line in lines if line.startswith("cpu "))
        assert "ready" in die and "/2" in die
        model = next(line for line in lines if line.startswith("SmolLM2-135M-Instruct"))
        fields = model.split()
        assert fields[1] == "1/1" and fields[-1] == "1"          # one request in the minute
        assert float(fields[-4]) > 0 and fields[-3] != "-"        # tok/s and TTFT p50

        leader, follower = pty.openpty()
        proc = subprocess.Popen(cmd + ["--interval", "0.2"], stdin=follower, stdout=follower,
                                stderr=follower, close_fds=True)
        os.close(follower)
        seen, deadline = b"", time.monotonic() + 30
        while not (b"q quits" in seen and b"SmolLM2" in seen) and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                seen += os.read(leader, 65536)
        assert b"q quits" in seen and b"SmolLM2" in seen
        os.write(leader, b"q")
        assert proc.wait(15) == 0
        os.close(leader)


def test_top_says_clearly_when_no_server_answers():
    proc = subprocess.run([sys.executable, "-m", "pantheon.cli", "admin", "--addr",
                           "tcp://127.0.0.1:1", "--timeout", "1", "top"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "not answering at tcp://127.0.0.1:1" in proc.stderr
