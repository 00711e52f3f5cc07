"""Qwen3.5 through the engine: golden logits via the real Model (GGUF and safetensors),
prompts in any split, decodes batched with other sequences in scattered slots, forks,
the host prefix cache and session turns over a state that cannot be cut, quantized
weights, load errors, and the tiny model served over HTTP with a <think> template.

The golden checks every architecture shares (decode, every split of a short prompt,
mixed batches, scattered slots) run for qwen35 in tests/test_model.py too; its math
against a reference of its own is tests/test_qwen35_ops.py.
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
from pantheon.frontend.dies import replica_bytes
from pantheon.worker.engine import load_engine
from pantheon.worker.model import Span
from pantheon.worker.qmatrix import QMatrix
from pantheon.worker.sampler import SamplingParams
from pantheon.worker.scheduler import Request
from pantheon.worker.sequence_state import RecurrentState, StateError

TOL = 1e-4           # float32 against transformers' float32
SELF = 2e-5          # the same positions computed in another split: summation order only
GREEDY = SamplingParams(temperature=0)
TOKENS = tm.golden_tokens("qwen35")
LONG = TOKENS[2]     # 150 tokens: more than two 64-token delta-rule chunks


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35")
    return {"gguf": tm.write_gguf("qwen35", d / "qwen35.gguf"),
            "hf": tm.write_safetensors_dir("qwen35", d / "hf"),
            "Q8_0": tm.write_gguf("qwen35", d / "qwen35-q8.gguf", "Q8_0")}


@pytest.fixture(scope="module")
def golden():
    return tm.load_golden("qwen35")


def engine(path, n_slots=4, ctx=200, **kw):
    return load_engine(path, n_slots=n_slots, ctx=ctx, **kw)


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def prefill(e, tokens, slot, splits, start=0):
    """Feed `tokens` into `slot` in chunks of `splits`; the logits of each chunk's last."""
    rows, pos = [], start
    for n in splits:
        rows.append(e.forward(np.array(tokens[pos - start:pos - start + n]), [Span(slot, pos, n)])[0])
        pos += n
    return np.stack(rows)


# -- the stack -------------------------------------------------------------------------
def test_the_stack_and_its_state(paths):
    for fmt in ("gguf", "hf"):
        cfg = read_config(paths[fmt])
        kinds = [b.mixer.kind for b in cfg.blocks]
        assert kinds == ["gated_deltanet"] * 2 + ["gated_attention", "gated_deltanet"]
        assert {b.mlp_norm for b in cfg.blocks} == {"post_attention_norm"}
        assert cfg.blocks[2].mixer.rope.dim == 8 and cfg.blocks[0].mixer.hf_layout == (fmt == "hf")
        # per slot: 3 linear layers x (conv tail 3 x 160 + S 6 x 16 x 16) fp32; KV: 1 layer
        fixed = 3 * 4 * (3 * 160 + 6 * 16 * 16)
        assert cfg.fixed_bytes_per_slot() == fixed
        assert cfg.kv_bytes_per_token(4) == 2 * 2 * 32 * 4
        e = engine(paths[fmt], n_slots=3, ctx=64)
        rec = [s for s in e.model.state.layers if isinstance(s, RecurrentState)]
        assert len(rec) == 3 and sum(s.nbytes for s in rec) == 3 * fixed
        assert e.model.state.nbytes == cfg.state_bytes(3, 64) and not e.model.state.truncatable


def test_admission_counts_the_recurrent_state(paths):
    """The frontend's figure for a replica is the loaded engine's own: weights, KV per
    position and the fixed recurrent state of every slot."""
    cfg = read_config(paths["gguf"])
    for mode in ("auto", "q8_0"):
        e = engine(paths["gguf"], n_slots=4, ctx=64, quantize=mode)
        want = e.model.w.nbytes() + e.model.state.nbytes
        assert replica_bytes(str(paths["gguf"]), cfg, "cpu", 4, 64, mode) == want, mode
    fixed = 4 * cfg.fixed_bytes_per_slot()
    assert replica_bytes(str(paths["gguf"]), cfg, "cpu", 4, 64) - \
        replica_bytes(str(paths["gguf"]), cfg, "cpu", 0, 64) == fixed + 4 * 64 * cfg.kv_bytes_per_token(4)


