"""`pantheon bench serve`: streaming load against any OpenAI-compatible server.

    pantheon bench serve --url http://127.0.0.1:8000 --model NAME --concurrency 1,4,8

Talks plain HTTP + SSE to `POST {url}/v1/chat/completions` (stream, include_usage,
temperature 0), so Pantheon, llama-server, vLLM, ... can be measured side by side on
the same model. Per concurrency level, exactly `concurrency` clients pull from a shared
queue of requests (closed loop); every request has its own deterministic prompt (seeded),
and no two share a long prefix. Prints one JSON object; per level:

  ttft_s        time from sending to the first chunk carrying content or reasoning_content
  itl_s         gaps between successive content-bearing chunks (a chunk may hold several
                tokens; see tpot_s)
  tpot_s        per request (last - first content chunk) / (completion_tokens - 1)
  output_tok_s  total completion tokens / wall time of the level
  request_s     whole-request latency;  errors / error_samples: failed requests
  server_cpu_ms_per_token  with --server-pid: the CPU time (user + system) that process
                spent during the level, per completion token (its own threads, not its
                children: for Pantheon, the frontend without its workers)
  server_cpu_ms_per_token_above_idle  the same less what the process spends idle
                (server_idle_cpu_ms_per_s, sampled before the first level, times the
                level's wall time): on a slow or contended host, few tokens a second
                make the idle timers' share of the raw figure large
  scrapes / scrape_ms  with --scrape-metrics S: GET {url}/metrics every S seconds during
                the level (a Prometheus scraper beside the load), and its mean time
completion_tokens come from the usage chunk, else from counting content chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from ..common import settings

TOPICS = ["a lighthouse keeper", "a lost robot", "a desert caravan", "an old violin",
          "a city under ice", "a talking crow", "the last train home", "a garden on Mars",
          "a clockmaker's apprentice", "a storm at sea", "a forgotten library", "twin rivals",
          "a mountain rescue", "a midnight bakery", "a haunted observatory", "a chess prodigy"]
STYLES = ["a fairy tale", "hard science fiction", "a noir detective story", "a comedy",
          "a letter", "a news report", "an epic poem", "a diary entry"]
FILLER = ("amber bridge copper dawn ember forest granite harbor island jasmine kettle lantern "
          "meadow nectar orchard pebble quartz raven saffron timber umber velvet willow yarrow "
          "zephyr anchor basalt cinder drift echo fjord glacier hollow ivy juniper kelp lagoon "
          "marble nimbus onyx prairie quill reef sierra tundra valley walnut canyon delta "
          "ferry gully heron inlet jetty knoll ledge marsh nook oasis pine ridge shoal thicket"
          ).split()


def make_prompt(i: int, words: int, seed: int) -> str:
    """Deterministic, distinct prompt of about `words` words; index first, so no shared prefix."""
    rng = random.Random(f"{seed}:{i}")
    text = (f"Request {i}: write a short story about {rng.choice(TOPICS)} in the style of "
            f"{rng.choice(STYLES)}. Weave in these words:")
    n = max(0, words - len(text.split()))
    return " ".join([text] + [rng.choice(FILLER) for _ in range(n)])


def _pct(xs: list[float], mean: bool = False) -> dict:
    import numpy as np   # not at module level: the CLI parser imports this module
    out = {"p50": None, "p95": None}
    if xs:
        out = {"p50": float(np.percentile(xs, 50)), "p95": float(np.percentile(xs, 95))}
    if mean:
        out["mean"] = float(np.mean(xs)) if xs else None
    return out


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    """Stream one chat completion; never raises. Returns timings, tokens and an error reason."""
    res = {"error": None, "ttft": None, "gaps": [], "tokens": 0, "tpot": None, "latency": None}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    done = False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace").strip()
                res["error"] = f"HTTP {r.status_code}: {text[:120]}"
                return res
            event = None
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if event == "error" or (isinstance(obj, dict) and obj.get("error")):
                    res["error"] = f"SSE error: {json.dumps(obj.get('error', obj))[:120]}"
                    return res
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        stamps.append(time.perf_counter())
                        break
        if not done:
            res["error"] = "stream ended without [DONE]"
            return res
    except (httpx.TimeoutException, asyncio.TimeoutError):
        res["error"] = "timeout"
        return res
    except Exception as e:  # noqa: BLE001 - a load generator reports, never crashes
        res["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        return res
    res["latency"] = time.perf_counter() - t0
    tokens = (usage or {}).get("completion_tokens")
    res["tokens"] = int(tokens) if tokens is not None else len(stamps)
    if stamps:
        res["ttft"] = stamps[0] - t0
        res["gaps"] = [b - a for a, b in zip(stamps, stamps[1:])]
        if res["tokens"] > 1:
            res["tpot"] = (stamps[-1] - stamps[0]) / (res["tokens"] - 1)
    return res


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` so far (its own, not its children's)."""
    if pid is None:
        return None
    import psutil
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def run_level(url, model, concurrency, requests, prompt_fn, max_tokens,
                    api_key=None, timeout=300, server_pid: int | None = None,
                    idle_cpu_per_s: float = 0.0, scrape_s: float = 0.0) -> dict:
    """`concurrency` clients drain a queue of `requests` requests; prompt_fn(i) -> user text."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def worker():
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                        "temperature": 0, "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": prompt_fn(i)}]}
                try:
                    res = await asyncio.wait_for(one_request(client, url, body, headers), timeout)
                except asyncio.TimeoutError:
                    res = {"error": "timeout"}
                results.append(res)

        scrapes: list[float] = []
        scraper = asyncio.ensure_future(scrape(url, headers, scrape_s, scrapes)) \
            if scrape_s > 0 else None
        cpu0, t0 = cpu_seconds(server_pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(server_pid) - cpu0 if server_pid is not None else None
        if scraper is not None:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)

    ok = [r for r in results if r["error"] is None]
    errors = [r["error"] for r in results if r["error"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "errors": len(errors),
        "error_samples": errors[:3],
        "completion_tokens": tokens,
        "ttft_s": _pct([r["ttft"] for r in ok if r["ttft"] is not None], mean=True),
        "itl_s": _pct([g for r in ok for g in r["gaps"]]),
        "tpot_s": _pct([r["tpot"] for r in ok if r["tpot"] is not None]),
        "output_tok_s": tokens / wall if wall > 0 else None,
        "request_s": _pct([r["latency"] for r in ok]),
        "wall_s": wall,
        **({"scrapes": len(scrapes), "scrape_ms": 1000 * sum(scrapes) / len(scrapes)
            if scrapes else None} if scrape_s > 0 else {}),
        **({"server_cpu_s": cpu, "server_cpu_ms_per_token":
            1000 * cpu / tokens if tokens else None,
            "server_cpu_ms_per_token_above_idle":
            1000 * (cpu - idle_cpu_per_s * wall) / tokens if tokens else None}
           if cpu is not None else {}),
    }


async def scrape(url: str, headers: dict, every_s: float, times: list[float]) -> None:
    """GET /metrics every `every_s` seconds until cancelled; each one's seconds."""
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            t0 = time.perf_counter()
            r = await client.get(url + "/metrics", headers=headers)
            r.raise_for_status()
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(every_s)


