"""Qwen3.5's mixer math (worker/layers/gated_deltanet.py) and file layout (common/arch/qwen35.py).

A reference forward of the tiny qwen35 model (tests/qwen35_reference.py: the converter's
GGUF layout, whole sequences, the engine's pure functions), against transformers' logits and layer states (tests/golden/qwen35.npz),
from the safetensors folder and from the GGUF that llama.cpp's converter would
write; then the properties the serving engine leans on: a prompt gives the same
state in one chunk, many chunks or token by token; decode after a prefill equals
the full forward; the state has one size at every position; bad files fail with
an error that names the tensor or the field.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import tiny_models as tm
from pantheon.common.gguf_file import open_gguf
from pantheon.common.model_file import ModelFileError
from pantheon.worker import matrices as qm
from pantheon.common.arch.qwen35 import hf_name
from pantheon.common.model_file import config_from_gguf, read_config
from pantheon.worker.layers import gated_deltanet as gdn
from pantheon.worker.layers import ops as lops

import qwen35_reference as ref

TOL = 1e-4          # float32 against transformers' float32
F32 = np.float32
CFG = ref.config(tm.CONFIGS["qwen35"])
TOKENS = tm.golden_tokens("qwen35")
LONG = TOKENS[2]    # 150 tokens: more than two 64-token chunks


# --- the reference forward ----------------------------------------------------------------

def read_gguf_tensors(path) -> dict[str, np.ndarray]:
    reader = open_gguf(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        [int(n) for n in reversed(t.shape)]).astype(F32) for t in reader.tensors}


def new_states(cfg=CFG):
    return [ref.new_deltanet_state(cfg) if cfg.is_linear(i) else (None, None)
            for i in range(cfg.n_layers)]


def forward(tokens, model, states, start: int, cfg=CFG):
    """Tokens [start, start + n) of one sequence → (logits [n, V], new states)."""
    glob, layers = model
    x = glob["token_embd"][np.asarray(tokens)]
    states = list(states)
    for i, w in enumerate(layers):
        h = lops.rms_norm(x, w["attn_norm"], cfg.rms_eps)
        if cfg.is_linear(i):
            y, tail, s = ref.gated_deltanet(h, w, cfg, *states[i])
            states[i] = (tail, s)
        else:
            y, k, v = ref.gated_attention(h, w, cfg, start, *states[i])
            states[i] = (k, v)
        x = x + y
        x = x + ref.mlp(lops.rms_norm(x, w["post_attention_norm"], cfg.rms_eps), w)
    return lops.rms_norm(x, glob["output_norm"], cfg.rms_eps) @ glob["output"], states


def decode_batch(tokens, model, batch_states, starts, cfg=CFG):
    """One token for each of B sequences in one step: the projections for all rows at
    once, the DeltaNet recurrence batched, attention per sequence."""
    glob, layers = model
    x = glob["token_embd"][np.asarray(tokens)]                     # [B, D]
    out = [list(s) for s in batch_states]
    for i, w in enumerate(layers):
        h = lops.rms_norm(x, w["attn_norm"], cfg.rms_eps)
        if cfg.is_linear(i):
            mixed, z, beta, g = ref.deltanet_project(h, w, cfg)
            tails = np.stack([s[i][0] for s in out])
            ssm = np.stack([s[i][1] for s in out])
            o, tails, ssm = gdn.deltanet_core_decode(mixed, beta, g, w["ssm_conv1d"], cfg, tails, ssm)
            y = ref.deltanet_output(o, z, w, cfg)
            for b, s in enumerate(out):
                s[i] = (tails[b], ssm[b])
        else:
            rows = []
            for b, s in enumerate(out):
                yb, k, v = ref.gated_attention(h[b:b + 1], w, cfg, starts[b], *s[i])
                s[i] = (k, v)
                rows.append(yb)
            y = np.concatenate(rows)
        x = x + y
        x = x + ref.mlp(lops.rms_norm(x, w["post_attention_norm"], cfg.rms_eps), w)
    return lops.rms_norm(x, glob["output_norm"], cfg.rms_eps) @ glob["output"], out


def prefill(tokens, model, splits):
    """Prefill in chunks of the given sizes; returns (logits [n, V], states)."""
    states, rows, pos = new_states(), [], 0
    for n in splits:
        logits, states = forward(tokens[pos:pos + n], model, states, pos)
        rows.append(logits)
        pos += n
    assert pos == len(tokens)
    return np.concatenate(rows), states


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35")
    return {"hf": tm.write_safetensors_dir("qwen35", d / "hf"),
            **{t: tm.write_gguf("qwen35", d / f"tiny-{t}.gguf", t) for t in ("F32", "F16", "Q8_0")}}


@pytest.fixture(scope="module")
def model():
    """From the checkpoint's tensors through the converter's transforms."""
    return ref.dense_layers(ref.from_hf_tensors(tm.make_weights("qwen35"), CFG), CFG)


@pytest.fixture(scope="module")
def golden():
    return tm.load_golden("qwen35"), tm.load_qwen35_golden_extra()


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def scale(a) -> float:
    """A tolerance's unit: the largest magnitude of `a`, at least 1."""
    return max(1.0, float(np.abs(np.asarray(a)).max()))