# -- golden logits through the engine ----------------------------------------------------
@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_golden_logits_in_one_chunk_in_many_and_token_by_token(paths, golden, fmt):
    e = engine(paths[fmt])
    whole = e.forward(np.array(LONG), [Span(0, 0, 150)])[0]
    assert max_diff(whole, golden[2][-1]) < TOL
    for slot, splits in [(1, [37, 64, 49]), (2, [2, 3, 70, 1, 74]), (3, [63, 1, 1, 85])]:
        got = prefill(e, LONG, slot, splits)
        ends = np.cumsum(splits) - 1
        assert max_diff(got, golden[2][ends]) < TOL, splits
        assert max_diff(got[-1], whole) < SELF
    # token by token after a 100-token prefill: every decode row against the golden
    prefill(e, LONG[:100], 0, [100])
    rows = [e.forward(np.array([t]), [Span(0, 100 + i, 1)])[0] for i, t in enumerate(LONG[100:])]
    worst = max_diff(np.stack(rows), golden[2][100:])
    print(f"qwen35 {fmt} through the engine: decode max |diff| {worst:.2e}")
    assert worst < TOL


def test_every_split_of_a_short_prompt(paths, golden):
    e = engine(paths["gguf"])
    tokens, want = TOKENS[0], golden[0]
    for split in range(1, len(tokens)):
        got = prefill(e, tokens, split % 4, [split, len(tokens) - split])
        assert max_diff(got, want[[split - 1, -1]]) < TOL, split


def test_decodes_batched_with_a_prefill_in_scattered_slots(paths, golden):
    """Three decodes in unordered, non-adjacent slots (stale states between them) and a
    prefill chunk of a fourth sequence, in one step; each row as computed alone."""
    e = engine(paths["gguf"], n_slots=7)
    a, b, c = TOKENS[0], TOKENS[1], LONG[:40]
    e.forward(np.array(c), [Span(3, 0, 40)])                     # stale junk in slot 3
    for slot, seq in ((5, a), (1, b), (4, c)):
        e.forward(np.array(seq[:-1]), [Span(slot, 0, len(seq) - 1)])
    e.forward(np.array(LONG[:60]), [Span(0, 0, 60)])
    out = e.forward(np.array([c[-1], a[-1], b[-1]] + LONG[60:90]),
                    [Span(4, 39, 1), Span(5, 10, 1), Span(1, 6, 1), Span(0, 60, 30)])
    assert max_diff(out[1], golden[0][-1]) < TOL and max_diff(out[2], golden[1][-1]) < TOL
    assert max_diff(out[3], golden[2][89]) < TOL
    assert max_diff(out[0], golden[2][39]) < TOL
    # and the states moved on: one more decode each, still golden
    more = e.forward(np.array([LONG[40], LONG[90]]), [Span(4, 40, 1), Span(0, 90, 1)])
    assert max_diff(more, golden[2][[40, 90]]) < TOL


def test_a_state_is_resumed_only_where_it_is(paths):
    e = engine(paths["gguf"], n_slots=2)
    e.forward(np.array(LONG[:20]), [Span(0, 0, 20)])
    with pytest.raises(StateError, match="20 positions, not 19"):
        e.forward(np.array(LONG[19:22]), [Span(0, 19, 3)])
    with pytest.raises(StateError):
        e.model.state.save(0, 10)


def test_forks_saves_and_restores_give_the_cold_logits(paths, golden):
    e = engine(paths["gguf"])
    state = e.model.state
    e.forward(np.array(LONG[:70]), [Span(0, 0, 70)])
    state.copy_prefix(0, 2, 70)                                   # a fork at the whole length
    fork = e.forward(np.array(LONG[70:]), [Span(2, 70, 80)])
    assert max_diff(fork[0], golden[2][-1]) < TOL
    saved, nbytes = state.save(0, 70)
    assert nbytes == e.cfg.fixed_bytes_per_slot() + 70 * e.cfg.kv_bytes_per_token(4)
    e.forward(np.array(TOKENS[1]), [Span(0, 0, 7)])               # the slot is reused
    assert state.restore(3, saved) == 70
    got = e.forward(np.array(LONG[70:]), [Span(3, 70, 80)])
    assert max_diff(got[0], fork[0]) < SELF


# -- the scheduler: forks, the host cache and session turns -----------------------------
def run(sched, *reqs):
    for r in reqs:
        sched.add(r)
    outs, last, lps = {r.id: [] for r in reqs}, {}, {r.id: [] for r in reqs}
    while sched.active():
        for o in sched.step():
            outs[o.request_id] += o.tokens
            lps[o.request_id] += o.logprobs
            last[o.request_id] = o
    return outs, last, lps


def cold(path, req):
    return run(engine(path, n_slots=1).scheduler, req)


def same_logprobs(a, b, tol=1e-4):
    """Per token: the chosen logprob and the top-5 ids and logprobs."""
    assert len(a) == len(b)
    for (lp_a, top_a), (lp_b, top_b) in zip(a, b):
        assert abs(lp_a - lp_b) < tol
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) < tol


