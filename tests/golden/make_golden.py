"""Regenerate tests/golden/{llama,llama3,qwen2,qwen3,gemma3}.npz with Hugging Face transformers.

The test venv has no torch, so the reference logits are computed here, once,
and committed. This script runs OUTSIDE the test venv, in a throwaway venv
with a CPU build of torch (pinned: an unpinned torch pulls a multi-GB CUDA
build; transformers' GGUF loader also needs accelerate):

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch==2.13.0 transformers==5.24.0 numpy gguf safetensors accelerate
    cd /work/main && /tmp/golden-venv/bin/python tests/golden/make_golden.py

(about a minute; it prints one line per model and fails loudly on any mismatch)

Last run with: torch 2.13.0+cpu, transformers 5.24.0, accelerate 1.15.0,
numpy 2.4.6, gguf 0.19.0, safetensors 0.8.0, Python 3.11.7.

What it does, for each model of tests/tiny_models.py:
1. Builds the model with transformers from CONFIGS + make_weights (strict
   load_state_dict, eval mode, float32, attn_implementation="eager"), runs
   each GOLDEN_TOKENS sequence as one full forward without a cache, and saves
   the logits as seq0, seq1 in {name}.npz. The same logits must also come out
   of `from_pretrained` on the folder that write_safetensors_dir writes.
2. Cross-checks write_gguf: loads the GGUF (F32 and F16) through transformers'
   own GGUF loader and asserts that the weights it recovers (after its reverse
   of llama.cpp's q/k permutation) are make_weights' (F16: rounded to half),
   and that its logits match the safetensors-built model. A control writes the
   llama GGUF without the permutation and asserts that it then does NOT match,
   so the check has teeth.
   Where transformers' GGUF metadata reading falls short, the model is loaded
   from the GGUF's tensors with our config (`config=`), and what it missed is
   checked separately:
   - llama3: transformers maps no rope scaling for the llama architecture and
     ignores the `rope_freqs.weight` tensor (llama.cpp's only carrier of the
     llama3 rule; convert_hf_to_gguf.py writes no rope.scaling.* keys for it).
     The tensor is checked instead: base_inv_freq / rope_freqs must equal the
     scaled inv_freq of transformers' own llama3 rope.
   - qwen3: transformers' qwen3 GGUF mapping ignores attention.key_length
     (only qwen3_moe maps it), so head_dim 32 would become Qwen3Config's
     default; the key is checked against the config by reading it directly.
   - gemma3: the GGUF carries no layer types, local rope base or query scale
     (llama.cpp: every 6th layer global, base 10k, head_dim), so the tiny config
     is chosen to agree with those rules and the GGUF is loaded with our config;
     transformers' gemma3 GGUF loader subtracts the 1 that llama.cpp's converter
     adds to every norm, so its weights match make_weights to fp32 rounding.
   Two controls per gemma3 run: the same weights with a window wider than the
   sequences, and without the global layers' rope scaling, must give other
   logits (so the golden file tests both).
Prints the max |diff| per check; any failed check raises.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gguf  # noqa: E402
import tiny_models as t  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: E402

torch.set_grad_enabled(False)

# Metadata that transformers' GGUF loader maps to config fields, per our name.
GGUF_CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "max_position_embeddings", "vocab_size", "rope_theta",
                    "rms_norm_eps", "tie_word_embeddings"]
# Archs whose GGUF transformers can fully configure from metadata alone.
GGUF_SELF_CONFIGURING = {"llama", "qwen2"}


def hf_config(name: str):
    return AutoConfig.for_model(**t.CONFIGS[name])


def build_model(name: str, weights: dict[str, np.ndarray] | None = None):
    """The transformers model from CONFIGS + make_weights, loaded strictly."""
    cfg = hf_config(name)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    w = dict(t.make_weights(name) if weights is None else weights)
    if cfg.tie_word_embeddings:
        # The tied head is one parameter listed under two names; give both.
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}, strict=True)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), name
    return model.eval().float()


def run(model) -> list[np.ndarray]:
    out = []
    for toks in t.GOLDEN_TOKENS:
        logits = model(input_ids=torch.tensor([toks]), use_cache=False).logits[0]
        out.append(logits.float().numpy().astype(np.float32))
    return out


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def check_state(model, expected: dict[str, np.ndarray], label: str) -> float:
    """Max |diff| between a loaded model's parameters and expected HF weights."""
    sd = model.state_dict()
    worst = 0.0
    for k, v in expected.items():
        assert k in sd, f"{label}: {k} not in loaded model"
        got = sd[k].float().numpy()
        assert got.shape == v.shape, f"{label}: {k} shape {got.shape} != {v.shape}"
        worst = max(worst, float(np.abs(got - v).max()))
    return worst


