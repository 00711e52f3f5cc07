"""`make gpu-check`: the CUDA path end to end on a machine with a GPU, in minutes.

1. CuPy for the driver's CUDA into this virtualenv (cupy-cuda12x from CUDA 12 on,
   cupy-cuda11x before: a K80's 470 driver is CUDA 11.4), unless it already works;
2. `pytest -m gpu` (kernels against NumPy, the CuPy forward against the references);
3. `pantheon bench engine --die 0` on the default model and on a random-weight
   llama of TinyLlama-1.1B's shape in Q4_0 (written here, ~0.6 GB, deleted after);
4. bench/attention_gpu.py on die 0: the attention over f16 / q8_0 / q4_0 KV caches
   (kernels reading the blocks in place beside the dequantizing array path);
5. one JSON line: per model, decode tok/s per batch and the weight bytes those
   steps read per second as a share of the die's memory bandwidth
   (memoryClockRate * 2 * memoryBusWidth / 8; a batch-b step reads the weights once),
   and the attention figures.
Exit status 0 only when the tests passed and both benchmarks ran.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# TinyLlama-1.1B: 22 layers, d 2048, ff 5632, 32 heads of 64, 4 kv heads, vocab 32000
SHAPE_1B = dict(n_layers=22, d_model=2048, d_ff=5632, n_heads=32, n_kv_heads=4, vocab=32000)


def cuda_version() -> tuple[int, int] | None:
    """The driver's CUDA version from nvidia-smi, or None without one."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def cupy_works() -> bool:
    probe = "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0; cupy.arange(3).sum()"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def ensure_cupy(cuda: tuple[int, int]) -> str:
    if cupy_works():
        return "present"
    wheel = "cupy-cuda12x" if cuda[0] >= 12 else "cupy-cuda11x"
    # [ctk] brings the CUDA libraries as wheels where the machine has no toolkit
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"{wheel}[ctk]"],
                   check=True, timeout=240)
    if not cupy_works():
        raise RuntimeError(f"{wheel} installed but CuPy cannot use the GPU")
    return wheel


def bandwidth(die: int = 0) -> tuple[str, float]:
    """(device name, memory bandwidth in bytes/s) of a CUDA die."""
    import cupy
    p = cupy.cuda.runtime.getDeviceProperties(die)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    return name, p["memoryClockRate"] * 1e3 * 2 * p["memoryBusWidth"] / 8


def write_random_gguf(path: Path, shape: dict = SHAPE_1B, seed: int = 0) -> Path:
    """A llama GGUF with random Q4_0 weights (block scales 0.002..0.02) and unit
    norms: the bytes and shapes of a real model, for speed only."""
    import gguf

    rng = np.random.default_rng(seed)
    d, ff, hd = shape["d_model"], shape["d_ff"], shape["d_model"] // shape["n_heads"]
    kv = shape["n_kv_heads"] * hd
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random-1.1b")
    w.add_context_length(2048)
    w.add_embedding_length(d)
    w.add_block_count(shape["n_layers"])
    w.add_feed_forward_length(ff)
    w.add_head_count(shape["n_heads"])
    w.add_head_count_kv(shape["n_kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(shape["vocab"])

    def q4(rows, cols):
        blocks = rng.integers(0, 256, (rows * cols // 32, 18), dtype=np.uint8)
        d16 = rng.uniform(0.002, 0.02, blocks.shape[0]).astype(np.float16)
        blocks[:, :2] = d16.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, cols // 32 * 18)

    def add(name, rows, cols):
        w.add_tensor(name, q4(rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    ones = np.ones(d, dtype=np.float32)
    add("token_embd.weight", shape["vocab"], d)
    for i in range(shape["n_layers"]):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones)
        add(b + "attn_q.weight", d, d)
        add(b + "attn_k.weight", kv, d)
        add(b + "attn_v.weight", kv, d)
        add(b + "attn_output.weight", d, d)
        w.add_tensor(b + "ffn_norm.weight", ones)
        add(b + "ffn_gate.weight", ff, d)
        add(b + "ffn_up.weight", ff, d)
        add(b + "ffn_down.weight", d, ff)
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", shape["vocab"], d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bench(model: Path, die: int, bytes_per_s: float) -> dict:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pantheon.cli", "bench", "engine", "-m",
                          str(model), "--die", str(die)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode:
        return {"model": model.name, "error": out.stderr.strip()[-2000:]}
    r = json.loads(out.stdout)
    return {"model": model.name, "load_s": r["load_s"], "prefill_tok_s": r["prefill_tok_s"],
            "decode_tok_s": r["decode_tok_s"], "weight_bytes": r["weight_bytes"],
            "bandwidth_share": shares(r["decode_tok_s"], r["weight_bytes"], bytes_per_s),
            "wall_s": round(time.perf_counter() - started, 1)}


def shares(decode_tok_s: dict, weight_bytes: int, bytes_per_s: float) -> dict:
    """Per batch b: weight bytes read per second (one read per step of b tokens) over
    the bandwidth."""
    return {b: round(float(tok) / int(b) * weight_bytes / bytes_per_s, 3)
            for b, tok in decode_tok_s.items()}


def pytest_gpu() -> dict:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                          "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    tail = out.stdout.strip().splitlines()[-1:] or [out.stderr.strip()[-500:]]
    return {"rc": out.returncode, "summary": tail[0]}


def attention() -> dict:
    out = subprocess.run([sys.executable, "-m", "pantheon.bench.attention_gpu", "--die", "0",
                          "--rounds", "3"], capture_output=True, text=True, timeout=300)
    if out.returncode:
        return {"error": out.stderr.strip()[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    from pantheon.common.default_model import cached_path

    cuda = cuda_version()
    if cuda is None:
        print(json.dumps({"error": "no NVIDIA driver: nvidia-smi not found or silent"}))
        return 2
    result = {"cuda": f"{cuda[0]}.{cuda[1]}", "cupy": ensure_cupy(cuda)}
    result["device"], bytes_per_s = bandwidth(0)
    result["bandwidth_GBps"] = round(bytes_per_s / 1e9, 1)
    result["pytest"] = pytest_gpu()
    models = [bench(cached_path(), 0, bytes_per_s)]
    with tempfile.TemporaryDirectory() as tmp:
        models.append(bench(write_random_gguf(Path(tmp) / "random-1.1b-q4_0.gguf"), 0,
                            bytes_per_s))
    result["models"] = models
    result["attention"] = attention()
    print(json.dumps(result))
    ok = result["pytest"]["rc"] == 0 and not any("error" in m for m in models)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
