"""`pantheon bench serve` against a fake OpenAI-compatible streaming server in a thread."""
import argparse
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from pantheon.bench import serve

CHUNKS = 5           # content chunks per stream
PER_CHUNK = 2        # tokens each content chunk claims to hold (usage says CHUNKS * PER_CHUNK)
FIRST_DELAY = 0.03   # seconds before the first content chunk
GAP = 0.01           # seconds between content chunks


class Fake:
    def __init__(self):
        self.reset()

    def reset(self, fail_every=0, usage=True, sse_error=False):
        self.fail_every, self.usage, self.sse_error = fail_every, usage, sse_error
        self.count = self.active = self.max_active = 0
        self.prompts = []
        self.lock = threading.Lock()


fake = Fake()


def chunk(delta=None, usage=None):
    obj = {"id": "x", "object": "chat.completion.chunk", "model": "fake",
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}]}
    if usage is not None:
        obj["usage"] = usage
    return f"data: {json.dumps(obj)}\n\n"


async def completions(request):
    body = await request.json()
    with fake.lock:
        fake.count += 1
        n = fake.count
        fake.prompts.append(body["messages"][0]["content"])
    assert body["stream"] and body["stream_options"]["include_usage"] and body["temperature"] == 0
    if fake.fail_every and n % fake.fail_every == 0:
        return JSONResponse({"error": {"message": "slow down"}}, status_code=429)

    async def stream():
        with fake.lock:
            fake.active += 1
            fake.max_active = max(fake.max_active, fake.active)
        try:
            yield chunk({"role": "assistant", "content": ""})   # no content: not the first token
            await asyncio.sleep(FIRST_DELAY)
            yield chunk({"reasoning_content": "hm"})             # reasoning counts for TTFT
            for _ in range(CHUNKS - 1):
                await asyncio.sleep(GAP)
                yield chunk({"content": "tok " * PER_CHUNK})
            if fake.sse_error and n % 2 == 0:
                yield f"event: error\ndata: {json.dumps({'error': {'message': 'boom'}})}\n\n"
                return
            if fake.usage:
                yield chunk(usage={"prompt_tokens": 10, "completion_tokens": CHUNKS * PER_CHUNK,
                                   "total_tokens": 10 + CHUNKS * PER_CHUNK})
            yield "data: [DONE]\n\n"
        finally:
            with fake.lock:
                fake.active -= 1
    return StreamingResponse(stream(), media_type="text/event-stream")


SCRAPED = []


async def metrics(request):
    SCRAPED.append(time.monotonic())
    return PlainTextResponse("pantheon:draining 0.0\n")


async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


@pytest.fixture(scope="module")
def url():
    app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/metrics", metrics)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 5
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def level(url, concurrency, requests, **mode):
    fake.reset(**mode)
    out = asyncio.run(serve.run_level(url, "fake-model", concurrency, requests,
                                      lambda i: serve.make_prompt(i, 40, 0), max_tokens=16))
    return out, fake.max_active


def test_metrics_are_scraped_beside_the_load(url):
    fake.reset()
    SCRAPED.clear()
    out = asyncio.run(serve.run_level(url, "fake-model", 2, 6,
                                      lambda i: serve.make_prompt(i, 40, 0), max_tokens=16,
                                      scrape_s=0.01))
    assert out["errors"] == 0 and 1 <= out["scrapes"] <= len(SCRAPED)   # the last one may
    # be cut short when the level ends
    assert out["scrape_ms"] > 0