def f16_rounded(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: (v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v) for k, v in w.items()}


def check_gguf_metadata(name: str, path: Path) -> None:
    cfg = t.CONFIGS[name]
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    for key in GGUF_CONFIG_KEYS:
        want, got = cfg.get(key), parsed.get(key)
        if key == "rope_theta" and "rope_parameters" in cfg:
            want = cfg["rope_parameters"]["full_attention"]["rope_theta"]
        if want is None and key == "tie_word_embeddings":
            continue
        ok = (abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
              if isinstance(want, float) else got == want)
        assert ok, f"{name}: transformers reads {key}={got!r} from the GGUF, config has {want!r}"
    reader = gguf.GGUFReader(path)
    arch = t.GGUF_ARCH[name]
    hd = t.head_dim(cfg)
    assert reader.fields[f"{arch}.rope.dimension_count"].contents() == hd
    if "head_dim" in cfg:
        assert reader.fields[f"{arch}.attention.key_length"].contents() == hd
        assert reader.fields[f"{arch}.attention.value_length"].contents() == hd
    if arch == "llama":
        assert not any(".rope.scaling." in k for k in reader.fields), "llama.cpp would double-scale"
    if arch == "gemma3":
        assert reader.fields["gemma3.attention.sliding_window"].contents() == cfg["sliding_window"]
        n = cfg["num_hidden_layers"]
        assert cfg["layer_types"] == ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                      for i in range(n)], "llama.cpp's pattern of 6 disagrees"
        assert cfg["query_pre_attn_scalar"] == hd, "llama.cpp scales q by head_dim ** -0.5"


def check_llama3_rope(name: str, path: Path, model) -> float:
    """rope_freqs in the GGUF against transformers' llama3 inv_freq."""
    cfg = t.CONFIGS[name]
    reader = gguf.GGUFReader(path)
    factors = next(np.asarray(x.data, dtype=np.float32) for x in reader.tensors if x.name == "rope_freqs.weight")
    hd = t.head_dim(cfg)
    base_inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    hf_inv = model.model.rotary_emb.inv_freq.float().numpy()
    assert not np.allclose(hf_inv, base_inv), "llama3 scaling changes nothing at these sizes"
    bands = {"kept": int((factors == 1).sum()), "divided": int((factors == cfg["rope_scaling"]["factor"]).sum())}
    bands["smoothed"] = len(factors) - bands["kept"] - bands["divided"]
    assert min(bands.values()) >= 1, f"not every llama3 band is exercised: {bands}"
    rel = float((np.abs(base_inv / factors - hf_inv) / hf_inv).max())
    assert rel < 1e-5, f"rope_freqs disagree with transformers' llama3 inv_freq (rel {rel})"
    # What convert_hf_to_gguf.py would write for this config (it reads a
    # top-level original_max_position_embeddings, default 8192): informative.
    conv = t.llama3_rope_factors({**cfg, "rope_scaling": {**cfg["rope_scaling"],
                                                          "original_max_position_embeddings": 8192}})
    print(f"  {name}: rope_freqs {np.round(factors, 4).tolist()} bands {bands}; "
          f"max rel |inv_freq diff| vs transformers {rel:.2e}")
    print(f"  {name}: (convert_hf_to_gguf.py's 8192 fallback would give {np.round(conv, 4).tolist()})")
    return rel


