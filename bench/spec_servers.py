"""Prompt lookup served, side by side with llama-server's: one stream, over HTTP.

    python -m pantheon.bench.spec_servers -m MODEL.gguf --llama-bin BIN_DIR [--rounds 3]

Starts, one at a time on 127.0.0.1, `llama-server` without and with `--spec-type
ngram-simple`, and `pantheon serve` without and with `--spec ngram`, each on the same
file with 2 threads (llama-server `-t`; Pantheon's worker has the host's cores), one
slot, greedy. Each answers `bench spec`'s edit workload (a ~400-token file, "rename and
return the whole file": the reply repeats the prompt) and its chat workload, streamed
with usage; decode tok/s is (completion tokens - 1) over the time from the first
content to the last. Prints one JSON object: per server and mode the medians, and the
speedups with / without.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .spec import workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")


def one_stream(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    usage = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    tokens = usage["completion_tokens"] if usage else 0
    return {"tokens": tokens,
            "decode_tok_s": (tokens - 1) / (last - first) if first and last > first else 0.0}


def measure(url: str, model: str, prompts: dict, rounds: int, max_tokens: int) -> dict:
    one_stream(url, model, "Say hi.", 8)                         # warm-up
    out = {}
    for kind, prompt in prompts.items():
        runs = [one_stream(url, model, prompt, max_tokens) for _ in range(rounds)]
        out[kind] = {"decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
                     "tokens": statistics.median(r["tokens"] for r in runs)}
    return out


def run_server(cmd: list[str], url: str, log: Path, env=None):
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        wait_healthy(url, proc)
    except Exception:
        proc.kill()
        raise
    return proc, fh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pantheon.bench.spec_servers", description=__doc__)
    ap.add_argument("-m", "--model", required=True, help="a GGUF file")
    ap.add_argument("--llama-bin", required=True, help="the folder holding llama-server")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    model = str(Path(args.model).resolve())
    prompts = {"edit": workload("edit", 1)[0], "chat": workload("chat", 1)[0]}
    logs = Path(tempfile.mkdtemp(prefix="spec-servers-"))
    servers = {
        "llama-server": lambda port, on: [
            str(Path(args.llama_bin) / "llama-server"), "-m", model, "-t", str(args.threads),
            "-c", "4096", "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
            + (["--spec-type", "ngram-simple"] if on else []),
        "pantheon": lambda port, on: [
            sys.executable, "-m", "pantheon.cli", "serve", "--model", model, "--port",
            str(port), "--slots", "1", "--ctx", "4096", "--worker-addr",
            f"tcp://127.0.0.1:{free_port()}", "--admin-addr",
            f"tcp://127.0.0.1:{free_port()}"] + (["--spec", "ngram"] if on else []),
    }
    result = {"model": model, "threads": args.threads, "rounds": args.rounds,
              "max_tokens": args.max_tokens, "servers": {}}
    for name, build in servers.items():
        figures = {}
        for on in (False, True):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            mode = "spec" if on else "off"
            proc, fh = run_server(build(port, on), url, logs / f"{name}-{mode}.log",
                                  env={**os.environ, "PANTHEON_LOG_FORMAT": "text"})
            try:
                figures[mode] = measure(url, Path(model).stem, prompts, args.rounds,
                                        args.max_tokens)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                fh.close()
            print(json.dumps({name: {mode: figures[mode]}}), file=sys.stderr, flush=True)
        figures["speedup"] = {kind: round(figures["spec"][kind]["decode_tok_s"]
                                          / max(figures["off"][kind]["decode_tok_s"], 1e-9), 2)
                              for kind in prompts}
        result["servers"][name] = figures
    result["load_avg"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