def test_n_forks_share_one_prefill(paths):
    prompt = LONG[:50]
    want = cold(paths["gguf"], Request("x", prompt, GREEDY, 8))[0]["x"]
    e = engine(paths["gguf"], n_slots=3)
    outs, last, _ = run(e.scheduler, *(Request(str(i), prompt, GREEDY, 8) for i in range(3)))
    assert all(o == want for o in outs.values())
    assert sorted(o.cached_tokens for o in last.values()) == [0, 49, 49]


def test_session_turns_resume_the_state_with_the_cold_logits(paths):
    """Turn 2 of a session skips turn 1's whole history (its slot, then the host cache
    after the slot went to others) and gives the logits of a cold run of the same prompt."""
    path, sid = paths["gguf"], "chat-1"
    e = engine(path, n_slots=2, prefix_cache_bytes=1 << 24)
    turn1 = LONG[:40]
    outs, last, _ = run(e.scheduler, Request("t1", turn1, GREEDY, 6, session_id=sid, logprobs=5))
    reply = outs["t1"]
    assert last["t1"].cached_tokens == 0
    turn2 = turn1 + reply + LONG[40:55]
    outs, last, lps = run(e.scheduler, Request("t2", turn2, GREEDY, 6, session_id=sid, logprobs=5))
    assert last["t2"].cached_tokens == len(turn1) + len(reply) - 1    # the last reply token
    c_outs, c_last, c_lps = cold(path, Request("c2", turn2, GREEDY, 6, logprobs=5))
    assert outs["t2"] == c_outs["c2"] and c_last["c2"].cached_tokens == 0
    same_logprobs(lps["t2"], c_lps["c2"])
    # both slots go to other conversations: the session's state moves to the host cache
    run(e.scheduler, Request("o1", LONG[60:90], GREEDY, 3), Request("o2", LONG[90:120], GREEDY, 3))
    assert e.scheduler.cache.stats()["entries"] >= 1
    turn3 = turn2 + outs["t2"] + LONG[120:130]
    outs, last, lps = run(e.scheduler, Request("t3", turn3, GREEDY, 6, session_id=sid, logprobs=5))
    assert last["t3"].cached_tokens == len(turn2) + 5
    c_outs, _, c_lps = cold(path, Request("c3", turn3, GREEDY, 6, logprobs=5))
    assert outs["t3"] == c_outs["c3"]
    same_logprobs(lps["t3"], c_lps["c3"])


def test_without_a_session_only_whole_snapshots_are_reused(paths):
    """A prompt sharing part of a stored history gets nothing (no snapshot at that
    length); one extending a stored history whole resumes it, and says so."""
    path = paths["gguf"]
    e = engine(path, n_slots=1, prefix_cache_bytes=1 << 24)
    first = LONG[:30]
    reply = run(e.scheduler, Request("a", first, GREEDY, 4))[0]["a"]
    shared = first[:20] + LONG[100:110]                          # 20 tokens in common: a cut
    outs, last, _ = run(e.scheduler, Request("b", shared, GREEDY, 4))
    assert last["b"].cached_tokens == 0 and outs["b"] == cold(path, Request("x", shared, GREEDY, 4))[0]["x"]
    # "a" went to the host cache when "b" took the slot; its whole history prefixes this
    longer = first + reply + [7, 8]
    outs, last, _ = run(e.scheduler, Request("c", longer, GREEDY, 4))
    assert last["c"].cached_tokens == len(first) + 3
    assert outs["c"] == cold(path, Request("x", longer, GREEDY, 4))[0]["x"]


# -- quantized weights -------------------------------------------------------------------
def agreement(ref, got, tie: float = 0.05):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    lp = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
    lq = got - np.logaddexp.reduce(got, axis=1, keepdims=True)
    kl = (np.exp(lp) * (lp - lq)).sum(1)
    agree = ref[np.arange(len(ref)), got.argmax(1)] >= ref.max(1) - tie
    return float(agree.mean()), float(kl.mean())


@pytest.mark.parametrize("source, mode", [("gguf", "q8_0"), ("hf", "q8_0"), ("Q8_0", "auto")])
def test_quantized_weights_stay_close_and_split_invariant(paths, golden, source, mode):
    e = engine(paths[source], quantize=mode)
    assert all(isinstance(m, QMatrix) for m in e.model.w.matrices()[1:])
    rows = [e.forward(np.array(LONG[:100]), [Span(0, 0, 100)])[0]]
    rows += [e.forward(np.array([t]), [Span(0, 100 + i, 1)])[0] for i, t in enumerate(LONG[100:])]
    agree, kl = agreement(golden[2][99:], np.stack(rows))
    print(f"qwen35 {source} quantize={mode} vs transformers fp32: top-1 {agree:.3f}, KL {kl:.4f}")
    # this random 4-layer model amplifies weight rounding (the F16 GGUF is 0.15 off the
    # F32 logits) and its logits are near-flat; measured over these 51 positions: top-1
    # 0.90-0.96 (a pick within 0.05 of the best counts), mean KL 0.008-0.009 nats
    assert agree >= 0.85 and kl <= 0.02
    split = prefill(e, LONG, 1, [37, 64, 49])
    assert max_diff(split[-1], e.forward(np.array(LONG), [Span(2, 0, 150)])[0]) < 1e-3


