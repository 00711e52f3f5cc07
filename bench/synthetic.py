"""Random-weight models of a given shape, for benchmarks of an architecture no small real
checkpoint exists for (`pantheon bench engine --synthetic NAME`).

`qwen35-wide`: a Qwen3.5 stack (llama.cpp's qwen35 GGUF layout, Q8_0 matrices) wide
enough that its projections, not Python, set the pace: d_model 1024, 8 layers (every
4th gated attention, the rest Gated DeltaNet: 8 key heads and 16 value heads of 128),
SwiGLU 2816, a 4096-token vocabulary. About 150 MB; written once into the cache
directory and reused.

`qwen35-0.8b`: Qwen3.5-0.8B's shapes (24 layers of d_model 1024, every 4th gated
attention with 8 query heads and 2 KV heads of 256, the rest Gated DeltaNet with 16 key
and 16 value heads of 128; SwiGLU 3584; a 248,320-token tied head), as F16 (1.5 GB), for
`pantheon bench engine --synthetic qwen35-0.8b --write-gguf FILE`; llama.cpp's
`llama-quantize FILE OUT Q4_K_M` then makes the file both engines are measured on.

Each file carries a byte-level tokenizer (the 256 bytes, a few merges, padding tokens up
to the vocabulary) so llama.cpp loads it; its text means nothing, as the weights do not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SHAPES = {
    "qwen35-wide": dict(d_model=1024, n_layers=8, d_ff=2816, vocab=4096, n_heads=8,
                        n_kv_heads=2, head_dim=128, rotary_dim=32, interval=4, n_k_heads=8,
                        n_v_heads=16, d_k=128, d_v=128, conv_kernel=4, dtype="Q8_0"),
    "qwen35-0.8b": dict(d_model=1024, n_layers=24, d_ff=3584, vocab=248320, n_heads=8,
                        n_kv_heads=2, head_dim=256, rotary_dim=64, interval=4, n_k_heads=16,
                        n_v_heads=16, d_k=128, d_v=128, conv_kernel=4, dtype="F16"),
}
ROPE_SECTIONS = [11, 11, 10, 0]      # Qwen3.5's M-RoPE sections (text: plain rope)


def qwen35_tensors(s: dict, rng) -> dict[str, np.ndarray]:
    """GGUF name → float32 array ([out, in] for a matrix), scaled so activations stay O(1)."""
    d, f = s["d_model"], s["d_ff"]
    conv = 2 * s["n_k_heads"] * s["d_k"] + s["n_v_heads"] * s["d_v"]
    vd, nv = s["n_v_heads"] * s["d_v"], s["n_v_heads"]
    qd, kvd = s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"]

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)

    out = {"token_embd.weight": mat(s["vocab"], d), "output_norm.weight": np.ones(d, np.float32)}
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": np.ones(d, np.float32),
                p + "post_attention_norm.weight": np.ones(d, np.float32),
                p + "ffn_gate.weight": mat(f, d), p + "ffn_up.weight": mat(f, d),
                p + "ffn_down.weight": mat(d, f)}
        if (i + 1) % s["interval"]:
            out |= {p + "attn_qkv.weight": mat(conv, d), p + "attn_gate.weight": mat(vd, d),
                    p + "ssm_beta.weight": mat(nv, d), p + "ssm_alpha.weight": mat(nv, d),
                    p + "ssm_conv1d.weight": rng.uniform(-0.5, 0.5, (conv, s["conv_kernel"])).astype(np.float32),
                    p + "ssm_dt.bias": np.zeros(nv, np.float32),
                    p + "ssm_a": -rng.uniform(0.5, 8.0, nv).astype(np.float32),
                    p + "ssm_norm.weight": np.ones(s["d_v"], np.float32),
                    p + "ssm_out.weight": mat(d, vd)}
        else:
            out |= {p + "attn_q.weight": mat(2 * qd, d), p + "attn_k.weight": mat(kvd, d),
                    p + "attn_v.weight": mat(kvd, d), p + "attn_output.weight": mat(d, qd),
                    p + "attn_q_norm.weight": np.ones(s["head_dim"], np.float32),
                    p + "attn_k_norm.weight": np.ones(s["head_dim"], np.float32)}
    return out


def byte_level_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, their types and merges of a GPT-2 style byte-level tokenizer of `size`
    tokens: the 256 byte symbols, three chat markers, then padding."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    tokens = [symbols[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * 256 + [3, 3, 3]
    if size < len(tokens):
        raise ValueError(f"a vocabulary of {size} cannot hold {len(tokens)} tokens")
    tokens += [f"<|pad_{i}|>" for i in range(size - len(tokens))]
    types += [5] * (size - len(types))
    space = symbols[ord(" ")]
    merges = [f"{space} t", f"{space} a", "h e", "i n", "r e"]
    return tokens, types, merges


def write_qwen35(path: Path, s: dict, seed: int = 0) -> Path:
    import gguf
    wr = gguf.GGUFWriter(str(path), "qwen35")
    wr.add_name(path.stem)
    wr.add_context_length(32768)
    wr.add_embedding_length(s["d_model"])
    wr.add_block_count(s["n_layers"])
    wr.add_feed_forward_length(s["d_ff"])
    wr.add_head_count(s["n_heads"])
    wr.add_head_count_kv(s["n_kv_heads"])
    wr.add_key_length(s["head_dim"])
    wr.add_value_length(s["head_dim"])
    wr.add_rope_freq_base(1e7)
    wr.add_rope_dimension_count(s["rotary_dim"])
    wr.add_rope_dimension_sections(ROPE_SECTIONS)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_ssm_conv_kernel(s["conv_kernel"])
    wr.add_ssm_state_size(s["d_k"])
    wr.add_ssm_group_count(s["n_k_heads"])
    wr.add_ssm_time_step_rank(s["n_v_heads"])
    wr.add_ssm_inner_size(s["d_v"] * s["n_v_heads"])
    wr.add_full_attention_interval(s["interval"])
    wr.add_vocab_size(s["vocab"])
    tokens, types, merges = byte_level_vocab(s["vocab"])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_eos_token_id(256)
    wr.add_bos_token_id(256)
    wr.add_add_bos_token(False)
    kind = gguf.GGMLQuantizationType[s["dtype"]]
    for name, data in qwen35_tensors(s, np.random.default_rng(seed)).items():
        if data.ndim == 2 and name.endswith(".weight") and "conv1d" not in name:
            raw = gguf.quants.quantize(data, kind)
            wr.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        else:
            wr.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file()
    wr.close()
    return path


def write_gguf(name: str, path: Path) -> Path:
    """Write synthetic model `name` to `path` (for llama-quantize and both engines)."""
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SHAPES)}")
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    write_qwen35(tmp, SHAPES[name])
    tmp.rename(path)
    return path


def synthetic_model(name: str) -> Path:
    """The file of synthetic model `name`, written on first use into the cache directory."""
    from ..common.settings import cache_dir
    if name not in SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SHAPES)}")
    path = cache_dir() / "synthetic" / f"{name}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        write_qwen35(tmp, SHAPES[name])
        tmp.rename(path)
    return path