def test_structure_tokens_and_concurrency(url):
    fake.reset()
    result = serve.run(url, None, [1, 4], None, 16, 40, None, seed=0)
    assert result["model"] == "fake-model" and result["url"] == url and result["max_tokens"] == 16
    assert set(result["summary"]) == {"c1_output_tok_s", "c4_output_tok_s"}
    c1, c4 = result["levels"]
    assert (c1["concurrency"], c1["requests"]) == (1, 4)
    assert (c4["concurrency"], c4["requests"]) == (4, 8)
    assert fake.count == 1 + 4 + 8                      # warmup + both levels
    assert len(set(fake.prompts)) == fake.count         # every prompt distinct
    assert fake.max_active == 4
    for lv in (c1, c4):
        assert lv["errors"] == 0 and lv["error_samples"] == []
        assert lv["completion_tokens"] == lv["requests"] * CHUNKS * PER_CHUNK   # from usage
        assert set(lv["ttft_s"]) == {"p50", "p95", "mean"}
        assert set(lv["itl_s"]) == set(lv["tpot_s"]) == set(lv["request_s"]) == {"p50", "p95"}
        assert FIRST_DELAY * 0.8 <= lv["ttft_s"]["p50"] < 1
        assert GAP * 0.8 <= lv["itl_s"]["p50"] < 0.5
        # per-token time: (CHUNKS - 1) gaps spread over CHUNKS * PER_CHUNK - 1 tokens
        assert lv["tpot_s"]["p50"] < lv["itl_s"]["p50"]
        assert lv["request_s"]["p50"] >= FIRST_DELAY + (CHUNKS - 1) * GAP * 0.8
        assert lv["output_tok_s"] == pytest.approx(lv["completion_tokens"] / lv["wall_s"])
    # four clients at once: the c=4 level takes well under 4x the per-request time per request
    assert c4["wall_s"] < c4["requests"] * c4["request_s"]["p50"] / 2
    json.dumps(result)


def test_serial_level_is_serial(url):
    out, max_active = level(url, 1, 4)
    assert max_active == 1 and out["errors"] == 0


def test_http_errors_counted(url):
    out, _ = level(url, 3, 9, fail_every=3)
    assert out["errors"] == 3 and len(out["error_samples"]) == 3
    assert all(e.startswith("HTTP 429") for e in out["error_samples"])
    assert out["completion_tokens"] == 6 * CHUNKS * PER_CHUNK


def test_sse_error_and_no_usage(url):
    out, _ = level(url, 2, 4, usage=False, sse_error=True)
    assert out["errors"] == 2 and all("SSE error" in e for e in out["error_samples"])
    assert out["completion_tokens"] == 2 * CHUNKS     # counted content chunks, no usage chunk


def test_unreachable_server_does_not_crash():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = asyncio.run(serve.run_level(f"http://127.0.0.1:{port}", "m", 2, 4,
                                      lambda i: "hi", max_tokens=4, timeout=2))
    assert out["errors"] == 4 and out["ttft_s"]["p50"] is None and out["output_tok_s"] == 0


def test_cli_arguments_and_output(url, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    out_file = tmp_path / "bench.json"
    args = parser.parse_args(["--url", url, "--concurrency", "2", "--requests", "4",
                              "--max-tokens", "8", "--prompt-words", "20", "--warmup", "0",
                              "--output", str(out_file)])
    fake.reset()
    assert serve.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out_file.read_text())
    assert printed["levels"][0]["requests"] == 4 and fake.count == 4


def test_server_cpu_per_token_is_read_from_the_server_process(url):
    import os
    fake.reset()
    result = serve.run(url, None, [2], 4, 16, 20, None, seed=0, warmup=0,
                       server_pid=os.getpid(), idle_s=0.2)   # the fake server: our thread
    (lv,) = result["levels"]
    assert lv["server_cpu_s"] > 0 and lv["server_cpu_ms_per_token"] == pytest.approx(
        1000 * lv["server_cpu_s"] / lv["completion_tokens"])
    assert lv["server_idle_cpu_ms_per_s"] >= 0
    assert lv["server_cpu_ms_per_token_above_idle"] == pytest.approx(
        lv["server_cpu_ms_per_token"]
        - lv["server_idle_cpu_ms_per_s"] * lv["wall_s"] / lv["completion_tokens"])
    assert {"c2_server_cpu_ms_per_token", "c2_server_cpu_ms_per_token_above_idle"} <= set(
        result["summary"])
    plain = serve.run(url, None, [2], 4, 16, 20, None, seed=0, warmup=0)
    assert "server_cpu_s" not in plain["levels"][0]
