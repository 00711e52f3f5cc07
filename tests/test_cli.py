"""The `pantheon` command, run as a real subprocess."""
import json
import os
import subprocess
import sys

import pytest

import tiny_models as tm
from pantheon.common.default_model import cached_path


def pantheon(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "pantheon.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


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


@pytest.mark.parametrize("value", ["1", "yes"])
def test_serve_refuses_to_ship_full_logits_to_the_host(value):
    """The spec's QWEN35_GPU_FULL_LOGITS: refused before anything starts or binds."""
    proc = pantheon("serve", "--port", "0", env=dict(os.environ, QWEN35_GPU_FULL_LOGITS=value),
                    timeout=60)
    assert proc.returncode == 1
    assert "QWEN35_GPU_FULL_LOGITS" in proc.stderr and "samples on the die" in proc.stderr
    assert "full-vocabulary logits" in proc.stderr and "K80" in proc.stderr
    assert "Traceback" not in proc.stderr and "ready" not in proc.stdout