async def idle_cpu(pid: int, seconds: float) -> float:
    """CPU seconds per second process `pid` spends while nobody sends it anything."""
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds if seconds > 0 else 0.0


def first_model(url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run(url, model, concurrencies: list[int], requests_per_level: int | None, max_tokens: int,
        prompt_tokens_hint: int, api_key: str | None, seed: int, warmup: int = 1,
        server_pid: int | None = None, idle_s: float = 3.0, scrape_s: float = 0.0) -> dict:
    """All levels in order; prompt_tokens_hint is the approximate prompt size in words.
    `warmup` untimed requests go first (the server's first request may compile or load)."""
    model = model or first_model(url, api_key)

    async def go() -> list[dict]:
        offset = 0   # prompts never repeat across levels, so no level rides another's cache

        def prompts(base):
            return lambda i: make_prompt(base + i, prompt_tokens_hint, seed)
        if warmup > 0:
            await run_level(url, model, 1, warmup, prompts(-warmup), max_tokens, api_key)
        idle = await idle_cpu(server_pid, idle_s) if server_pid is not None else 0.0
        levels = []
        for c in concurrencies:
            n = requests_per_level or max(4, 2 * c)
            levels.append(await run_level(url, model, c, n, prompts(offset), max_tokens, api_key,
                                          server_pid=server_pid, idle_cpu_per_s=idle,
                                          scrape_s=scrape_s))
            if server_pid is not None:
                levels[-1]["server_idle_cpu_ms_per_s"] = 1000 * idle
            offset += n
        return levels

    levels = asyncio.run(go())
    return {"url": url, "model": model, "max_tokens": max_tokens,
            "prompt_words": prompt_tokens_hint, "seed": seed, "levels": levels,
            "summary": summary(levels)}


def summary(levels: list[dict]) -> dict:
    out = {}
    for lv in levels:
        out[f"c{lv['concurrency']}_output_tok_s"] = round(lv["output_tok_s"] or 0, 2)
        for key in ("server_cpu_ms_per_token", "server_cpu_ms_per_token_above_idle"):
            if lv.get(key) is not None:
                out[f"c{lv['concurrency']}_{key}"] = round(lv[key], 4)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=f"http://{settings.HOST}:{settings.PORT}",
                        help="server base URL")
    parser.add_argument("--model", help="model name (default: first id of GET /v1/models)")
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated levels")
    parser.add_argument("--requests", type=int, help="requests per level (default 2*c, min 4)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=64, help="approximate prompt size")
    parser.add_argument("--api-key", default=settings.openai_api_key(),
                        help="key to send (env OPENAI_API_KEY); prefer --api-key-file")
    parser.add_argument("--api-key-file", metavar="FILE", help="send the file's first key")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    parser.add_argument("--server-pid", type=int, metavar="PID",
                        help="also report this process's CPU time per completion token "
                             "(the frontend's pid for Pantheon)")
    parser.add_argument("--scrape-metrics", type=float, default=0.0, metavar="S",
                        help="GET /metrics every S seconds during each level")
    parser.add_argument("--output", help="also write the JSON to this file")


def main(args) -> int:
    if args.api_key_file:                 # out of the process list, unlike --api-key
        from ..common.key_set import first_key
        args.api_key = first_key(args.api_key_file)
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    result = run(args.url, args.model, levels, args.requests, args.max_tokens,
                 args.prompt_words, args.api_key, args.seed, warmup=args.warmup,
                 server_pid=args.server_pid, scrape_s=args.scrape_metrics)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 1 if any(lv["errors"] == lv["requests"] for lv in result["levels"]) else 0
