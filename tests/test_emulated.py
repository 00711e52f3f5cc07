"""worker/emulated.py: the emulated die refuses what CuPy refuses, honours its memory
size, and serves end to end (`serve --spawn-workers cpu,emu:0`)."""
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

import tiny_models as tm
from cluster import Server, free_port
from pantheon.common.default_model import cached_path
from pantheon.common.die_spec import parse_die
from pantheon.worker import emulated as cp
from pantheon.worker import kernels_cuda as kc
from pantheon.worker import matrices as qm
from pantheon.worker.device import emulated_device


def test_host_arrays_are_refused_where_cupy_refuses_them():
    emulated_device(0)
    d, h = cp.arange(4, dtype=cp.float32), np.arange(4, dtype=np.float32)
    for op in (lambda: d + h, lambda: h * d, lambda: cp.exp(h), lambda: np.add(d, h),
               lambda: cp.concatenate([d, h]), lambda: cp.ascontiguousarray(h)):
        with pytest.raises(TypeError):
            op()
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(d)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
        d[:2] = h[:2]
    d[np.array([0, 1])] = h[:2]                   # an advanced index converts the values
    d[:] = 1.5                                    # and a scalar fills
    assert type(d.sum()) is cp.ndarray and d.sum().ndim == 0 and float(d.sum()) == 6.0
    two = cp.zeros((4, 6), dtype=cp.float32)[:, :4]
    with pytest.raises(ValueError, match="C-contiguous"):
        two.view(cp.float16)
    assert isinstance(cp.asnumpy(d), np.ndarray) and cp.get_array_module(d) is cp


def test_raw_kernels_refuse_host_arrays_dtypes_and_strides():
    emulated_device(0)
    m = qm.to_die(qm.quantize(np.random.default_rng(0).standard_normal((64, 64))
                              .astype(np.float32), "q8_0"), cp)
    f = cp.RawModule(code=kc.SOURCE).get_function("rows_q8")
    out = cp.empty((64, 64), dtype=cp.float32)
    args = [m.qs, m.scale, m.scale, np.int32(0), out, np.int32(0), np.int32(64),
            np.int32(64), np.int32(5)]
    f((8,), (256,), args)
    np.testing.assert_array_equal(cp.asnumpy(out), qm.dequantize(
        qm.QMatrix("q8", 64, 64, cp.asnumpy(m.qs), cp.asnumpy(m.scale), None, 32)))
    for i, bad, error in ((4, np.empty((64, 64), np.float32), TypeError),      # host array
                          (4, cp.empty((64, 64), cp.float64), RuntimeError),   # dtype
                          (4, cp.empty((64, 128), cp.float32)[:, ::2], RuntimeError),
                          (6, 64, RuntimeError)):                   # a Python int: 8 bytes
        with pytest.raises(error):
            f((8,), (256,), args[:i] + [bad] + args[i + 1:])


def test_memory_is_honoured_and_freed():
    die = emulated_device(3, memory=8 << 20)
    free, total = cp.cuda.runtime.memGetInfo()
    assert total == 8 << 20 and "8 MiB" in die.name and "Emulated" in die.name
    a = cp.zeros(1 << 20, dtype=cp.float32)                   # 4 MiB
    assert cp.cuda.runtime.memGetInfo()[0] == free - (4 << 20)
    with pytest.raises(cp.cuda.memory.OutOfMemoryError, match="Out of memory allocating"):
        cp.zeros(2 << 20, dtype=cp.float32)
    assert issubclass(cp.cuda.memory.OutOfMemoryError, MemoryError)
    del a
    assert cp.cuda.runtime.memGetInfo()[0] == free
    cp.cuda.Device(0).use()


@pytest.mark.parametrize("text", ["emu", "emu:8", "emu:-1", "emu:x", "emu:0:lots", "emu:0:12",
                                  "emu:0:0G", "emu:0:1G:2", "gpu0"])
def test_bad_die_names_give_the_accepted_forms(text):
    with pytest.raises(ValueError, match="emu:INDEX"):
        parse_die(text)


def test_die_names():
    assert parse_die("emu:2:512M") == parse_die("emu:2:512MiB")
    assert parse_die("emu:2:512M").memory == 512 << 20 and parse_die("emu:1").memory == 12 << 30
    assert parse_die("cpu:1").kind == "cpu" and parse_die("0:1").kind == "cuda"


@pytest.mark.parametrize("cmd", [["worker", "--die", "emu:9"],
                                 ["serve", "--spawn-workers", "cpu,emu:0:huge"]])
