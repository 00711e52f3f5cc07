"""Gemma 3: the sliding window across chunks, steps, forks and the host cache; load errors;
the real 270M model against llama.cpp; the tiny model served over HTTP.

The golden checks every architecture shares (decode, prefill at every split, mixed
batches, scattered slots) are in tests/test_model.py; the quantized ones in
tests/test_quantized_model.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

import tiny_models as tm
from cluster import Server
from pantheon.common.model_file import ModelFileError, check_tensors, read_config
from pantheon.common.tokenizer import open_tokenizer
from pantheon.common.weight_format import tensor_list
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span
from pantheon.worker.prefix_cache import PrefixCache
from pantheon.worker.sampler import SamplingParams
from pantheon.worker.scheduler import Request

TOL = 2e-4
SELF = 2e-5          # the same positions computed in other splits: summation order only
WINDOW = tm.CONFIGS["gemma3"]["sliding_window"]
GREEDY = SamplingParams(temperature=0)
REAL = Path.home() / ".cache" / "pantheon" / "models" / "gemma-3-270m.Q4_K_M.gguf"
REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "llamacpp-greedy.json"


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return tm.write_gguf("gemma3", tmp_path_factory.mktemp("g") / "gemma3.gguf")


def engine(path, n_slots=4, ctx=64, **kw):
    return load_engine(path, n_slots=n_slots, ctx=ctx, **kw)


def test_the_stack_interleaves_local_and_global_layers(gguf_path, tmp_path):
    for cfg in (read_config(gguf_path), read_config(tm.write_safetensors_dir("gemma3", tmp_path))):
        windows = [b.mixer.window for b in cfg.blocks]
        assert windows == [WINDOW] * 5 + [None]
        local, full = cfg.blocks[0].mixer.rope, cfg.blocks[5].mixer.rope
        assert (local.theta, local.scaling) == (10000.0, None)
        assert full.theta == 1e6 and full.scaling.factor == 2.0
        assert cfg.embed_scale == 8.0 and cfg.tied_embeddings and cfg.blocks[0].sandwich


def test_multi_chunk_prefill_longer_than_the_window_matches_reference(gguf_path):
    e = engine(gguf_path)
    tokens, want = tm.GOLDEN_TOKENS[0], tm.load_golden("gemma3")[0]
    for cuts in ([3, 5, 8], [2, 4, 6, 8, 10], [1, 2, 7]):
        got, start = [], 0
        for end in cuts + [len(tokens)]:
            got.append(e.forward(np.array(tokens[start:end]), [Span(1, start, end - start)])[0])
            start = end
        want_rows = [want[c - 1] for c in cuts + [len(tokens)]]
        np.testing.assert_allclose(np.stack(got), np.stack(want_rows), atol=TOL, rtol=0)


def test_a_long_prompt_is_the_same_in_one_chunk_in_many_and_token_by_token(gguf_path):
    """40 positions, a window of 4: every layer's history is cut many times over."""
    e = engine(gguf_path, ctx=64)
    ids = list(np.random.default_rng(3).integers(3, 320, 40))
    whole = e.forward(np.array(ids), [Span(0, 0, 40)])[0]
    start, rows = 0, []
    for end in (7, 8, 19, 33, 40):
        rows.append(e.forward(np.array(ids[start:end]), [Span(1, start, end - start)])[0])
        start = end
    one = [e.forward(np.array([t]), [Span(2, i, 1)])[0] for i, t in enumerate(ids)]
    np.testing.assert_allclose(rows[-1], whole, atol=SELF, rtol=0)
    np.testing.assert_allclose(one[-1], whole, atol=SELF, rtol=0)
    np.testing.assert_allclose(np.stack([one[6], one[7], one[18], one[32]]), np.stack(rows[:4]),
                               atol=SELF, rtol=0)
    # decoding past the window beside a prefill chunk of another slot, in one step
    more = e.forward(np.array([5] + ids[:9]), [Span(2, 40, 1), Span(3, 0, 9)])
    alone = e.forward(np.array([5]), [Span(0, 40, 1)])
    np.testing.assert_allclose(more[0], alone[0], atol=SELF, rtol=0)
    np.testing.assert_allclose(more[1], one[8], atol=SELF, rtol=0)


def test_state_copies_and_host_saves_resume_beyond_the_window(gguf_path):
    e = engine(gguf_path)
    state = e.model.state
    tokens, want = tm.GOLDEN_TOKENS[0], tm.load_golden("gemma3")[0]
    e.forward(np.array(tokens[:7]), [Span(0, 0, 7)])
    state.copy_prefix(0, 3, 6)                                     # a fork, cut at 6 > window
    got = e.forward(np.array(tokens[6:]), [Span(3, 6, len(tokens) - 6)])
    np.testing.assert_allclose(got[0], want[-1], atol=TOL, rtol=0)
    saved, nbytes = state.save(0, 7)
    assert nbytes == 7 * e.model.cfg.kv_bytes_per_token(4)
    e.forward(np.array(tm.GOLDEN_TOKENS[1]), [Span(0, 0, 7)])     # the slot is reused
    assert state.restore(2, saved) == 7
    got = e.forward(np.array(tokens[7:]), [Span(2, 7, len(tokens) - 7)])
    np.testing.assert_allclose(got[0], want[-1], atol=TOL, rtol=0)


