"""The embedded default model against ../shared/reference (llama.cpp ids, fp32 replies)."""
import json
from pathlib import Path

import pytest

from pantheon.common.chat_template import ChatTemplate
from pantheon.common.default_model import cached_path
from pantheon.common.tokenizer import open_tokenizer
from pantheon.worker.engine import load_engine
from pantheon.worker.sampler import SamplingParams
from pantheon.worker.scheduler import Request

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "smollm2-reference.json"
MODEL = cached_path()

pytestmark = pytest.mark.skipif(not MODEL.exists() or not REFERENCE.exists(),
                                reason="default model or reference data missing")


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def engine():
    return load_engine(MODEL, n_slots=4, ctx=256, quantize="none")   # the exact fp32 mode


def test_template_gives_reference_prompt_ids(reference):
    tok = open_tokenizer(MODEL)
    template = ChatTemplate(tok.chat_template, tok.bos_text, tok.eos_text)
    for case in reference["chat_greedy"]:
        ids = tok.encode(template.render(case["messages"], add_generation_prompt=True))
        assert ids == case["prompt_ids_fp32ref"]


def test_greedy_replies_match_fp32_reference_alone_and_batched(engine, reference):
    """Each reply alone, then all three side by side in one batch: same ids."""
    cases = reference["chat_greedy"]
    eot = frozenset({2})
    greedy = SamplingParams(temperature=0)

    def run(batch):
        sched = engine.scheduler
        got = {}
        for i in batch:
            case = cases[i]
            sched.add(Request(str(i), case["prompt_ids_fp32ref"], greedy,
                              len(case["greedy_ids_fp32ref"]), eot))
        while sched.active():
            for out in sched.step():
                got.setdefault(int(out.request_id), []).extend(out.tokens)
        return got

    alone = {}
    for i in range(len(cases)):
        alone.update(run([i]))
    together = run(range(len(cases)))
    for i, case in enumerate(cases):
        assert alone[i] == case["greedy_ids_fp32ref"], case["messages"]
        assert together[i] == case["greedy_ids_fp32ref"], case["messages"]