def test_a_bad_emulated_die_exits_1_with_the_forms(cmd):
    out = subprocess.run([sys.executable, "-m", "pantheon.cli", *cmd, "--port" if
                          cmd[0] == "serve" else "--slots", str(free_port()) if
                          cmd[0] == "serve" else "1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "emu:INDEX[:SIZE]" in out.stderr, out.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tm.write_gguf("llama", tmp_path_factory.mktemp("emu") / "tiny.gguf",
                         tensor_type="Q8_0")
    with Server("--model", str(path), "--name", "tiny", "--spawn-workers", "cpu,emu:0",
                "--slots", "2", "--ctx", "64",
                "--insecure") as srv:    # the out-of-memory test adds a worker of its own
        srv.path = path
        yield srv


def admin(srv, route, **body):
    if body:
        return httpx.post(f"{srv.url}/admin/{route}", json=body, timeout=120)
    return httpx.get(f"{srv.url}/admin/{route}", timeout=30)


def test_serve_chats_on_the_cpu_and_the_emulated_die(server):
    """A replica on each die; the OpenAI SDK's greedy chats are the same wherever they run
    (fp16 KV on the emulated die: the tiny model's margins hold), streamed or not."""
    r = admin(server, "models/load", path=str(server.path), name="tiny", dies=["emu:0"])
    assert r.status_code == 200, r.text
    dies = {d["die"]: d for d in admin(server, "dies").json()["dies"]}
    assert dies["emu:0"]["kind"] == "cuda" and "Emulated" in dies["emu:0"]["device"]
    assert any("tiny" in m for m in dies["cpu"]["models"])
    assert any("tiny" in m for m in dies["emu:0"]["models"])
    client = server.client()
    replies = set()
    for i in range(4):          # sequential requests go to the first replica; then its
        if i == 2:              # unload leaves the emulated die's
            r = admin(server, "models/unload", name="tiny", die="cpu")
            assert r.status_code == 200, r.text
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}],
            max_tokens=8, temperature=0, logit_bias={"2": -100, "0": -100})
        replies.add(out.choices[0].message.content)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}],
            max_tokens=8, temperature=0, logit_bias={"2": -100, "0": -100}, stream=True)
        replies.add("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert len(replies) == 1
    (model,) = admin(server, "models").json()["models"]
    (replica,) = model["replicas"]
    assert replica["die"] == "emu:0" and replica["served"] == 4, model
    r = admin(server, "models/unload", name="tiny", die="emu:0")       # the die's release
    assert r.status_code == 200, r.text
    die = {d["die"]: d for d in admin(server, "dies").json()["dies"]}["emu:0"]
    assert die["alive"] and die["models"] == [] and die["used_bytes"] == 0, die
    assert "failed" not in server.logs()
    r = admin(server, "models/load", path=str(server.path), name="tiny", dies=["emu:0"])
    assert r.status_code == 200, r.text


@pytest.mark.skipif(not cached_path().exists(), reason="default model not fetched")
def test_out_of_memory_on_the_die_at_load_is_a_507(server):
    """A die whose budget says more than it holds (--budget-mb over an 8 MiB die): the
    upload runs out of device memory, the admin answer is 507, the worker lives on."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "pantheon.cli", "worker", "--die", "emu:1:8M", "--budget-mb",
         "4096", "--frontend", server.args[server.args.index("--worker-addr") + 1],
         "--insecure"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while "emu:1:8M" not in {d["die"] for d in admin(server, "dies").json()["dies"]}:
            assert worker.poll() is None, worker.stderr.read()
            time.sleep(0.1)
        r = admin(server, "models/load", path=str(cached_path()), name="big",
                  dies=["emu:1:8M"])
        assert r.status_code == 507, r.text
        assert "Out of memory allocating" in r.json()["error"]["message"]
        assert worker.poll() is None
        dies = {d["die"]: d for d in admin(server, "dies").json()["dies"]}
        assert dies["emu:1:8M"]["alive"] and not dies["emu:1:8M"]["models"]
    finally:
        worker.terminate()
        worker.wait(15)


def test_a_quantized_cache_serves_on_the_die_and_a_head_it_cannot_read_is_a_400(server):
    """A q4_0 cache on the emulated die (the GPU attention reads the blocks) serves a
    chat; heads of 512 (past the GPU attention's 256) are the file's 400, and the die's
    worker goes on serving."""
    folder = server.path.parent
    q4 = tm.write_gguf("qwen3", folder / "q4.gguf", tensor_type="Q8_0")         # heads of 32
    r = admin(server, "models/load", path=str(q4), name="q4", dies=["emu:0"], kv_cache="q4_0")
    assert r.status_code == 200, r.text
    assert " KV (q4_0)" in server.logs()
    out = server.client().chat.completions.create(
        model="q4", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens
    wide = tm.write_gguf(tm.with_head("qwen3", 512), folder / "h512.gguf")
    r = admin(server, "models/load", path=str(wide), name="h512", dies=["emu:0"])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "heads of up to 256 elements; this model's are 512" in error["message"], error
    dies = {d["die"]: d for d in admin(server, "dies").json()["dies"]}
    assert dies["emu:0"]["alive"] and not any("h512" in m for m in dies["emu:0"]["models"])
    out = server.client().chat.completions.create(
        model="q4", messages=[{"role": "user", "content": "again"}], max_tokens=3,
        temperature=0)
    assert out.usage.completion_tokens
    assert admin(server, "models/unload", name="q4").status_code == 200
