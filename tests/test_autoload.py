"""The autoloader's answers that need no worker (frontend/autoload.py), on a scanned catalog."""
import asyncio
from types import SimpleNamespace

import pytest

import tiny_models as tm
from pantheon.frontend.autoload import AutoLoader, LifecycleConfig, Policy, looks_like_path
from pantheon.frontend.catalog import Catalog, CatalogError
from pantheon.frontend.errors import APIError
from pantheon.frontend.registry import Registry


@pytest.fixture
def catalog(tmp_path):
    tm.write_gguf("qwen2", tmp_path / "tiny-a.gguf")
    tm.write_gguf("llama", tmp_path / "tiny-b.gguf")
    cat = Catalog([str(tmp_path)], aliases=[("tiny", str(tmp_path / "tiny-a.gguf"))],
                  fetched=False)
    cat.scan()
    return cat


def loader(catalog, **policy) -> AutoLoader:
    admission = SimpleNamespace(depth=4, timeout_s=1.0, queued=lambda m: 0)
    return AutoLoader(catalog, Registry(), SimpleNamespace(), admission, Policy(**policy))


def resolve(auto, name, keep_alive=None):
    async def go():
        return await auto.resolve(name, keep_alive)
    return asyncio.run(go())


def test_no_autoload_answers_503_for_a_model_not_loaded(catalog):
    auto = loader(catalog, autoload=False)
    with pytest.raises(APIError) as exc:
        resolve(auto, "tiny")
    assert exc.value.status == 503 and exc.value.code == "model_not_loaded"
    assert "--no-autoload" in exc.value.message
    assert not auto.pending and not auto.claims          # nothing started, nothing held


def test_unknown_names_are_404_and_no_name_among_several_is_400(catalog):
    auto = loader(catalog)
    with pytest.raises(APIError) as exc:
        resolve(auto, "tiny-z")
    assert exc.value.status == 404 and "tiny, tiny-a, tiny-b" in exc.value.message
    with pytest.raises(APIError) as exc:
        resolve(auto, None)
    assert exc.value.status == 400 and exc.value.code == "model_required"


@pytest.mark.parametrize("name, path", [
    ("/models/a.gguf", True), ("../a", True), ("~/a", True), ("./a", True),
    ("a/../../etc", True), ("a.gguf", True), ("C:\\m\\a", True), ("x.safetensors", True),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", False), ("gpt-4o", False), ("m", False),
    (None, False), ("", False)])
def test_a_path_is_never_a_name(name, path):
    assert looks_like_path(name) is path


def test_the_listing_shows_every_name_with_its_status(catalog):
    rows = {r["id"]: r for r in loader(catalog, pins={"tiny-b"}).listing()}
    assert rows["tiny"]["alias_of"] == "tiny-a" and rows["tiny-a"]["aliases"] == ["tiny"]
    assert {r["status"] for r in rows.values()} == {"available"}
    assert rows["tiny-b"]["pinned"] and rows["tiny-b"]["keep_alive_s"] is None
    assert rows["tiny-a"]["keep_alive_s"] == 300


def test_lifecycle_flags_are_checked_before_anything_starts(catalog):
    with pytest.raises(ValueError, match="--keep-alive -2"):
        LifecycleConfig(keep_alive_s=-2)
    with pytest.raises(ValueError, match="--max-loaded"):
        LifecycleConfig(max_loaded=-1)
    with pytest.raises(CatalogError, match="--pin nope: no such model"):
        LifecycleConfig(pins=["nope"]).policy(catalog, [])
    assert LifecycleConfig(pins=["tiny"]).policy(catalog, ["m"]).pins == {"tiny-a", "m"}


def test_a_load_waiter_is_woken_by_the_change_not_by_polling(catalog):
    """until_gone() waits for the registry's Change: a replica gone without one is not
    seen (a poll would see it), the Change wakes it at once."""
    from pantheon.frontend.registry import Replica, ReplicaState

    async def go():
        auto = loader(catalog)
        replica = Replica("tiny-a#1", "cpu", state=ReplicaState.UNLOADING)
        auto.registry.models["tiny-a"] = SimpleNamespace(
            name="tiny-a", replicas=[replica], ready=lambda: [])
        waiter = asyncio.ensure_future(auto.until_gone("tiny-a", asyncio.get_running_loop()
                                                       .time() + 60))
        await asyncio.sleep(0.3)
        del auto.registry.models["tiny-a"]             # gone, unannounced
        await asyncio.sleep(0.3)
        assert not waiter.done()
        auto.registry.change.fire()
        return await asyncio.wait_for(waiter, 10)
    assert asyncio.run(go()) is True
