"""The catalog (frontend/catalog.py) and keep_alive (frontend/keep_alive.py), alone."""
import logging
import math

import pytest

import tiny_models as tm
from pantheon import cli
from pantheon.frontend.catalog import Catalog, CatalogError, parse_alias
from pantheon.frontend.errors import APIError
from pantheon.frontend.keep_alive import FOREVER, parse_keep_alive


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("catalog")
    tm.write_gguf("qwen2", d / "tiny-a.gguf")
    tm.write_gguf("llama", d / "tiny-b.gguf")
    tm.write_safetensors_dir("llama", d / "hf-llama")
    (d / "notes.gguf").write_bytes(b"not a model")
    tm.truncate_gguf(d / "tiny-a.gguf", d / "cut.gguf")
    (d / "readme.txt").write_text("a text file is no candidate")
    (d / "empty").mkdir()
    (d / "link.gguf").symlink_to(d / "tiny-b.gguf")
    return d


def test_scan_finds_gguf_files_and_hf_folders_and_skips_the_rest(folder, caplog):
    with caplog.at_level(logging.WARNING, "pantheon.frontend.catalog"):
        cat = Catalog([str(folder)], fetched=False)
        cat.scan()
        cat.scan()                                   # a rescan warns no more
    # link.gguf is tiny-b.gguf: one model, under the first name met (in name order)
    assert sorted(cat.entries) == ["hf-llama", "link", "tiny-a"]
    assert cat.entries["hf-llama"].path == str(folder / "hf-llama")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and any("notes.gguf" in w for w in warned) \
        and any("cut.gguf" in w for w in warned)


def test_a_rescan_sees_added_and_removed_files(folder, tmp_path):
    tm.write_gguf("qwen2", tmp_path / "one.gguf")
    cat = Catalog([str(tmp_path)], fetched=False)
    cat.scan()
    assert cat.all_names() == ["one"]
    (tmp_path / "one.gguf").rename(tmp_path / "two.gguf")
    cat.scan()
    assert cat.all_names() == ["two"]


def test_names_come_from_model_flags_then_dirs_and_aliases_join_them(folder):
    cat = Catalog([str(folder)], models=[(str(folder / "tiny-a.gguf"), "first")],
                  aliases=[("tiny", str(folder / "tiny-b.gguf")), ("again", "tiny"),
                           ("a", "first")], fetched=False)
    cat.scan()
    assert "tiny-a" not in cat.names               # the --model's name serves that file
    assert cat.lookup("a") is cat.lookup("first") and cat.lookup("first").source == "model"
    b = cat.entry_for(folder / "tiny-b.gguf")
    assert cat.lookup("tiny") is cat.lookup("again") is b
    assert b.aliases == ["tiny", "again"]


def test_a_request_names_models_never_paths(folder):
    cat = Catalog([str(folder)], fetched=False)
    cat.scan()
    for name in (str(folder / "tiny-a.gguf"), "tiny-a.gguf", "../tiny-a", "/etc/passwd",
                 None, 3, ""):
        assert cat.lookup(name) is None


@pytest.mark.parametrize("alias, why", [
    ("x", "the form is NAME=PATH"), ("=p", "the form is NAME=PATH"),
    ("x=MISSING", "no such file"), ("x=NOTES", "not a model"),
    ("tiny-b=TINY", "already names")])
def test_bad_aliases_are_refused(folder, alias, why):
    alias = alias.replace("MISSING", str(folder / "missing.gguf")).replace(
        "NOTES", str(folder / "notes.gguf")).replace("TINY", str(folder / "tiny-a.gguf"))
    with pytest.raises(CatalogError, match=why):
        cat = Catalog([], models=[(str(folder / "tiny-b.gguf"), None)],
                      aliases=[parse_alias(alias)], fetched=False)
        cat.scan()


def test_serve_refuses_an_alias_naming_a_missing_file_and_exits_1(folder, capsys):
    code = cli.main(["serve", "--port", "0", "--no-spawn", "--insecure", "--model",
                     str(folder / "tiny-a.gguf"), "--alias", f"x={folder / 'missing.gguf'}"])
    assert code == 1
    assert "--alias x=" in capsys.readouterr().err


def test_admin_loads_are_remembered_until_an_admin_unloads_them(folder):
    cat = Catalog([], fetched=False)
    cat.scan()
    cat.remember("mine", str(folder / "tiny-a.gguf"))
    cat.scan()                                       # survives a rescan
    assert cat.lookup("mine").source == "admin"
    cat.forget("mine")
    assert cat.lookup("mine") is None


@pytest.mark.parametrize("value, seconds", [
    (None, None), (0, 0.0), (30, 30.0), (2.5, 2.5), ("45", 45.0), ("30s", 30.0),
    ("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), (-1, FOREVER), ("-1", FOREVER)])
def test_keep_alive_takes_seconds_and_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [True, False, "soon", "5 minutes", "-5m", -2, -0.5,
                                   math.inf, math.nan, 10**9, "9999h", [1], {"s": 1}, "",
                                   "1" * 100 + "s"])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(APIError) as exc:
        parse_keep_alive(value)
    assert exc.value.status == 400 and exc.value.param == "keep_alive"