# --- against transformers -----------------------------------------------------------------

def test_safetensors_folder_matches_transformers(files, golden):
    from safetensors.numpy import load_file
    import json
    cfg = ref.Ref(read_config(files["hf"]))
    assert cfg.cfg.blocks == CFG.cfg.blocks and cfg.cfg.d_model == CFG.cfg.d_model
    m = ref.dense_layers(ref.from_hf_tensors(load_file(str(files["hf"] / "model.safetensors")), cfg), cfg)
    worst = 0.0
    for toks, want in zip(TOKENS, golden[0]):
        got, _ = forward(toks, m, new_states(), 0)
        worst = max(worst, max_diff(got, want))
    print(f"qwen35 safetensors vs transformers: max |diff| {worst:.2e}")
    assert worst < TOL


def test_gguf_matches_transformers(files, golden):
    reader = open_gguf(files["F32"])
    cfg = ref.Ref(config_from_gguf(reader))
    assert cfg.layer_types == CFG.layer_types and cfg.rotary_dim == 8 and cfg.d_v == 16
    m = ref.dense_layers(read_gguf_tensors(files["F32"]), cfg)
    worst = max(max_diff(forward(toks, m, new_states(cfg), 0, cfg)[0], want)
                for toks, want in zip(TOKENS, golden[0]))
    print(f"qwen35 GGUF F32 vs transformers: max |diff| {worst:.2e}")
    assert worst < TOL


def test_f16_gguf_matches_transformers_on_half_weights(files, golden):
    """The F16 GGUF against transformers run on the same half-rounded weights."""
    cfg = ref.Ref(read_config(files["F16"]))
    m = ref.dense_layers(read_gguf_tensors(files["F16"]), cfg)
    worst = max(max_diff(forward(toks, m, new_states(cfg), 0, cfg)[0], golden[1][f"f16_seq{i}"])
                for i, toks in enumerate(TOKENS))
    print(f"qwen35 GGUF F16 vs transformers on F16-rounded weights: max |diff| {worst:.2e}")
    assert worst < TOL


def agreement(ref, got, tie: float = 0.05):
    """(top-1 agreement, mean KL(ref || got) in nats) over positions; a pick whose reference
    logit is within `tie` of the best counts as agreeing (random weights give near-ties)."""
    ref, got = np.concatenate(ref).astype(np.float64), np.concatenate(got).astype(np.float64)
    lp = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
    lq = got - np.logaddexp.reduce(got, axis=1, keepdims=True)
    kl = (np.exp(lp) * (lp - lq)).sum(1)
    pick = got.argmax(1)
    agree = ref[np.arange(len(ref)), pick] >= ref.max(1) - tie
    return float(agree.mean()), float(kl.mean())


