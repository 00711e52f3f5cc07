"""A FIFO (or a device) where a model file should be is refused by stat, unopened: a
load of one never blocks, and scans of the cache skip them."""
import os
import subprocess
import sys
import threading

import pytest

from cluster import free_port
from pantheon.common import model_catalog
from pantheon.common.gguf_file import open_gguf, open_gguf_cached
from pantheon.common.model_file import ModelFileError
from pantheon.common.regular_file import NotRegularFile
from pantheon.common.tokenizer import Tokenizer
from pantheon.common.weight_format import tensor_list

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def unblocking(fifo):
    """Opening `fifo` for writing, then closing it, ends any read blocked on it (as
    today's main would block): a failing test then fails instead of hanging."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:                        # no reader: nothing is blocked
        pass


def outcome(call, fifo) -> BaseException | None:
    """What `call()` raised (None if it returned), run where a blocked open cannot hang
    the test: after 10 s the FIFO gets a writer and the test fails."""
    result = []

    def run():
        try:
            call()
            result.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        unblocking(fifo)
        thread.join(10)
        pytest.fail(f"{call} opened the FIFO {fifo} and blocked")
    return result[0]


def test_a_fifo_model_file_is_refused_unopened(tmp_path):
    from pantheon.frontend.registry import open_model
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for call in (lambda: open_model(str(fifo), None, 0), lambda: open_gguf(fifo),
                 lambda: open_gguf_cached(fifo), lambda: tensor_list(fifo)):
        exc = outcome(call, fifo)
        assert isinstance(exc, ValueError) and f"{fifo} is a FIFO" in str(exc), exc
    assert isinstance(outcome(lambda: open_model(str(fifo), None, 0), fifo), ModelFileError)


def test_a_fifo_in_a_model_folder_is_refused_unopened(tmp_path):
    from pantheon.frontend.registry import open_model
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        if name != "config.json":
            os.mkfifo(folder / name)
        else:
            (folder / name).unlink()
            os.mkfifo(folder / name)
        fifo = folder / name
        exc = outcome(lambda: open_model(str(folder), None, 0), fifo)
        assert isinstance(exc, ModelFileError) and f"{fifo} is a FIFO" in str(exc), exc
    exc = outcome(lambda: Tokenizer.from_hf_dir(tmp_path / "tokenizer-json"),
                  tmp_path / "tokenizer-json" / "tokenizer.json")
    assert isinstance(exc, NotRegularFile)


def test_cache_scans_skip_fifos(tmp_path, monkeypatch):
    monkeypatch.setenv("PANTHEON_CACHE_DIR", str(tmp_path))
    (tmp_path / "models").mkdir()
    fifo = tmp_path / "models" / "stray.gguf"
    os.mkfifo(fifo)
    (tmp_path / "models" / "real.gguf").write_bytes(b"GGUF")
    assert outcome(model_catalog.listing, fifo) is None            # returned, unblocked
    names = [row.path.name for row in model_catalog.listing()]
    assert "real.gguf" in names and "stray.gguf" not in names


def test_serve_with_a_fifo_model_says_so_and_exits(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    try:
        done = subprocess.run([sys.executable, "-m", "pantheon.cli", "serve", "--model",
                               str(fifo), "--port", str(free_port()), "--worker-addr",
                               f"tcp://127.0.0.1:{free_port()}", "--admin-addr",
                               f"tcp://127.0.0.1:{free_port()}"],
                              capture_output=True, text=True, timeout=60)
    finally:
        unblocking(fifo)
    assert done.returncode == 1 and f"{fifo} is a FIFO" in done.stderr, done.stderr[-2000:]
