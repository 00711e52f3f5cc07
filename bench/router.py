"""`pantheon bench router`: what a router in front of several instances costs and keeps.

    pantheon bench router --router http://127.0.0.1:30000 \\
        --direct http://127.0.0.1:8001,http://127.0.0.1:8002 --concurrency 1,8

Added latency: per concurrency level, rounds (one request per client) alternate between
the router and the instances themselves (client k of a direct round talks to instance
k mod N), with fresh prompts that share no prefix, streamed; the figure is TTFT p50
through the router minus TTFT p50 direct, over all rounds (alternating keeps a drifting
host load out of the difference). With one instance behind the router and --direct
naming it, both paths reach the same engine: the difference is the router's alone.

Proxy cost: GET /v1/models through the router and directly, interleaved, p50: what the
router adds to each request without the engine's noise.

Session hit rate: `--sessions` two-turn conversations through the router, each under
its own X-Session-Id; a hit is a turn 2 whose cached_tokens cover turn 1's whole prompt
(the instance that served turn 1 served turn 2). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from .serve import first_model, make_prompt, one_request


async def level(targets: list[str], model: str, concurrency: int, requests: int,
                offset: int, max_tokens: int, words: int) -> list[float]:
    """TTFTs of `requests` streamed requests by `concurrency` clients over `targets`."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(offset + i)
    ttfts, errors = [], []
    async with httpx.AsyncClient(timeout=300) as client:
        async def worker(k: int):
            url = targets[k % len(targets)]
            while not queue.empty():
                i = queue.get_nowait()
                body = {"model": model, "stream": True, "temperature": 0,
                        "max_tokens": max_tokens, "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": make_prompt(i, words, 7)}]}
                res = await one_request(client, url, body, {})
                (errors.append(res["error"]) if res["error"] else ttfts.append(res["ttft"]))
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    return ttfts


def added_latency(router: str, direct: list[str], model: str, concurrency: int,
                  rounds: int, max_tokens: int, words: int) -> dict:
    per_round = concurrency           # one request per client: short rounds, little drift
    through, alone, offset = [], [], 10_000 * concurrency
    for r in range(rounds):
        order = [(through, [router]), (alone, direct)]
        for into, targets in order if r % 2 == 0 else order[::-1]:
            into += asyncio.run(level(targets, model, concurrency, per_round, offset,
                                      max_tokens, words))
            offset += per_round
    p50_router, p50_direct = statistics.median(through), statistics.median(alone)
    return {"concurrency": concurrency, "requests_each": len(through),
            "ttft_p50_router_s": round(p50_router, 4), "ttft_p50_direct_s": round(p50_direct, 4),
            "router_added_ttft_p50_ms": round(1000 * (p50_router - p50_direct), 2)}


def proxy_rtt(router: str, direct: list[str], samples: int = 50) -> dict:
    """GET /v1/models through the router and directly, interleaved: the router's own cost
    per request without the engine's (a shared host's prefill times vary by 10x)."""
    through, alone = [], []
    with httpx.Client(timeout=30) as client:
        for i in range(samples):
            for into, url in ((through, router), (alone, direct[i % len(direct)])):
                t0 = time.perf_counter()
                client.get(f"{url}/v1/models").raise_for_status()
                into.append(time.perf_counter() - t0)
    return {"models_rtt_p50_router_ms": round(1000 * statistics.median(through), 3),
            "models_rtt_p50_direct_ms": round(1000 * statistics.median(alone), 3)}


def session_hits(router: str, model: str, sessions: int, words: int) -> dict:
    hits = 0
    with httpx.Client(timeout=300) as client:
        for s in range(sessions):
            head = {"X-Session-Id": f"bench-session-{s}"}
            messages = [{"role": "user", "content": make_prompt(50_000 + s, words, 11)}]

            def send():
                r = client.post(f"{router}/v1/chat/completions", headers=head, json={
                    "model": model, "messages": messages, "max_tokens": 8, "temperature": 0})
                r.raise_for_status()
                return r.json()
            first = send()
            messages += [first["choices"][0]["message"],
                         {"role": "user", "content": "Go on, in one sentence."}]
            second = send()
            cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            hits += cached >= first["usage"]["prompt_tokens"]
    return {"sessions": sessions, "turn2_hits": hits,
            "turn2_hit_rate": round(hits / sessions, 4) if sessions else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", required=True, help="the router's base URL")
    parser.add_argument("--direct", required=True,
                        help="comma-separated base URLs of the instances behind it")
    parser.add_argument("--model", help="model name (default: first id of GET /v1/models)")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=16,
                        help="alternated router / direct rounds per level (one request "
                             "per client each)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=32, help="two-turn sessions")
    parser.add_argument("--output", help="also write the JSON to this file")


def main(args) -> int:
    router = args.router.rstrip("/")
    direct = [u.strip().rstrip("/") for u in args.direct.split(",") if u.strip()]
    model = args.model or first_model(router)
    asyncio.run(level([router] + direct, model, 1, 1 + len(direct), 0, 2, 8))   # warm-up
    result = {"router": router, "direct": direct, "model": model,
              "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
              "levels": [added_latency(router, direct, model, int(c), args.rounds,
                                       args.max_tokens, args.prompt_words)
                         for c in args.concurrency.split(",") if c.strip()],
              **proxy_rtt(router, direct),
              **session_hits(router, model, args.sessions, args.prompt_words)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0