def test_q8_0_gguf_stays_close(files, golden):
    cfg = ref.Ref(read_config(files["Q8_0"]))
    m = ref.dense_layers(read_gguf_tensors(files["Q8_0"]), cfg)
    got = [forward(toks, m, new_states(cfg), 0, cfg)[0] for toks in TOKENS]
    agree, kl = agreement(golden[0], got)
    print(f"qwen35 GGUF Q8_0 vs transformers (F32): top-1 {agree:.3f}, mean KL {kl:.4f}")
    # measured 0.935 / 0.011: this random 4-layer model amplifies weight rounding (its F16
    # GGUF is 0.15 off the F32 logits, yet 7e-5 off transformers on the same F16 weights)
    assert agree >= 0.9 and kl <= 0.02


def test_quantized_projections_through_linear_seam(model, golden):
    """Every projection as a QMatrix (q8_0 blocks): the mixers only call linear.matmul."""
    glob, layers = model
    qlayers = []
    for w in layers:
        q = dict(w)
        for key, a in w.items():
            if a.ndim == 2 and key != "ssm_conv1d" and a.shape[0] % 32 == 0:
                q[key] = qm.quantize(np.ascontiguousarray(a.T), "q8_0")      # [out, in]
        assert sum(isinstance(v, qm.QMatrix) for v in q.values()) >= 5
        qlayers.append(q)
    got = [forward(toks, (glob, qlayers), new_states(), 0)[0] for toks in TOKENS]
    agree, kl = agreement(golden[0], got)
    print(f"qwen35 q8_0 QMatrix projections vs transformers: top-1 {agree:.3f}, mean KL {kl:.4f}")
    assert agree >= 0.9 and kl <= 0.02          # measured 0.952 / 0.007


def hf_state(conv, ssm, cfg=CFG):
    """transformers' layer state (grouped v heads, conv [C, K]) → ours (tiled, [K-1, C])."""
    r, kd2 = cfg.n_v_heads // cfg.n_k_heads, 2 * cfg.key_dim
    tail = conv[:, 1:].T
    v = ref.reorder_v_heads(tail[:, kd2:], 1, cfg.n_k_heads, r, cfg.d_v)
    return (np.concatenate([tail[:, :kd2], v], axis=1),
            ref.reorder_v_heads(ssm, 0, cfg.n_k_heads, r, 1))


def test_states_match_transformers(model, golden):
    extra = golden[1]
    for i, toks in enumerate(TOKENS):
        _, states = forward(toks, model, new_states(), 0)
        for layer in range(CFG.n_layers):
            if not CFG.is_linear(layer):
                assert states[layer][0].shape == (len(toks), CFG.n_kv_heads, CFG.head_dim)
                continue
            want_tail, want_ssm = hf_state(extra[f"seq{i}_conv{layer}"], extra[f"seq{i}_ssm{layer}"])
            # float32 both sides, sums in another order: 1e-5 of the state's scale
            assert max_diff(states[layer][0], want_tail) < 1e-5 * scale(want_tail), (i, layer)
            assert max_diff(states[layer][1], want_ssm) < 1e-5 * scale(want_ssm), (i, layer)


