"""`pantheon bench prefix`: what the session prefix cache saves on a second turn.

    pantheon bench prefix --url http://127.0.0.1:8000 --words 700

For each round: a ~1,000-token conversation is sent once under a session id
(turn 1), then its second turn is sent under the same session (warm: the
cache holds turn 1). For comparison, the second turn of a conversation the
server has never seen, of the same size, is sent under a new session (cold:
every token is prefilled). Prints one JSON object with the TTFT of each and
their ratio (warm / cold; lower is better), medians over the rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

import httpx

from ..common import settings

from .serve import first_model, make_prompt, one_request


def conversation(i: int, words: int, seed: int) -> list[dict]:
    return [{"role": "system", "content": f"You are assistant number {i}. Be concise."},
            {"role": "user", "content": make_prompt(i, words, seed)}]


async def ttft(client, url, model, messages, session, headers, max_tokens) -> tuple[float, dict]:
    body = {"model": model, "messages": messages, "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True},
            "session_id": session}
    res = await one_request(client, url, body, {**headers, "X-Session-Id": session})
    if res["error"]:
        raise RuntimeError(res["error"])
    return res["ttft"], res


async def rounds(url, model, words, n, headers, seed) -> dict:
    warm, cold = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for r in range(n):
            base = 1000 * (seed + 1) + 2 * r
            follow_up = {"role": "user", "content": "Now say it again in one sentence."}
            turn1 = conversation(base, words, seed)
            _, first = await ttft(client, url, model, turn1, f"warm-{base}", headers, 24)
            reply = {"role": "assistant", "content": "Here is the story, in short."}
            t, _ = await ttft(client, url, model, turn1 + [reply, follow_up], f"warm-{base}",
                              headers, 8)
            warm.append(t)
            other = conversation(base + 1, words, seed)
            t, _ = await ttft(client, url, model, other + [reply, follow_up], f"cold-{base}",
                              headers, 8)
            cold.append(t)
    w, c = statistics.median(warm), statistics.median(cold)
    return {"url": url, "model": model, "rounds": n, "prompt_words": words,
            "ttft_warm_s": round(w, 4), "ttft_cold_s": round(c, 4),
            "warm_over_cold": round(w / c, 3), "ttft_warm_all_s": warm, "ttft_cold_all_s": cold}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=f"http://{settings.HOST}:{settings.PORT}")
    parser.add_argument("--model", help="model name (default: first id of GET /v1/models)")
    parser.add_argument("--words", type=int, default=700,
                        help="words in the first user turn (~1,000 tokens with the template)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--api-key")
    parser.add_argument("--seed", type=int, default=0)


def main(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or first_model(args.url, args.api_key)
    result = asyncio.run(rounds(args.url, model, args.words, args.rounds, headers, args.seed))
    print(json.dumps(result, indent=2))
    return 0
