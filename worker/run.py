"""`pantheon run`: one chat turn in-process, text streamed to stdout."""
from __future__ import annotations

import sys
import time

from ..common.chat_template import ChatTemplate
from ..common.tokenizer import open_tokenizer
from .engine import load_engine
from .sampler import SamplingParams
from .scheduler import Request


def run_chat(model_path, prompt: str, system: str | None = None, max_tokens: int = 256,
             params: SamplingParams | None = None, out=sys.stdout, stats=sys.stderr,
             quantize: str = "auto", activations: str = "auto", kv_cache=None) -> str:
    tokenizer = open_tokenizer(model_path)
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_text, tokenizer.eos_text,
                            tokenizer.control_texts)
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt}]
    ids = tokenizer.encode(template.render(messages, add_generation_prompt=True))
    engine = load_engine(model_path, n_slots=1, ctx=None, quantize=quantize,
                         activations=activations,
                         **({"kv_cache": kv_cache} if kv_cache is not None else {}))
    params = (params or SamplingParams(temperature=0.0)).check(engine.cfg.vocab_size)
    if len(ids) >= engine.model.ctx:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of "
                         f"{engine.model.ctx}")
    max_tokens = min(max_tokens, engine.model.ctx - len(ids))
    sched = engine.scheduler
    sched.add(Request("run", ids, params, max_tokens, frozenset(tokenizer.eot_ids)))
    detok = tokenizer.detokenizer()
    text, started, first, n = [], time.perf_counter(), None, 0
    while sched.active():
        for output in sched.step():
            for token in output.tokens:
                n += 1
                first = first or time.perf_counter()
                if token in tokenizer.eot_ids:
                    continue
                piece = detok.push(token)
                text.append(piece)
                out.write(piece)
                out.flush()
    tail = detok.flush()
    text.append(tail)
    out.write(tail + "\n")
    elapsed = time.perf_counter() - started
    if stats is not None and first is not None:
        decode = (n - 1) / max(time.perf_counter() - first, 1e-9)
        stats.write(f"[{len(ids)} prompt tokens, {n} generated, {elapsed:.2f} s, "
                    f"{decode:.1f} tok/s decode]\n")
    return "".join(text)
