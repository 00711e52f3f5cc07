"""Placement and admission against the die table, with fake workers."""
from types import SimpleNamespace

import pytest

import tiny_models as tm
from pantheon.common.kv_cache import KVCacheTypes
from pantheon.common.model_file import read_config
from pantheon.frontend.dies import DieTable, PlacementError, replica_bytes
from pantheon.common import protocol as p
from pantheon.frontend.registry import Registry
from pantheon.frontend.workers import WorkerInfo, WorkerPool


def worker(die, budget, alive=True, kind="cpu"):
    hello = p.Hello(die, kind, kind, budget, budget, 4, budget=budget)
    return WorkerInfo(die.encode(), hello, 0.0, alive=alive)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(tm.write_gguf("llama", tmp_path_factory.mktemp("d") / "t.gguf", "Q8_0"))


@pytest.fixture(scope="module")
def cfg(path):
    return read_config(path)


def table(*workers):
    pool = SimpleNamespace(workers={w.die: w for w in workers})
    pool.latest = lambda: WorkerPool.latest(pool)
    return DieTable(Registry(), pool, slots=4)


def test_most_free_budget_that_fits_wins(path, cfg):
    need = replica_bytes(path, cfg, "cpu", 4, 64)
    t = table(worker("cpu", need * 3), worker("cpu:1", need * 5), worker("0", need * 9,
                                                                       alive=False))
    assert t.choose(path, cfg, None, 4, 64) == ("cpu:1", need)
    assert t.choose(path, cfg, ["cpu"], 4, 64) == ("cpu", need)


@pytest.mark.parametrize("kv_cache", ["f32", "f16", "q8_0", "q4_0"])
def test_weights_are_counted_as_the_worker_holds_them(path, cfg, kv_cache, tmp_path):
    """The admission figure is the loaded engine's own, before any upload: with
    `--kv-cache f16` the KV in fp16 beside quantized weights, in fp32 in the exact mode;
    q8_0 / q4_0 blocks (34 / 18 bytes per 32 elements) whatever the weights (heads of 32:
    whole blocks)."""
    from pantheon.worker.engine import load_engine
    model, config = path, cfg
    if kv_cache.startswith("q"):
        model = str(tm.write_gguf(tm.head32("llama"), tmp_path / "t32.gguf", "Q8_0"))
        config = read_config(model)
    kv_types = KVCacheTypes.of(kv_cache)
    half = {"f32": 4, "f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}[kv_cache]
    exact = half if kv_cache.startswith("q") else 4
    for mode, itemsize in (("auto", half), ("none", exact), ("q4", half)):
        kv = 4 * 64 * config.kv_bytes_per_token(itemsize)
        engine = load_engine(model, n_slots=4, ctx=64, quantize=mode, kv_cache=kv_types)
        held = engine.model.w.nbytes()
        assert replica_bytes(model, config, "cpu", 4, 64, mode, kv_types) == held + kv, mode
        assert engine.model.state.nbytes == kv
        assert engine.model.state.layers[0].kinds[0] == \
            {4: "f32", 2: "f16"}.get(itemsize, kv_cache)
    # quantize applies to float tensors: Q8_0 ones stay as they are
    assert replica_bytes(path, cfg, "cpu", 1, 64, "q4") == replica_bytes(path, cfg, "cpu", 1, 64)
    assert replica_bytes(path, cfg, "cpu", 1, 64) < replica_bytes(path, cfg, "cpu", 1, 64, "none") / 3
    assert replica_bytes(path, cfg, "cuda", 1, 64, "none") < replica_bytes(path, cfg, "cpu", 1, 64, "none")


@pytest.mark.parametrize("pinned, status, words", [
    (None, 507, "no die has room"), (["cpu", "cpu:1"], 400, "one die"),
    (["7"], 507, "no live worker")])
def test_refusals(path, cfg, pinned, status, words):
    t = table(worker("cpu", 10), worker("cpu:1", 10))
    with pytest.raises(PlacementError, match=words) as err:
        t.choose(path, cfg, pinned, 4, 64)
    assert err.value.status == status


def test_no_worker_at_all(path, cfg):
    with pytest.raises(PlacementError, match="no worker"):
        table().choose(path, cfg, None, 4, 64)
