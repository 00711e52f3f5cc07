"""Placement and admission against the die table, with fake workers."""
from types import SimpleNamespace

import pytest

import tiny_models as tm
from pantheon.common.model_file import read_config
from pantheon.frontend.dies import DieTable, PlacementError, replica_bytes
from pantheon.common import protocol as p
from pantheon.frontend.registry import Registry
from pantheon.frontend.workers import WorkerInfo, WorkerPool


def worker(die, budget, alive=True, kind="cpu"):
    hello = p.Hello(die, kind, kind, budget, budget, 4, budget=budget)
    return WorkerInfo(die.encode(), hello, 0.0, alive=alive)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return read_config(tm.write_gguf("llama", tmp_path_factory.mktemp("d") / "t.gguf"))


def table(*workers):
    pool = SimpleNamespace(workers={w.die: w for w in workers})
    pool.latest = lambda: WorkerPool.latest(pool)
    return DieTable(Registry(), pool, slots=4)


def test_most_free_budget_that_fits_wins(cfg):
    need = replica_bytes(cfg, "cpu", 4, 64)
    t = table(worker("cpu", need * 3), worker("cpu:1", need * 5), worker("0", need * 9,
                                                                       alive=False))
    assert t.choose(cfg, None, 4, 64) == ("cpu:1", need)
    assert t.choose(cfg, ["cpu"], 4, 64) == ("cpu", need)


def test_gpu_dies_count_fp16_weights(cfg):
    assert replica_bytes(cfg, "cuda", 1, 64) < replica_bytes(cfg, "cpu", 1, 64)


@pytest.mark.parametrize("pinned, status, words", [
    (None, 507, "no die has room"), (["cpu", "cpu:1"], 400, "one die"),
    (["7"], 507, "no live worker")])
def test_refusals(cfg, pinned, status, words):
    t = table(worker("cpu", 10), worker("cpu:1", 10))
    with pytest.raises(PlacementError, match=words) as err:
        t.choose(cfg, pinned, 4, 64)
    assert err.value.status == status


def test_no_worker_at_all(cfg):
    with pytest.raises(PlacementError, match="no worker"):
        table().choose(cfg, None, 4, 64)