# -- bad files ---------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"drop": ["blk.1.ssm_a"]}, "lacks tensor blk.1.ssm_a"),
    ({"drop": ["blk.2.attn_q_norm.weight"]}, "lacks tensor blk.2.attn_q_norm.weight"),
    ({"reshape": {"blk.0.attn_qkv.weight": 128}}, r"tensor blk.0.attn_qkv.weight has shape \[128, 64\]"),
    ({"reshape": {"blk.2.attn_q.weight": 128}}, r"tensor blk.2.attn_q.weight has shape \[128, 64\]"),
    ({"drop_keys": ["qwen35.ssm.conv_kernel"]}, "GGUF key qwen35.ssm.conv_kernel is missing"),
])
def test_bad_files_are_load_errors_naming_the_tensor_or_field(paths, tmp_path, change, message):
    bad = tm.rewrite_gguf(paths["gguf"], tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelFileError, match=message):
        check_tensors(read_config(bad), tensor_list(bad))        # the frontend, before upload
    with pytest.raises(ModelFileError, match=message):
        load_engine(bad, n_slots=1, ctx=16)                       # the worker's loader


def test_bad_checkpoints_name_the_tensor_or_field(paths, tmp_path):
    from safetensors.numpy import save_file
    folder = tm.write_safetensors_dir("qwen35", tmp_path / "hf")
    weights = tm.make_weights("qwen35")
    del weights["model.layers.3.linear_attn.dt_bias"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelFileError, match="lacks tensor blk.3.ssm_dt.bias"):
        check_tensors(read_config(folder), tensor_list(folder))
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(raw, linear_num_value_heads=4)))
    with pytest.raises(ModelFileError, match=r"tensor blk.0.attn_qkv.weight has shape \[160, 64\], "
                                             r"but the config implies \[128, 64\]"):
        check_tensors(read_config(folder), tensor_list(paths["hf"]))


# -- served end to end -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tm.write_gguf("qwen35", tmp_path_factory.mktemp("srv") / "qwen35-think.gguf",
                         chat_template=tm.THINK_TEMPLATE)
    with Server("--model", str(path), "--name", "tiny-qwen35", "--slots", "2",
                "--ctx", "256") as srv:
        srv.path = path
        yield srv


def test_tiny_qwen35_served_over_http(server):
    """/v1/completions (token ids in) gives the in-process greedy reply; a session's second
    turn reports the history it resumed, with the same reply as a cold run."""
    prompt, no_eos = LONG[:30], SamplingParams(temperature=0, logit_bias={2: -100.0})
    want = cold(server.path, Request("x", prompt, no_eos, 6))[0]["x"]
    body = {"model": "tiny-qwen35", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "logit_bias": {"2": -100}}
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={**body, "session_id": "s"})
    assert r.status_code == 200, r.text
    got = r.json()
    tok = open_tokenizer(server.path)
    assert got["choices"][0]["text"] == tok.decode(want)
    assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    turn2 = prompt + want + LONG[30:40]
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={**body, "prompt": turn2, "session_id": "s"})
    want2 = cold(server.path, Request("y", turn2, no_eos, 6))[0]["y"]
    assert r.json()["choices"][0]["text"] == tok.decode(want2)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) + 5}


def test_a_think_template_separates_reasoning_and_the_greedy_ids_are_transformers(server):
    """The template opens <think>: the reply is reasoning until </think> (this random model
    never closes it), and its greedy ids are transformers' on the same prompt."""
    extra = tm.load_qwen35_golden_extra()
    want = extra["think_greedy"].tolist()
    tok = open_tokenizer(server.path)
    client = server.client()
    chat = client.chat.completions.create(
        model="tiny-qwen35", messages=tm.THINK_MESSAGES, max_tokens=len(want), temperature=0,
        logprobs=True, top_logprobs=1)
    assert chat.usage.prompt_tokens == len(extra["think_prompt"])
    msg = chat.choices[0].message
    assert [lp.token for lp in chat.choices[0].logprobs.content] == [tok.token_str(i) for i in want]
    assert msg.content in (None, "")
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning == tok.decode(want)
    # streamed: the same reasoning in reasoning_content deltas, no content
    parts, content = [], []
    for chunk in client.chat.completions.create(
            model="tiny-qwen35", messages=tm.THINK_MESSAGES, max_tokens=len(want),
            temperature=0, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
    assert "".join(parts) == reasoning and "".join(content) == ""
