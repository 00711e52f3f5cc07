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
    load_golden(name)        [T, vocab] float32 logits per GOLDEN_TOKENS entry

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

_SEEDS = {"llama": 1001, "llama3": 1002, "qwen2": 1003, "qwen3": 1004, "gemma3": 1005}

# ids < 320; the first is 11 tokens, the second 7 (with a repeat, so attention
# to an identical earlier token is exercised).
GOLDEN_TOKENS: list[list[int]] = [
    [1, 17, 250, 3, 99, 311, 42, 42, 128, 7, 200],
    [1, 300, 5, 64, 5, 271, 19],
]

GGUF_ARCH = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma3": "gemma3"}


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def make_weights(name: str) -> dict[str, np.ndarray]:
    """Hugging Face state dict (float32), the same on every call and machine."""
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


def gguf_tensors(name: str) -> dict[str, np.ndarray]:
    """The GGUF tensors (float32, before any F16 cast) for a model, in file order."""
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


TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
UNREADABLE = ("IQ4_NL",)      # random blocks of a type Pantheon refuses (a load-error test)


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
    rope = cfg.get("rope_parameters", {}).get("full_attention", cfg)
    wr.add_rope_freq_base(float(rope["rope_theta"]))
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
    wr.add_vocab_size(cfg["vocab_size"])
    wr.add_rope_dimension_count(head_dim(cfg))
    if with_tokenizer:
        _add_tiny_tokenizer(wr, cfg["vocab_size"])
    if chat_template is not None:
        wr.add_chat_template(chat_template)

    for tname, data in gguf_tensors(name).items():
        if tensor_type == "F16" and data.ndim == 2:
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


def rewrite_gguf(src: Path, dst: Path, drop=(), reshape=None, arch=None) -> Path:
    """A copy of the (F32) GGUF at `src` without the tensors `drop`, with `reshape`
    {name: rows} cut, or another architecture name: bad files for load-error tests."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch_in = reader.fields["general.architecture"].contents()
    wr = gguf.GGUFWriter(str(dst), arch or arch_in)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")) or key.startswith("tokenizer."):
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


def load_golden(name: str) -> list[np.ndarray]:
    """Reference logits from transformers: one [T, vocab] float32 array per GOLDEN_TOKENS entry."""
    with np.load(GOLDEN_DIR / f"{name}.npz") as z:
        out = [z[f"seq{i}"].astype(np.float32) for i in range(len(GOLDEN_TOKENS))]
    for toks, logits in zip(GOLDEN_TOKENS, out):
        assert logits.shape == (len(toks), CONFIGS[name]["vocab_size"]), (name, logits.shape)
    return out