def test_think_prompt_and_greedy_continuation(model, golden, tmp_path):
    """The <think> template golden: Pantheon renders and tokenizes the prompt to the ids
    transformers ran, and our forward picks the same greedy tokens on the same logits."""
    from pantheon.common.chat_template import ChatTemplate
    from pantheon.common.tokenizer import Tokenizer
    extra = golden[1]
    path = tm.write_gguf("qwen35", tmp_path / "think.gguf", chat_template=tm.THINK_TEMPLATE)
    tok = Tokenizer.from_gguf(path)
    text = ChatTemplate(tok.chat_template, tok.bos_text, tok.eos_text).render(
        tm.THINK_MESSAGES, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert tok.encode(text) == extra["think_prompt"].tolist()
    seq = extra["think_prompt"].tolist() + extra["think_greedy"].tolist()
    logits, _ = forward(seq, model, new_states(), 0)
    got = logits[len(extra["think_prompt"]) - 1:-1]
    assert max_diff(got, extra["think_logits"]) < TOL
    assert got.argmax(-1).tolist() == extra["think_greedy"].tolist()


# --- chunking, decode, state size ---------------------------------------------------------

@pytest.mark.parametrize("splits", [[150], [37, 64, 49], [1] * 150, [2, 3, 70, 1, 74]])
def test_prefill_splits_agree(model, golden, splits):
    whole, s_whole = prefill(LONG, model, [150])
    got, s_got = prefill(LONG, model, splits)
    assert max_diff(got, golden[0][2]) < TOL
    assert max_diff(got, whole) < TOL          # float32 rounding of a different summation order
    for layer in range(CFG.n_layers):
        for a, b in zip(s_got[layer], s_whole[layer]):
            assert a.shape == b.shape and max_diff(a, b) < 5e-5, (layer, max_diff(a, b))


def test_decode_after_prefill_equals_full_forward(model, golden):
    split = 100
    _, states = prefill(LONG[:split], model, [split])
    rows = []
    for pos in range(split, len(LONG)):
        logits, (states,) = decode_batch([LONG[pos]], model, [states], [pos])
        rows.append(logits[0])
    assert max_diff(np.stack(rows), golden[0][2][split:]) < TOL


def test_batched_decode_equals_one_by_one(model):
    """Three sequences at different positions decoded in one step."""
    seqs = [TOKENS[0], TOKENS[1], LONG[:40]]
    states = [prefill(s[:-1], model, [len(s) - 1])[1] for s in seqs]
    batch, new = decode_batch([s[-1] for s in seqs], model, states, [len(s) - 1 for s in seqs])
    for b, s in enumerate(seqs):
        alone, st = decode_batch([s[-1]], model, [states[b]], [len(s) - 1])
        assert max_diff(batch[b], alone[0]) < 1e-5
        full, _ = forward(s, model, new_states(), 0)
        assert max_diff(batch[b], full[-1]) < TOL
        for layer in range(CFG.n_layers):
            for x, y in zip(new[b][layer], st[0][layer]):
                assert max_diff(x, y) < 1e-5


def test_recurrent_state_has_one_size_at_every_position(model):
    sizes = []
    for n in (1, 10, 150):
        _, states = prefill(LONG[:n], model, [n])
        sizes.append([(a.shape, a.dtype) for layer, s in enumerate(states) if CFG.is_linear(layer)
                      for a in s])
        nbytes = sum(a.nbytes for layer, s in enumerate(states) if CFG.is_linear(layer) for a in s)
        assert nbytes == CFG.state_bytes()
    assert sizes[0] == sizes[1] == sizes[2]
    assert sizes[0][:2] == [((3, CFG.conv_dim), np.float32),
                            ((CFG.n_v_heads, CFG.d_k, CFG.d_v), np.float32)]


# --- the ops alone ------------------------------------------------------------------------

def naive_rule(q, k, v, g, beta, state):
    """The gated delta rule in float64, one head and one token at a time."""
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(v.shape[0]):
        for h in range(v.shape[1]):
            s[h] *= np.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] += np.outer(k[t, h], u)
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def random_rule_inputs(n, H=3, dk=8, dv=12, seed=0):
    rng = np.random.default_rng(seed)
    q = lops.l2_normalize(rng.standard_normal((n, H, dk)).astype(F32)) * F32(dk ** -0.5)
    k = lops.l2_normalize(rng.standard_normal((n, H, dk)).astype(F32))
    v = rng.standard_normal((n, H, dv)).astype(F32)
    g = -rng.uniform(0.0, 1.5, (n, H)).astype(F32)
    beta = rng.uniform(0.0, 1.0, (n, H)).astype(F32)
    state = rng.standard_normal((H, dk, dv)).astype(F32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 2, 3, 17, 63, 64, 65, 130])
