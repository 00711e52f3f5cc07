"""`pantheon bench join`: what a long prompt joining does to running streams.

    pantheon bench join --url http://127.0.0.1:8000 --streams 4 --join-words 1500

Starts `streams` streaming requests; once each has produced a few tokens, a
request with a long prompt (~2,000 tokens for 1,500 words) joins. Reports the
running streams' inter-token gaps before the join (median) and while the
long prompt is being prefilled (from its send to its first token: p50, p95,
max), their ratio, and the joiner's TTFT. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from ..common import settings

from .serve import first_model, make_prompt


async def stream(client, url, body, headers, stamps: list, first: asyncio.Event | None = None):
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("error"):
                raise RuntimeError(obj["error"])
            if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                stamps.append(time.perf_counter())
                if first is not None and len(stamps) >= 5:
                    first.set()


async def run(url, model, n_streams, join_words, max_tokens, headers) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        stamps = [[] for _ in range(n_streams)]
        ready = [asyncio.Event() for _ in range(n_streams)]
        tasks = [asyncio.create_task(stream(
            client, url, {"model": model, "stream": True, "temperature": 0,
                          "max_tokens": max_tokens, "messages": [{"role": "user", "content":
                          f"Story {i}: tell me a long tale about a lighthouse keeper."}]},
            headers, stamps[i], ready[i])) for i in range(n_streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready)), 600)
        joined, join_stamps = time.perf_counter(), []
        await stream(client, url, {"model": model, "stream": True, "max_tokens": 1,
                                   "messages": [{"role": "user",
                                                 "content": make_prompt(99, join_words, 7)}]},
                     headers, join_stamps)
        first_token = join_stamps[0] if join_stamps else time.perf_counter()
        await asyncio.gather(*tasks)
    before, during = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            if b <= joined:
                before.append(b - a)
            elif a < first_token:
                during.append(b - a)
    med = statistics.median(before)
    during.sort()
    p95 = during[min(len(during) - 1, int(0.95 * len(during)))] if during else None
    return {"url": url, "model": model, "streams": n_streams, "join_words": join_words,
            "joiner_ttft_s": round(first_token - joined, 3),
            "itl_before_median_s": round(med, 4),
            "itl_during_p50_s": round(statistics.median(during), 4) if during else None,
            "itl_during_p95_s": round(p95, 4) if p95 else None,
            "itl_during_max_s": round(during[-1], 4) if during else None,
            "p95_over_median": round(p95 / med, 2) if p95 else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=f"http://{settings.HOST}:{settings.PORT}")
    parser.add_argument("--model", help="model name (default: first id of GET /v1/models)")
    parser.add_argument("--streams", type=int, default=4, help="streams already running")
    parser.add_argument("--join-words", type=int, default=1500,
                        help="words in the joining prompt (1,500 ≈ 2,000 tokens)")
    parser.add_argument("--max-tokens", type=int, default=400,
                        help="tokens each running stream asks for (outlasting the join)")
    parser.add_argument("--api-key")


def main(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or first_model(args.url, args.api_key)
    result = asyncio.run(run(args.url, model, args.streams, args.join_words, args.max_tokens,
                             headers))
    print(json.dumps(result, indent=2))
    return 0
