"""Tiny random models for checking our forward pass against Hugging Face.

numpy + gguf + safetensors only: the test environment has no torch. The
reference logits in tests/golden/{name}.npz were computed by `transformers`
from exactly these configs and weights (see tests/golden/make_golden.py, which
runs outside the test venv and also proves that `write_gguf` lays the weights
out the way llama.cpp's convert_hf_to_gguf.py does, by loading the GGUF back
through transformers' own GGUF loader).

    CONFIGS[name]            Hugging Face config.json dicts
    make_weights(name)       {HF parameter name: float32 array}, deterministic
    write_safetensors_dir()  config.json + model.safetensors (HF folder layout)
    write_gguf()             a llama.cpp-style GGUF (F32, or F16 2-D weights)
    GOLDEN_TOKENS            the two token sequences the golden logits are for
    golden_tokens(name)      those, or a model's own list (qwen35 adds a 150-token one)
    load_golden(name)        [T, vocab] float32 logits per golden_tokens(name) entry
    qwen35_gguf_tensors()    what llama.cpp's converter writes for the tiny qwen35
    load_qwen35_golden_extra() its layer states after each prompt, the <think> prompt

qwen35 (Qwen3.5: Gated DeltaNet + gated attention) is checked by
tests/test_qwen35_ops.py with a reference forward of its own; transformers'
GGUF loader does not know the architecture, so make_golden.py checks its GGUF
by undoing the converter's transforms and loading the result as a state dict.

Changing CONFIGS, make_weights, the seeds or GOLDEN_TOKENS invalidates the
golden files: rerun make_golden.py (tests/golden/README.md says how).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"

_COMMON = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

CONFIGS: dict[str, dict] = {
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    },
    "llama3": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        # original_max_position_embeddings 64 (not Llama 3.1's 8192) so that at
        # head_dim 16 and theta 5e5 all three bands of the llama3 rule are hit:
        # wavelengths 6.3 (< 64/4: kept), 32.4 (between: smoothed, factor ~2.44)
        # and 167.. (> 64/1: divided by 8). With 32, 32.4 would fall just past
        # the low-frequency edge and the smoothed band would go untested.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        **_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 32,  # deliberately != hidden_size / num_attention_heads (16)
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "tie_word_embeddings": False,
    },
    # Qwen3.5: Gated DeltaNet layers with a gated-attention layer every third
    # (llama.cpp derives the pattern from full_attention_interval, so the two
    # agree). linear_num_value_heads 6 != linear_num_key_heads 2 exercises the
    # converter's v-head reorder; head_dim 32 with partial_rotary_factor 0.25
    # ropes 8 of 32 dims. d_k == d_v: llama.cpp sizes the state with
    # ssm.state_size for both. Tied head, as in Qwen3.5's small models.
    "qwen35": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "full_attention_interval": 3,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True},
    },
}

# Gemma 3: six layers as llama.cpp reads a GGUF (every 6th global, the rest local), a
# window of 4 (shorter than the golden sequences, so it cuts), head_dim 32 != d / heads,
# linear rope scaling on the global layer only, the transformers 5 rope spelling.
CONFIGS["gemma3"] = {
    **_COMMON,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 32,   # GGUF carries none: llama.cpp takes head_dim
    "sliding_window": 4,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "attention_bias": False,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "pad_token_id": 0,
    "tie_word_embeddings": True,
}
del CONFIGS["gemma3"]["hidden_act"]

# (gemma3 and qwen35 share a seed: their shapes differ, and both golden files use it)
_SEEDS = {"llama": 1001, "llama3": 1002, "qwen2": 1003, "qwen3": 1004, "gemma3": 1005,
          "qwen35": 1005}

# ids < 320; the first is 11 tokens, the second 7 (with a repeat, so attention
# to an identical earlier token is exercised).
GOLDEN_TOKENS: list[list[int]] = [
    [1, 17, 250, 3, 99, 311, 42, 42, 128, 7, 200],
    [1, 300, 5, 64, 5, 271, 19],
]

# qwen35 also has a 150-token prompt: more than two of transformers' 64-token
# delta-rule chunks, so its chunked path and the state carried between chunks
# are in the reference too.
GOLDEN_TOKENS_BY_NAME: dict[str, list[list[int]]] = {
    "qwen35": GOLDEN_TOKENS + [[1] + [(7 * i * i + 3 * i + 11) % 317 + 3 for i in range(149)]],
}

# A Qwen3.5-style reasoning template: the assistant turn opens <think>.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
THINK_MESSAGES = [{"role": "user", "content": "why is the sky blue"}]

GGUF_ARCH = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma3": "gemma3", "qwen35": "qwen35"}


def head32(name: str) -> str:
    """`name` ("llama", "qwen2") with heads of 32, registered when first asked (not at
    import: tests that run every config have golden logits for the configs above only):
    a q8_0 / q4_0 KV cache holds whole blocks of 32 along the head (16 has none)."""
    if "head_dim" in CONFIGS[name]:
        return name
    return with_head(name, 32)


def with_head(name: str, head_dim: int) -> str:
    """`name` with heads of `head_dim`, registered when first asked (as head32)."""
    wide = f"{name}_hd{head_dim}"
    if wide not in CONFIGS:
        CONFIGS[wide] = {**CONFIGS[name], "head_dim": head_dim}
        _SEEDS[wide], GGUF_ARCH[wide] = _SEEDS[name] + 10, GGUF_ARCH[name]
    return wide


def golden_tokens(name: str) -> list[list[int]]:
    """The token sequences the golden logits of `name` are for."""
    return GOLDEN_TOKENS_BY_NAME.get(name, GOLDEN_TOKENS)


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def make_weights(name: str) -> dict[str, np.ndarray]:
    """Hugging Face state dict (float32), the same on every call and machine."""
    if name == "qwen35":
        return _qwen35_weights()
    cfg = CONFIGS[name]
    rng = np.random.default_rng(_SEEDS[name])
    d, ff, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = head_dim(cfg)
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    model_type = cfg["model_type"]

    def mat(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def norm(n):      # Gemma's norms multiply by (1 + w): their weights are centred on 0
        centre = 0.0 if model_type == "gemma3_text" else 1.0
        return (centre + rng.standard_normal(n) * 0.1).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(vocab, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(nq * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * hd, d)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * hd, d)
        if model_type == "qwen2":
            w[p + "self_attn.q_proj.bias"] = mat(nq * hd)
            w[p + "self_attn.k_proj.bias"] = mat(nkv * hd)
            w[p + "self_attn.v_proj.bias"] = mat(nkv * hd)
        if model_type in ("qwen3", "gemma3_text"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "self_attn.o_proj.weight"] = mat(d, nq * hd)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        if model_type == "gemma3_text":
            w[p + "pre_feedforward_layernorm.weight"] = norm(d)
            w[p + "post_feedforward_layernorm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = mat(ff, d)
        w[p + "mlp.up_proj.weight"] = mat(ff, d)
        w[p + "mlp.down_proj.weight"] = mat(d, ff)
    w["model.norm.weight"] = norm(d)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(vocab, d)
    return w


def _qwen35_weights() -> dict[str, np.ndarray]:
    """Qwen3_5ForCausalLM's state dict. Zero-centred norms hold w (transformers computes
    1 + w); the gated DeltaNet norm is plain; A_log, dt_bias give decays exp(g) from
    about 0.99 down to 0.3, so the state both remembers and forgets."""
    cfg = CONFIGS["qwen35"]
    rng = np.random.default_rng(_SEEDS["qwen35"])
    d, ff, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv_dim = 2 * nk * dk + nv * dv

    def mat(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def zc_norm(n):   # zero-centred: the multiplier is 1 + w
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(vocab, d)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = zc_norm(d)
        if kind == "linear_attention":
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = mat(conv_dim, d)
            w[a + "in_proj_z.weight"] = mat(nv * dv, d)
            w[a + "in_proj_b.weight"] = mat(nv, d)
            w[a + "in_proj_a.weight"] = mat(nv, d)
            w[a + "conv1d.weight"] = mat(conv_dim, 1, K, scale=0.4)
            w[a + "dt_bias"] = rng.uniform(-2.0, 0.5, nv).astype(np.float32)
            w[a + "A_log"] = np.log(rng.uniform(0.05, 1.5, nv)).astype(np.float32)
            w[a + "norm.weight"] = (1.0 + rng.standard_normal(dv) * 0.1).astype(np.float32)
            w[a + "out_proj.weight"] = mat(d, nv * dv)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = mat(2 * nq * hd, d)     # per head [query | gate]
            w[a + "k_proj.weight"] = mat(nkv * hd, d)
            w[a + "v_proj.weight"] = mat(nkv * hd, d)
            w[a + "o_proj.weight"] = mat(d, nq * hd)
            w[a + "q_norm.weight"] = zc_norm(hd)
            w[a + "k_norm.weight"] = zc_norm(hd)
        w[p + "post_attention_layernorm.weight"] = zc_norm(d)
        w[p + "mlp.gate_proj.weight"] = mat(ff, d)
        w[p + "mlp.up_proj.weight"] = mat(ff, d)
        w[p + "mlp.down_proj.weight"] = mat(d, ff)
    w["model.norm.weight"] = zc_norm(d)
    return w


def write_safetensors_dir(name: str, folder: str | Path) -> Path:
    """A Hugging Face model folder: config.json + model.safetensors."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name], indent=2) + "\n")
    save_file(make_weights(name), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """Per-frequency divisors of the llama3 rope rule (GGUF `rope_freqs.weight`).

    Same arithmetic as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors,
    except that the original context comes from rope_scaling, where Hugging Face
    keeps it: convert_hf_to_gguf.py reads a top-level
    `original_max_position_embeddings` and falls back to 8192, which is right
    for Llama 3.1/3.2 only because their value happens to be 8192.
    """
    rs = cfg["rope_scaling"]
    base = float(cfg["rope_theta"])
    dim = head_dim(cfg)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rs.get("factor", 8.0)
    low_freq_factor = rs.get("low_freq_factor", 1.0)
    high_freq_factor = rs.get("high_freq_factor", 4.0)
    old_context_len = rs.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def permute_llama(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half q/k rows -> GGUF interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def _add_tiny_tokenizer(writer, vocab_size: int) -> None:
    """A minimal gpt2 BPE vocabulary of vocab_size tokens: 256 byte tokens,
    merges of lower-case letter pairs, and three special tokens at 0..2."""
    import gguf

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = _gpt2_byte_chars()
    letters = "abcdefghijklmnopqrstuvwxyz"
    n_merges = vocab_size - len(specials) - len(byte_tokens)
    pairs = [(a, b) for a in letters for b in letters][:n_merges]
    tokens = specials + byte_tokens + [a + b for a, b in pairs]
    types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials))
    assert len(tokens) == vocab_size and len(set(tokens)) == vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)