def test_chunked_and_recurrent_rule_agree(n):
    """d_k != d_v and a non-zero starting state, against a float64 loop."""
    args = random_rule_inputs(n, seed=n)
    want_o, want_s = naive_rule(*args)
    for fn in (gdn.gated_delta_rule_recurrent, gdn.gated_delta_rule_chunked, gdn.gated_delta_rule):
        o, s = fn(*args)
        assert o.dtype == F32 and s.dtype == F32 and s.shape == (3, 8, 12)
        assert max_diff(o, want_o) < 1e-4 and max_diff(s, want_s) < 1e-4, fn.__name__
    # the input state is left as it was
    assert max_diff(args[5], random_rule_inputs(n, seed=n)[5]) == 0.0


def test_rule_over_any_split_of_the_tokens():
    q, k, v, g, beta, s0 = random_rule_inputs(100, seed=7)
    whole_o, whole_s = gdn.gated_delta_rule_chunked(q, k, v, g, beta, s0)
    s, rows, pos = s0, [], 0
    for n in (5, 64, 1, 30):
        o, s = gdn.gated_delta_rule_chunked(q[pos:pos + n], k[pos:pos + n], v[pos:pos + n],
                                            g[pos:pos + n], beta[pos:pos + n], s)
        rows.append(o)
        pos += n
    assert max_diff(np.concatenate(rows), whole_o) < 1e-5 and max_diff(s, whole_s) < 1e-5


def test_unit_lower_inverse():
    rng = np.random.default_rng(3)
    for L in (1, 2, 8, 64):
        a = np.tril(rng.uniform(-1, 1, (2, 3, L, L)), -1).astype(F32)
        got = gdn.unit_lower_inverse(a)
        want = np.linalg.inv(a.astype(np.float64) + np.eye(L))
        assert max_diff(got, want) < 1e-4 * max(1.0, float(np.abs(want).max()))
    with pytest.raises(ValueError, match="power of two"):
        gdn.unit_lower_inverse(np.zeros((3, 3), F32))


def test_conv_streams_across_chunks_and_steps():
    rng = np.random.default_rng(5)
    C, K, n = 10, 4, 23
    x = rng.standard_normal((n, C)).astype(F32)
    kernel = rng.standard_normal((C, K)).astype(F32)
    zero = np.zeros((K - 1, C), F32)
    whole, tail = gdn.causal_conv1d_silu(x, kernel, zero)
    padded = np.concatenate([zero, x])
    want = np.stack([(padded[t:t + K] * kernel.T).sum(0) for t in range(n)])
    assert max_diff(whole, want * (1 / (1 + np.exp(-want)))) < 1e-5
    assert max_diff(tail, x[-(K - 1):]) == 0.0
    rows, t = [], zero
    for lo, hi in ((0, 1), (1, 3), (3, 20), (20, 23)):
        y, t = gdn.causal_conv1d_silu(x[lo:hi], kernel, t)
        rows.append(y)
    assert max_diff(np.concatenate(rows), whole) < 1e-6 and max_diff(t, tail) == 0.0
    t, rows = zero[None], []
    for i in range(n):
        y, t = gdn.causal_conv1d_silu_step(x[i:i + 1], kernel, t)
        rows.append(y[0])
    assert max_diff(np.stack(rows), whole) < 1e-6 and max_diff(t[0], tail) == 0.0


def test_partial_rope_leaves_the_other_dims():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 2, 32)).astype(F32)
    cos, sin = ref.rope_tables(np.arange(3, 8), CFG)
    y = ref.partial_rope(x, cos, sin)
    assert cos.shape == (5, 4) and y.dtype == F32
    assert np.array_equal(y[..., 8:], x[..., 8:])
    # a rotation: pairs (i, i + 4) keep their norm
    n = lambda a: a[..., :4] ** 2 + a[..., 4:8] ** 2      # noqa: E731
    assert max_diff(n(y), n(x)) < 1e-5
    cos0, sin0 = ref.rope_tables([0], CFG)
    assert np.array_equal(ref.partial_rope(x[:1], cos0, sin0), x[:1])


# --- the file layout ----------------------------------------------------------------------