def cross_check_gguf(name: str, ref: list[np.ndarray], tmp: Path) -> dict[str, float]:
    weights = t.make_weights(name)
    result = {}
    for tensor_type in ("F32", "F16"):
        path = t.write_gguf(name, tmp / f"{name}-{tensor_type}.gguf", tensor_type)
        check_gguf_metadata(name, path)
        kwargs = {} if name in GGUF_SELF_CONFIGURING else {"config": hf_config(name)}
        model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=str(path), dtype=torch.float32,
                                                     attn_implementation="eager", **kwargs).eval()
        if name in GGUF_SELF_CONFIGURING:
            # Its config came from the GGUF alone: the arch must be the right one.
            assert type(model).__name__ == t.CONFIGS[name]["architectures"][0], type(model).__name__
        expected = weights if tensor_type == "F32" else f16_rounded(weights)
        wdiff = check_state(model, expected, f"{name} {tensor_type}")
        # gemma3 norms went through (w + 1) - 1 in float32
        bound = 1.2e-7 if t.GGUF_ARCH[name] == "gemma3" else 0.0
        assert wdiff <= bound, f"{name} {tensor_type}: GGUF weights differ from make_weights by {wdiff}"
        got = run(model)
        # F32: the very same model. F16: the same model on half-rounded weights.
        want = ref if tensor_type == "F32" else run(build_model(name, f16_rounded(weights)))
        d = max_diff(got, want)
        assert d < 1e-4, f"{name} {tensor_type}: GGUF logits differ by {d}"
        result[f"gguf_{tensor_type}"] = d
        result[f"gguf_{tensor_type}_vs_golden"] = max_diff(got, ref)
        if tensor_type == "F32" and (t.CONFIGS[name].get("rope_scaling") or {}).get("rope_type") == "llama3":
            check_llama3_rope(name, path, build_model(name))
    return result


def permutation_control(tmp: Path, ref: list[np.ndarray]) -> float:
    """A llama GGUF written WITHOUT the q/k permutation must not match."""
    saved = t.permute_llama
    t.permute_llama = lambda w, n_head, n_head_kv=None: w
    try:
        path = t.write_gguf("llama", tmp / "llama-unpermuted.gguf")
    finally:
        t.permute_llama = saved
    model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=str(path), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    d = max_diff(run(model), ref)
    assert d > 1e-2, f"unpermuted llama GGUF matches too (diff {d}): the check is blind"
    return d


def gemma3_controls(ref: list[np.ndarray]) -> dict[str, float]:
    """The window and the global rope scaling each change the logits."""
    cfg = t.CONFIGS["gemma3"]
    out = {}
    variants = {"wide window": {"sliding_window": 1000},
                "no rope scaling": {"rope_parameters": {
                    **cfg["rope_parameters"],
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}}
    for label, change in variants.items():
        saved = dict(cfg)
        cfg.update(change)
        try:
            d = max_diff(run(build_model("gemma3", t.make_weights("gemma3"))), ref)
        finally:
            cfg.clear()
            cfg.update(saved)
        assert d > 1e-2, f"gemma3 with {label} matches the golden logits (diff {d}): blind"
        out[label] = d
    return out


def main() -> None:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for name in t.CONFIGS:
            model = build_model(name)
            ref = run(model)
            for toks, logits in zip(t.GOLDEN_TOKENS, ref):
                assert logits.shape == (len(toks), t.CONFIGS[name]["vocab_size"])
                assert np.isfinite(logits).all()
                # Non-trivial: positions must differ well beyond float noise.
                assert np.abs(np.diff(logits, axis=0)).max() > 1.0, f"{name}: flat logits"

            folder = t.write_safetensors_dir(name, tmp / name)
            loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
            st_diff = max_diff(run(loaded), ref)
            assert st_diff < 1e-5, f"{name}: from_pretrained(safetensors folder) differs by {st_diff}"

            gg = cross_check_gguf(name, ref, tmp / f"{name}-gguf")
            if name == "gemma3":
                for label, d in gemma3_controls(ref).items():
                    print(f"  gemma3 control: {label} differs by {d:.3f} (must not match)")
            np.savez_compressed(HERE / f"{name}.npz", **{f"seq{i}": x for i, x in enumerate(ref)})
            spread = float(np.std(ref[0]))
            print(f"{name}: logits std {spread:.3f}; max |diff| safetensors-folder {st_diff:.2e}, "
                  f"GGUF F32 {gg['gguf_F32']:.2e}, GGUF F16 {gg['gguf_F16']:.2e} "
                  f"(F16 vs F32 golden {gg['gguf_F16_vs_golden']:.2e})")
        ctrl = permutation_control(tmp / "control", t.load_golden("llama"))
        print(f"control: llama GGUF without the q/k permutation differs by {ctrl:.3f} (must not match)")
    print("golden files written to", HERE)


if __name__ == "__main__":
    main()