def _qwen35_reorder_v_heads(t: np.ndarray, dim: int, num_k_heads: int, num_v_per_k: int,
                           head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's _LinearAttentionVReorderBase._reorder_v_heads, in NumPy."""
    shape = list(t.shape)
    if dim < 0:
        dim += len(shape)
    new_shape = shape[:dim] + [num_k_heads, num_v_per_k, head_dim] + shape[dim + 1:]
    t = t.reshape(new_shape)
    perm = list(range(len(new_shape)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return np.ascontiguousarray(t.transpose(perm)).reshape(shape)


# HF name suffix → GGUF (gguf-py's tensor map for MODEL_ARCH.QWEN35)
_QWEN35_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_proj.bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def qwen35_gguf_tensors() -> dict[str, np.ndarray]:
    """What llama.cpp's converter writes for the tiny qwen35 (float32, before any cast).

    Step for step conversion/qwen.py: _LinearAttentionVReorderBase.modify_tensors
    (v heads grouped → tiled, when nv != nk, on every `linear_attn.` tensor), then
    Qwen3NextModel.modify_tensors (A_log → -exp(A_log), dt_bias → dt_proj.bias,
    conv1d squeezed, +1 on every norm.weight except linear_attn.norm), then the
    name map. Written separately from tests/qwen35_reference.py on purpose:
    make_golden.py checks this one against transformers.
    """
    cfg = CONFIGS["qwen35"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    out: dict[str, np.ndarray] = {}
    for name, data in make_weights("qwen35").items():
        data = data.copy()
        if nk != nv and "linear_attn." in name:
            r = nv // nk
            if ".in_proj_qkv." in name:
                q, k, v = data[:dk * nk], data[dk * nk:2 * dk * nk], data[2 * dk * nk:]
                data = np.concatenate([q, k, _qwen35_reorder_v_heads(v, 0, nk, r, dv)], axis=0)
            elif ".in_proj_z." in name:
                data = _qwen35_reorder_v_heads(data, 0, nk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                data = _qwen35_reorder_v_heads(data, 0, nk, r, 1)
            elif ".A_log" in name or ".dt_bias" in name:
                data = _qwen35_reorder_v_heads(data[:, None], 0, nk, r, 1)[:, 0]
            elif ".conv1d" in name:
                data = data.squeeze()
                qk = data[:dk * nk * 2]
                data = np.concatenate([qk, _qwen35_reorder_v_heads(data[dk * nk * 2:], 0, nk, r, dv)])
            elif ".out_proj." in name:
                data = _qwen35_reorder_v_heads(data, 1, nk, r, dv)
        if name.endswith(".A_log"):
            data = -np.exp(data)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            data = data.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + np.float32(1)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = data
        elif name == "model.norm.weight":
            out["output_norm.weight"] = data
        elif name == "lm_head.weight":
            out["output.weight"] = data
        else:
            bid, _, rest = name[len("model.layers."):].partition(".")
            out[f"blk.{bid}.{_QWEN35_NAMES[rest]}"] = data
    return out


def gguf_tensors(name: str) -> dict[str, np.ndarray]:
    """The GGUF tensors (float32, before any F16 cast) for a model, in file order."""
    if name == "qwen35":
        return qwen35_gguf_tensors()
    cfg = CONFIGS[name]
    arch = GGUF_ARCH[name]
    w = make_weights(name)
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, np.ndarray] = {"token_embd.weight": w["model.embed_tokens.weight"]}
    if arch == "llama" and (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(cfg)
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q = w[p + "self_attn.q_proj.weight"]
        k = w[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q = permute_llama(q, nq, nq)
            k = permute_llama(k, nq, nkv)
        out[b + "attn_norm.weight"] = w[p + "input_layernorm.weight"]
        out[b + "attn_q.weight"] = q
        out[b + "attn_k.weight"] = k
        out[b + "attn_v.weight"] = w[p + "self_attn.v_proj.weight"]
        for x in "qkv":
            if p + f"self_attn.{x}_proj.bias" in w:
                out[b + f"attn_{x}.bias"] = w[p + f"self_attn.{x}_proj.bias"]
        for x in "qk":
            if p + f"self_attn.{x}_norm.weight" in w:
                out[b + f"attn_{x}_norm.weight"] = w[p + f"self_attn.{x}_norm.weight"]
        out[b + "attn_output.weight"] = w[p + "self_attn.o_proj.weight"]
        if arch == "gemma3":
            out[b + "post_attention_norm.weight"] = w[p + "post_attention_layernorm.weight"]
            out[b + "ffn_norm.weight"] = w[p + "pre_feedforward_layernorm.weight"]
            out[b + "post_ffw_norm.weight"] = w[p + "post_feedforward_layernorm.weight"]
        else:
            out[b + "ffn_norm.weight"] = w[p + "post_attention_layernorm.weight"]
        out[b + "ffn_gate.weight"] = w[p + "mlp.gate_proj.weight"]
        out[b + "ffn_up.weight"] = w[p + "mlp.up_proj.weight"]
        out[b + "ffn_down.weight"] = w[p + "mlp.down_proj.weight"]
    out["output_norm.weight"] = w["model.norm.weight"]
    if "lm_head.weight" in w:
        out["output.weight"] = w["lm_head.weight"]
    if arch == "gemma3":   # convert_hf_to_gguf.py Gemma3Model: every norm stored as 1 + w
        out = {k: v + np.float32(1.0) if k.endswith("norm.weight") else v for k, v in out.items()}
    return out


TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
UNREADABLE = ("MXFP4",)       # random blocks of a type Pantheon refuses (a load-error test)


def write_gguf(name: str, path: str | Path, tensor_type: str = "F32",
               with_tokenizer: bool = True, chat_template: str | None = None) -> Path:
    """Write `name` as a GGUF the way convert_hf_to_gguf.py would.

    tensor_type "F32", or "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"
    for 2-D weights (1-D norms, biases and rope_freqs stay F32, as llama.cpp's
    converter keeps them; the quantized types come from gguf-py's quantizers). Llama q/k rows
    are permuted to llama.cpp's interleaved rope layout; qwen2/qwen3 are not.
    For llama3 rope scaling the result goes in `rope_freqs.weight` and, as in
    convert_hf_to_gguf.py, no `rope.scaling.*` key is written: llama.cpp would
    read `rope.scaling.factor` as linear scaling on top of the tensor.
    with_tokenizer adds a 320-token gpt2 vocabulary (transformers' GGUF loader
    wants one; our own loader does not need it).
    """
    import gguf

    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {TENSOR_TYPES}, not {tensor_type!r}")
    cfg = CONFIGS[name]
    arch = GGUF_ARCH[name]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"tiny-{name}")
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    if "mrope_section" in rope:   # padded to 4, as TextModel.set_gguf_parameters does
        wr.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    rope = rope.get("full_attention", rope) if rope else cfg     # gemma3: per layer type
    wr.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta"))))
    if rope.get("rope_type") == "linear":
        wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        wr.add_rope_scaling_factor(float(rope["factor"]))
    if "sliding_window" in cfg and arch == "gemma3":
        wr.add_sliding_window(cfg["sliding_window"])
    wr.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if "head_dim" in cfg:
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if tensor_type == "F16" else gguf.LlamaFileType.ALL_F32)
    if arch == "qwen35":   # Qwen3NextModel.set_gguf_parameters
        wr.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        wr.add_ssm_state_size(cfg["linear_key_head_dim"])
        wr.add_ssm_group_count(cfg["linear_num_key_heads"])
        wr.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        wr.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        wr.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        # the converter reads a top-level partial_rotary_factor, default 0.25
        # (transformers 5 keeps it in rope_parameters: the same 0.25 here)
        wr.add_rope_dimension_count(int(head_dim(cfg) * cfg.get("partial_rotary_factor", 0.25)))
    wr.add_vocab_size(cfg["vocab_size"])
    if arch != "qwen35":
        wr.add_rope_dimension_count(head_dim(cfg))
    if with_tokenizer:
        _add_tiny_tokenizer(wr, cfg["vocab_size"])
    if chat_template is not None:
        wr.add_chat_template(chat_template)

    for tname, data in gguf_tensors(name).items():
        # the converter keeps 1-D tensors, ssm_conv1d and names without .weight in F32
        if data.ndim != 2 or tname.endswith("ssm_conv1d.weight") or not tname.endswith(".weight"):
            wr.add_tensor(tname, data.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
        elif tensor_type == "F16" and data.ndim == 2:
            wr.add_tensor(tname, data.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
        elif tensor_type in UNREADABLE and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType[tensor_type]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.random.default_rng(0).integers(
                0, 256, (data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            wr.add_tensor(tname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        elif tensor_type != "F32" and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType[tensor_type]
            raw = gguf.quants.quantize(data.astype(np.float32), qtype)
            wr.add_tensor(tname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            wr.add_tensor(tname, data.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)

    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def rewrite_gguf(src: Path, dst: Path, drop=(), reshape=None, arch=None, drop_keys=()) -> Path:
    """A copy of the (F32) GGUF at `src` without the tensors `drop` or the metadata keys
    `drop_keys`, with `reshape` {name: rows} cut, or another architecture name: bad files
    for load-error tests."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch_in = reader.fields["general.architecture"].contents()
    wr = gguf.GGUFWriter(str(dst), arch or arch_in)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "tokenizer.")) or key in drop_keys:
            continue
        value = field.contents()
        name = key.replace(f"{arch_in}.", f"{arch or arch_in}.", 1)
        if isinstance(value, str):
            wr.add_string(name, value)
        elif isinstance(value, float):
            wr.add_float32(name, value)
        elif isinstance(value, int):
            wr.add_uint32(name, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        if reshape and t.name in reshape:
            data = data[:reshape[t.name]]
        wr.add_tensor(t.name, np.ascontiguousarray(data))
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file()
    wr.close()
    return dst


def truncate_gguf(src: Path, dst: Path, cut: int = 5000) -> Path:
    """A copy of the GGUF at `src` without its last `cut` bytes (a download cut short)."""
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[:len(data) - cut])
    return Path(dst)


def poison_gguf(src: Path, dst: Path, tensor: str, value: float = float("nan")) -> Path:
    """A copy of the GGUF at `src` whose tensor `tensor` holds `value` (NaN, Inf) in its
    first float: element 0 of an F32 or F16 tensor, the scale of block 0 of a quantized one."""
    import gguf

    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == tensor)
    data = bytearray(Path(src).read_bytes())
    off = int(t.data_offset)
    raw = np.float32(value).tobytes() if t.tensor_type == gguf.GGMLQuantizationType.F32 \
        else np.float16(value).tobytes()
    data[off:off + len(raw)] = raw
    Path(dst).write_bytes(bytes(data))
    return Path(dst)


def load_golden(name: str) -> list[np.ndarray]:
    """Reference logits from transformers: one [T, vocab] float32 array per golden_tokens(name) entry."""
    tokens = golden_tokens(name)
    with np.load(GOLDEN_DIR / f"{name}.npz") as z:
        out = [z[f"seq{i}"].astype(np.float32) for i in range(len(tokens))]
    for toks, logits in zip(tokens, out):
        assert logits.shape == (len(toks), CONFIGS[name]["vocab_size"]), (name, logits.shape)
    return out


def load_qwen35_golden_extra() -> dict[str, np.ndarray]:
    """The rest of tests/golden/qwen35.npz, as transformers leaves it (grouped v heads):
    `seq{i}_conv{layer}` [conv_dim, K] and `seq{i}_ssm{layer}` [nv, dk, dv], the
    DynamicCache of each linear layer after prompt i; `f16_seq{i}` the logits of the
    model on half-rounded 2-D weights (what the F16 GGUF holds); `think_prompt` (the ids of
    THINK_TEMPLATE rendered for THINK_MESSAGES with the tiny vocabulary),
    `think_greedy` (transformers' greedy continuation of it) and
    `think_logits` ([len(think_greedy), vocab], the logits that chose each)."""
    with np.load(GOLDEN_DIR / "qwen35.npz") as z:
        return {k: z[k] for k in z.files if not (k.startswith("seq") and "_" not in k)}
