"""The `pantheon` command, run as a real subprocess."""
import json
import subprocess
import sys

import pytest

import tiny_models as tm
from pantheon.common.default_model import cached_path


def pantheon(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pantheon.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
def test_run_streams_the_default_models_reply():
    proc = pantheon("run", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."
    assert "tok/s decode" in proc.stderr


def test_bench_engine_prints_the_promised_json(tmp_path):
    path = tm.write_gguf("qwen2", tmp_path / "tiny.gguf")
    proc = pantheon("bench", "engine", "-m", str(path), "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result["decode_tok_s"]) == {"1", "4", "8"}
    for key in ("prefill_tok_s", "floor_tok_s", "peak_rss_bytes"):
        assert result[key] > 0


def test_run_with_a_missing_model_fails_cleanly(tmp_path):
    proc = pantheon("run", "-m", str(tmp_path / "nope.gguf"), "hi")
    assert proc.returncode == 1
    assert "model not found" in proc.stderr and "Traceback" not in proc.stderr