def test_converter_transforms_and_their_inverse():
    w = tm.make_weights("qwen35")
    ours = ref.from_hf_tensors(w, CFG)
    theirs = tm.qwen35_gguf_tensors()
    assert set(ours) == set(theirs) == set(ref.tensor_shapes(CFG))
    assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)
    back = ref.to_hf_tensors(theirs, CFG)
    assert set(back) == set(w)
    assert max(max_diff(back[k], w[k]) for k in w) < 3e-7     # the +1 and exp, rounded
    # the reorder is a real permutation here, and its inverse undoes it
    a = np.arange(CFG.value_dim * 2).reshape(CFG.value_dim, 2)
    r = CFG.n_v_heads // CFG.n_k_heads
    tiled = ref.reorder_v_heads(a, 0, CFG.n_k_heads, r, CFG.d_v)
    assert not np.array_equal(tiled, a)
    assert np.array_equal(ref.reorder_v_heads(tiled, 0, r, CFG.n_k_heads, CFG.d_v), a)


def test_multimodal_wrapper_config_and_names():
    text = {k: v for k, v in tm.CONFIGS["qwen35"].items() if k not in ("architectures",)}
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {}}
    got = ref.config(wrapped).cfg
    assert got.blocks == CFG.cfg.blocks and got.tied_embeddings and got.rope_theta == 1e7
    assert hf_name("model.language_model.layers.3.linear_attn.A_log") == "blk.3.ssm_a"
    assert hf_name("model.layers.2.post_attention_layernorm.weight") == \
        "blk.2.post_attention_norm.weight"
    assert hf_name("mtp.layers.0.mlp.up_proj.weight") is None
    assert hf_name("model.visual.blocks.0.attn.qkv.weight") is None


def test_layer_types_from_interval_when_not_listed():
    cfg = dict(tm.CONFIGS["qwen35"], num_hidden_layers=8)
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 4
    assert ref.config(cfg).layer_types == tuple(
        "full_attention" if i in (3, 7) else "linear_attention" for i in range(8))


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["linear_num_key_heads", "linear_value_head_dim", "hidden_size"])
def test_missing_config_field_is_named(field):
    cfg = dict(tm.CONFIGS["qwen35"])
    del cfg[field]
    with pytest.raises(ModelFileError, match=f"config.json field '{field}' is missing"):
        ref.config(cfg)


def test_inconsistent_config_is_refused():
    with pytest.raises(ModelFileError, match="not a multiple of linear_num_key_heads"):
        ref.config(dict(tm.CONFIGS["qwen35"], linear_num_value_heads=5))
    with pytest.raises(ModelFileError, match="layer_types .* do not describe 4"):
        ref.config(dict(tm.CONFIGS["qwen35"], layer_types=["linear_attention"] * 3))
    with pytest.raises(ModelFileError, match="rotary dim 66 does not fit head_dim 32"):
        ref.config(dict(tm.CONFIGS["qwen35"], rope_parameters={"partial_rotary_factor": 2.07}))
    with pytest.raises(ModelFileError, match="lacks text_config"):
        ref.config({"model_type": "qwen3_5"})


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class _Reader:
    """Enough of a GGUFReader for config_from_gguf: fields and tensor names/shapes."""

    def __init__(self, path, drop: str):
        real = open_gguf(path)
        self.fields = {k: _Field(f.contents()) for k, f in real.fields.items()
                       if k != drop and not k.startswith("tokenizer.")}
        self.tensors = real.tensors


@pytest.mark.parametrize("key", ["qwen35.ssm.conv_kernel", "qwen35.ssm.time_step_rank",
                                 "qwen35.rope.dimension_count", "qwen35.ssm.state_size"])
def test_missing_gguf_metadata_is_named(files, key):
    with pytest.raises(ModelFileError, match=f"GGUF key {key} is missing"):
        config_from_gguf(_Reader(files["F32"], key))
    # full_attention_interval may be absent: llama.cpp then uses 4
    cfg = ref.Ref(config_from_gguf(_Reader(files["F32"], "qwen35.full_attention_interval")))
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
