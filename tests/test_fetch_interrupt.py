"""An interrupted `pantheon models fetch` (Ctrl-C or SIGTERM) stops its pip and removes
its folder; a folder left by a fetch killed outright goes at the next fetch."""
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from pantheon.common import model_catalog


def fetch_until_pip_runs(cache, index_port):
    """`models fetch` against an index that accepts and never answers: pip waits."""
    env = {**os.environ, "PANTHEON_CACHE_DIR": str(cache), "PIP_CONFIG_FILE": os.devnull,
           "PIP_INDEX_URL": f"http://127.0.0.1:{index_port}/simple/", "PIP_RETRIES": "0"}
    for key in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PANTHEON_MODEL"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "pantheon.cli", "models", "fetch",
                             "smollm2-135m"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    for _ in range(150):                             # pip starting takes a second or two
        children = psutil.Process(proc.pid).children()
        if children and list((cache / "models").glob("pantheon-fetch-*")):
            return proc, children[0]
        time.sleep(0.1)
    proc.kill()
    pytest.fail("pip never started")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_fetch_stops_pip_and_removes_its_folder(tmp_path, signum):
    with socket.socket() as index:                   # listens, never answers
        index.bind(("127.0.0.1", 0))
        index.listen(16)
        proc, pip = fetch_until_pip_runs(tmp_path, index.getsockname()[1])
        try:
            proc.send_signal(signum)
            assert proc.wait(20) == 130
        finally:
            proc.kill()
            if pip.is_running():
                pip.kill()
    assert not pip.is_running()
    assert list((tmp_path / "models").iterdir()) == []


def test_folders_of_dead_fetches_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"pantheon-fetch-{dead.pid}-abc").mkdir()
    (tmp_path / f"pantheon-fetch-{dead.pid}-abc" / "x.whl").write_bytes(b"x")
    (tmp_path / f"pantheon-fetch-{os.getppid()}-def").mkdir()      # a live process's
    model_catalog.remove_orphans(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f"pantheon-fetch-{os.getppid()}-def"]