def run(sched, *reqs):
    for r in reqs:
        sched.add(r)
    outs: dict[str, list] = {r.id: [] for r in reqs}
    last = {}
    while sched.active():
        for o in sched.step():
            outs[o.request_id] += o.tokens
            last[o.request_id] = o
    return outs, last


def test_forks_and_the_host_prefix_cache_give_the_reply_of_a_fresh_slot(gguf_path):
    prompt = list(np.random.default_rng(5).integers(3, 320, 30))
    other = list(np.random.default_rng(6).integers(3, 320, 30))
    want = run(engine(gguf_path, n_slots=1).scheduler, Request("a", prompt, GREEDY, 8))[0]["a"]
    e = engine(gguf_path, n_slots=2, prefix_cache_bytes=1 << 24)
    outs, last = run(e.scheduler, Request("a", prompt, GREEDY, 8), Request("b", prompt, GREEDY, 8))
    assert outs["a"] == want and outs["b"] == want                  # n > 1: one prefill, a copy
    assert last["b"].cached_tokens == len(prompt) - 1
    # both slots taken by other conversations: the first moves to the host cache
    run(e.scheduler, Request("c", other, GREEDY, 4), Request("d", other[::-1], GREEDY, 4))
    assert e.scheduler.cache.stats()["entries"] >= 1
    turn2 = prompt + want + [7, 8, 9]
    outs, last = run(e.scheduler, Request("e", turn2, GREEDY, 6))
    want2 = run(engine(gguf_path, n_slots=1).scheduler, Request("e", turn2, GREEDY, 6))[0]["e"]
    assert last["e"].cached_tokens >= len(prompt)
    assert outs["e"] == want2


# -- bad files ---------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"drop": ["blk.3.post_ffw_norm.weight"]}, "lacks tensor blk.3.post_ffw_norm.weight"),
    ({"drop": ["blk.0.attn_q_norm.weight"]}, "lacks tensor blk.0.attn_q_norm.weight"),
    ({"reshape": {"blk.2.attn_k.weight": 32}}, r"tensor blk.2.attn_k.weight has shape \[32, 64\]"),
    ({"arch": "gemma4"}, "unsupported model architecture 'gemma4'"),
])
def test_bad_files_are_load_errors_naming_the_tensor(gguf_path, tmp_path, change, message):
    bad = tm.rewrite_gguf(gguf_path, tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelFileError, match=message):
        check_tensors(read_config(bad), tensor_list(bad))        # the frontend, before upload
    with pytest.raises(ModelFileError, match=message):
        load_engine(bad, n_slots=1, ctx=16)                       # the worker's loader


def test_bad_configs_name_the_field(tmp_path):
    folder = tm.write_safetensors_dir("gemma3", tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    for change, message in [({"layer_types": ["full_attention"] * 2}, "layer_types"),
                            ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                            ({"num_attention_heads": None}, "'num_attention_heads' is missing"),
                            ({"hidden_size": "wide"}, "'hidden_size' = 'wide' is not valid")]:
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelFileError, match=message):
            read_config(folder)


# -- the real model ----------------------------------------------------------------------
@pytest.mark.skipif(not REAL.exists() or not REFERENCE.exists(),
                    reason="gemma3-270m not fetched (pantheon models fetch gemma3-270m)")
def test_gemma3_270m_greedy_against_llama_cpp():
    """llama.cpp's greedy ids on the same Q4_K_M file. Its dot products quantize the
    activations to 8 bits (ours: 16), so where the reference's own top-2 margin is a few
    hundredths of a nat the pick can flip; measured here: 79 of the first 16 x 6 ids
    (cases 0-2 all 16, case 3 15, case 4 flips at its 3rd id, margin 0.035; case 5 at its
    1st, our margin 0.057)."""
    ref = json.loads(REFERENCE.read_text())["gemma-3-270m-q4_k_m.gguf"]
    tok = open_tokenizer(REAL)
    e = load_engine(REAL, n_slots=2, ctx=256)
    match = 0
    for i, case in enumerate(ref["cases"]):
        assert tok.encode(case["prompt"]) == case["model_input_ids"]
        outs, _ = run(e.scheduler, Request(str(i), case["model_input_ids"], GREEDY, 16,
                                           frozenset({1})))
        match += sum(a == b for a, b in zip(outs[str(i)], case["greedy_ids"][:16]))
        if i < 3:
            assert outs[str(i)] == case["greedy_ids"][:16]
    assert match >= 75, match


# -- served end to end -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(gguf_path):
    with Server("--model", str(gguf_path), "--name", "tiny-gemma3", "--slots", "2",
                "--ctx", "64") as srv:
        yield srv


def test_tiny_gemma3_served_over_http(server, gguf_path):
    """/v1/completions (token ids in) gives the in-process greedy reply; chat works through
    the ChatML fallback (the file has no template)."""
    prompt = tm.GOLDEN_TOKENS[0]
    e = engine(gguf_path, n_slots=1)
    outs, _ = run(e.scheduler, Request("x", prompt, GREEDY, 6))
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny-gemma3", "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6,
                             "total_tokens": len(prompt) + 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["text"] == open_tokenizer(gguf_path).decode(outs["x"])
    chat = server.client().chat.completions.create(
        model="tiny-gemma3", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.prompt_tokens > 0
