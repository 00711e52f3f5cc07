"""`pantheon bench spec`: decode speed with and without speculation, side by side.

    pantheon bench spec -m qwen2.5-coder-1.5b --concurrency 1,8

In-process (the engine and its scheduler, as a worker runs them; no HTTP), greedy,
the model's chat template. Two workloads:

- edit: a ~400-token Python file in the prompt, "rename X to Y and return the whole
  file" — the output repeats the prompt, what prompt lookup is for;
- chat: free-form questions, where little repeats.

For each workload, concurrency and mode (off, then `--spec ngram` or `--spec draft
--draft-model PATH`), the same
requests run on a freshly loaded replica: `decode_tok_s` is a stream's tokens after its
first over the time since its first (median over streams), `aggregate_tok_s` all
tokens over the wall time. Rounds alternate the modes; medians are printed, with the
speedups (with / without) and speculation's acceptance. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

# the worker's modules are imported by main(): building the CLI's parser imports this one
QUESTIONS = [
    "Why is the sky blue? Explain it to a curious ten-year-old.",
    "What are three good habits for writing maintainable code?",
    "Describe how a bicycle gear system works.",
    "Give me a short plan for learning to cook at home.",
    "What is the difference between weather and climate?",
    "How do vaccines train the immune system?",
    "Suggest a name for a bakery and explain the choice.",
    "What happens when you type a web address into a browser?",
]


def source_file(variant: int) -> str:
    """A ~400-token Python module (SmolLM2's and Qwen's tokenizers) using `amount`."""
    lines = [f'"""Accounting helpers, module {variant}."""', "", "import math", ""]
    for i, name in enumerate(["total", "average", "largest", "rounded", "scaled"]):
        lines += [f"def {name}_{variant}(amount, items):",
                  f'    """Return the {name} of amount over items."""',
                  "    if not items:",
                  "        return 0",
                  f"    value = amount * len(items) + {i}",
                  f"    return math.floor(value / {i + 2})", ""]
    return "\n".join(lines)


def workload(kind: str, n: int) -> list[str]:
    if kind == "edit":
        return [f"Rename amount to quantity in this file and return the whole file, "
                f"nothing else:\n\n{source_file(i)}" for i in range(n)]
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]


def run_once(engine, prompts: list[list[int]], max_tokens: int, eot) -> dict:
    from ..worker.sampler import SamplingParams
    from ..worker.scheduler import Request
    sched = engine.scheduler
    reqs = [Request(f"b{i}", ids, SamplingParams(temperature=0), max_tokens, frozenset(eot))
            for i, ids in enumerate(prompts)]
    first, last, count = {}, {}, {}
    started = time.perf_counter()
    counted = sched.speculator.totals if sched.speculator else [0, 0, 0]
    before = list(counted)
    waiting = list(reqs)
    while waiting or sched.active():
        while waiting and sched.free_slots():
            sched.add(waiting.pop(0))
        for out in sched.step():
            now = time.perf_counter()
            if out.tokens:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.tokens)
    wall = time.perf_counter() - started
    decode = [(count[r] - 1) / (last[r] - first[r]) for r in count if last[r] > first[r]]
    totals = [a - b for a, b in zip(counted, before)]
    return {"decode_tok_s": statistics.median(decode) if decode else 0.0,
            "aggregate_tok_s": sum(count.values()) / wall, "tokens": sum(count.values()),
            "proposed": totals[1], "accepted": totals[2]}


def main(args) -> int:
    from ..common.chat_template import ChatTemplate
    from ..common.tokenizer import open_tokenizer
    from ..worker.engine import load_engine
    from ..worker.spec import SpecConfig
    tok = open_tokenizer(args.model)
    template = ChatTemplate(tok.chat_template, tok.bos_text, tok.eos_text, tok.control_texts)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    kinds = args.workloads.split(",")
    spec = SpecConfig(args.spec, args.spec_n, args.spec_k,
                      str(args.draft_model) if args.spec == "draft" else "")
    slots = max(concurrency)
    engines = {mode: load_engine(args.model, n_slots=slots, ctx=args.ctx,
                                 spec=spec if mode == "spec" else None)
               for mode in ("off", "spec")}
    for engine in engines.values():
        engine.warm_up()
    result = {"model": str(args.model), "rounds": args.rounds, "max_tokens": args.max_tokens,
              "spec": {"kind": spec.kind, "n": spec.n, "k": spec.k, "draft": spec.draft},
              "runs": []}
    for kind in kinds:
        for c in concurrency:
            prompts = [tok.encode(template.render([{"role": "user", "content": text}],
                                                  add_generation_prompt=True))
                       for text in workload(kind, c)]
            figures = {"off": [], "spec": []}
            for _ in range(args.rounds):
                for mode, engine in engines.items():       # alternating: drift hits both
                    figures[mode].append(run_once(engine, prompts, args.max_tokens,
                                                  tok.eot_ids))
            row = {"workload": kind, "concurrency": c,
                   "prompt_tokens": statistics.median(len(p) for p in prompts)}
            for mode, runs in figures.items():
                row[mode] = {key: round(statistics.median(r[key] for r in runs), 2)
                             for key in runs[0]}
            ng = row["spec"]
            row["acceptance"] = round(ng["accepted"] / ng["proposed"], 3) if ng["proposed"] else None
            row["decode_speedup"] = round(ng["decode_tok_s"] / max(row["off"]["decode_tok_s"], 1e-9), 3)
            row["aggregate_speedup"] = round(
                ng["aggregate_tok_s"] / max(row["off"]["aggregate_tok_s"], 1e-9), 3)
            result["runs"].append(row)
            print(json.dumps(row), flush=True, file=args.progress)
    print(json.dumps(result, indent=1))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", help="a model file, folder or catalog name "
                        "(default: the embedded SmolLM2)")
    parser.add_argument("--workloads", default="edit,chat", help="edit, chat or both")
    parser.add_argument("--concurrency", default="1,8", metavar="N,N",
                        help="streams at once (default 1,8)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--spec", choices=["ngram", "draft"], default="ngram",
                        help="the speculation compared with none (default ngram)")
    parser.add_argument("--draft-model", help="--spec draft: the draft model")
    parser.add_argument("--spec-n", type=int, default=3)
    parser.add_argument("--spec-k", type=int, default=8)
