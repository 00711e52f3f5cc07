"""`pantheon serve` with settings or files that cannot serve: exit 1 with one line naming
the setting (or the file's fault), never "ready" with no model."""
import os
import subprocess
import sys

import pytest

import tiny_models as tm
from cluster import free_port


def serve(*args, env=None, timeout=90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pantheon.cli", "serve", "--worker-addr",
         f"tcp://127.0.0.1:{free_port()}", "--admin-addr", f"tcp://127.0.0.1:{free_port()}",
         *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})})


def errors(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tm.write_gguf("qwen2", tmp_path_factory.mktemp("m") / "tiny.gguf", tensor_type="F16")


def test_settings_that_cannot_serve_are_refused_at_once(tiny):
    done = serve("--model", str(tiny), "--slots", "0", "--port", str(free_port()), timeout=30)
    assert done.returncode == 1, done.stderr
    (line,) = errors(done)
    assert "--slots 0" in line and "at least 1 slot" in line
    assert "Traceback" not in done.stderr and "ready" not in done.stdout


@pytest.mark.parametrize("field, value, says", [
    ("ctx", 1, "--ctx 1: a context holds at least 2 positions"),
    ("ctx", -5, "--ctx -5"),
    ("prefill_chunk", 0, "--prefill-chunk 0"),
    ("port", -1, "--port -1 is out of range"),
    ("port", 99999, "--port 99999 is out of range: a TCP port is 1-65535"),  # was a traceback
])
def test_the_serve_config_names_the_flag_it_refuses(field, value, says):
    from pantheon.frontend.serve import ServeConfig
    with pytest.raises(ValueError, match=says):
        ServeConfig(models=[], **{field: value})


def test_a_context_the_memory_cannot_hold_exits_1_saying_what_fits(tiny):
    done = serve("--model", str(tiny), "--port", str(free_port()), "--ctx", "1000000000")
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = errors(done)
    assert "no die has room" in line and "what fits: --ctx" in line
    assert "ready" not in done.stdout


def test_a_model_that_fails_to_load_exits_1_naming_why(tiny, tmp_path):
    """A --model whose weights hold NaN, another that needs the C kernels on a host
    without the compiler: each is one error line, and the server exits 1."""
    nan = tm.poison_gguf(tm.write_gguf("qwen2", tmp_path / "w.gguf"), tmp_path / "nan.gguf",
                         "blk.1.ffn_up.weight")
    done = serve("--model", str(nan), "--model", str(tiny), "--port", str(free_port()),
                 env={"CC": "no-such-cc"})
    assert done.returncode == 1, done.stderr[-3000:]
    poisoned, compiler = errors(done)
    assert "nan.gguf" in poisoned and "tensor blk.1.ffn_up.weight holds NaN or Inf" in poisoned
    assert "tiny.gguf" in compiler and "no C compiler 'no-such-cc'" in compiler
    assert "ready" not in done.stdout


def test_a_truncated_model_file_exits_1_naming_the_tensor_and_the_bytes(tiny, tmp_path):
    cut = tm.truncate_gguf(tiny, tmp_path / "cut.gguf", 5000)
    done = serve("--model", str(cut), "--port", str(free_port()), timeout=30)
    assert done.returncode == 1, done.stderr
    (line,) = errors(done)
    assert "truncated" in line and "tensor blk.1." in line and "bytes" in line
