"""The option table (common/options.py): every config field has its option, the table's
defaults are the configs' own, the environment gives defaults that a flag overrides, and
the flags the table generates parse into the configs."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import pytest

from pantheon.cli import build_parser, main
from pantheon.common import options
from pantheon.common.kv_cache import KVCacheTypes
from pantheon.frontend.limits import ConnectionLimits, RequestLimits
from pantheon.frontend.model_policy import LifecycleConfig
from pantheon.frontend.serve import ServeConfig
from pantheon.worker.main import WorkerConfig

CONFIGS = (ServeConfig, RequestLimits, ConnectionLimits, LifecycleConfig, WorkerConfig)
# fields built from several flags, from none, or from the environment alone (serve.py and
# worker/main.py build these by hand, each in one place)
DERIVED = {
    "ServeConfig": {"models", "spawn", "api_key", "admin_key", "kv_cache", "request_limits",
                    "connection_limits", "lifecycle", "registry_url", "registry_kind",
                    "heartbeat_s", "node_id", "registry_transport", "advertise_url"},
    "LifecycleConfig": {"aliases", "fetched"},
    "WorkerConfig": {"kv_cache"},
}


def parse(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    options.resolve(args, argv[0] if argv[0] != "bench" else "bench-" + argv[1])
    return args


def test_every_config_field_has_one_option_or_is_derived():
    filled: dict[str, list[str]] = {}
    for o in options.OPTIONS:
        if o.field:
            filled.setdefault(o.field, []).append(o.flags[-1])
    for cls in CONFIGS:
        names = {f.name for f in fields(cls)}
        by_option = {f.split(".")[1] for f in filled if f.split(".")[0] == cls.__name__}
        assert by_option <= names, f"{cls.__name__}: options fill no such field"
        missing = names - by_option - DERIVED.get(cls.__name__, set())
        assert not missing, f"{cls.__name__} fields without an option: {sorted(missing)}"
        assert not by_option & DERIVED.get(cls.__name__, set())
    twice = {f: flags for f, flags in filled.items() if len(flags) > 1}
    assert not twice, f"fields filled by two options: {twice}"


def test_a_flag_appears_once_per_command():
    for command in (options.SERVE, options.WORKER, options.RUN, options.BENCH,
                    options.ADMIN_LOAD):
        flags = [f for o in options.of(command) for f in o.flags]
        assert len(flags) == len(set(flags)), command


def defaults(cls) -> dict:
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def test_the_tables_defaults_are_the_configs_defaults(monkeypatch):
    for name in ("BS_QUEUE_DEPTH", "QWEN35_BS_PREFILL_CHUNK", "QWEN35_BS_PREFILL_BATCH",
                 "PANTHEON_ADMIN_ADDR", "PANTHEON_LOG_FORMAT", "PANTHEON_KEYS_DIR",
                 "PANTHEON_API_KEY", "PANTHEON_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    serve = parse("serve")
    built = options.config(ServeConfig, serve, options.SERVE, models=[("m.gguf", None)])
    want = defaults(ServeConfig)
    for f in fields(ServeConfig):
        if f.name not in DERIVED["ServeConfig"] and f.name in want:
            assert getattr(built, f.name) == want[f.name] or \
                (f.name == "model_dies" and built.model_dies == []), f.name
    for cls in (RequestLimits, ConnectionLimits):
        assert options.config(cls, serve, options.SERVE) == cls()
    life = options.config(LifecycleConfig, serve, options.SERVE)
    assert life == LifecycleConfig()
    worker = options.config(WorkerConfig, parse("worker"), options.WORKER)
    assert worker == WorkerConfig(prefix_cache_bytes=worker.prefix_cache_bytes)
    assert worker.prefix_cache_bytes == int(options.settings.PREFIX_CACHE_MB * (1 << 20))


def test_flags_fill_the_configs():
    args = parse("serve", "--port", "9001", "--no-context-cap", "--no-autoload", "--pin", "a",
                 "--pin", "b", "--max-messages", "7", "--header-timeout", "2.5",
                 "--model-dies", "cpu,emu:0", "--cors-origins", "https://x.example, https://y",
                 "--draft-model", "d.gguf", "--spec", "draft")
    cfg = options.config(ServeConfig, args, options.SERVE, models=[("m.gguf", None)],
                         request_limits=options.config(RequestLimits, args, options.SERVE),
                         connection_limits=options.config(ConnectionLimits, args,
                                                          options.SERVE),
                         lifecycle=options.config(LifecycleConfig, args, options.SERVE))
    assert cfg.port == 9001 and cfg.context_cap is False
    assert cfg.model_dies == [["cpu", "emu:0"]] and cfg.draft_model == "d.gguf"
    assert cfg.cors_origins == ["https://x.example", "https://y"]
    assert cfg.request_limits.max_messages == 7
    assert cfg.connection_limits.header_timeout_s == 2.5
    assert cfg.lifecycle.autoload is False and cfg.lifecycle.preload is True
    assert cfg.lifecycle.pins == ["a", "b"]
    worker = options.config(WorkerConfig, parse("worker", "--die", "emu:1", "--cores", "0,1",
                                                "--budget-mb", "1.5", "--parent-pid", "42",
                                                "--prefix-cache-mb", "0"), options.WORKER)
    assert (worker.die, worker.cores, worker.parent_pid) == ("emu:1", [0, 1], 42)
    assert worker.budget_bytes == 3 << 19 and worker.prefix_cache_bytes == 0


def test_the_environment_gives_defaults_that_flags_override(monkeypatch):
    monkeypatch.setenv("BS_QUEUE_DEPTH", "5")
    monkeypatch.setenv("QWEN35_BS_PREFILL_CHUNK", "64")
    monkeypatch.setenv("PANTHEON_KEYS_DIR", "/keys")
    args = parse("serve")
    assert (args.queue_depth, args.prefill_chunk, args.keys) == (5, 64, "/keys")
    args = parse("serve", "--queue-depth", "9", "--prefill-chunk", "16", "--keys", "k")
    assert (args.queue_depth, args.prefill_chunk, args.keys) == (9, 16, "k")
    assert parse("worker").keys == "/keys"
    monkeypatch.setenv("QWEN35_BS_PREFILL_BATCH", "0")         # the spec's token-by-token
    assert parse("serve").prefill_chunk == 1


@pytest.mark.parametrize("name,value", [("BS_QUEUE_DEPTH", "many"),
                                        ("QWEN35_BS_PREFILL_CHUNK", "0"),
                                        ("PANTHEON_LOG_FORMAT", "xml")])
def test_a_bad_variable_stops_the_start_naming_it(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    assert main(["serve", "--no-spawn", "--port", "1"]) == 1
    assert name in capsys.readouterr().err


def test_a_bad_flag_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("worker", "--cores", "0,x")
    assert "comma-separated list of numbers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("serve", "--kv-cache", "q3")
    assert "invalid choice" in capsys.readouterr().err


def test_the_admin_clients_load_flags_come_from_the_table():
    args = parse("admin", "load", "m.gguf", "--kv-cache", "Q8_0", "--activations", "int8")
    assert (args.kv_cache, args.activations, args.kv_cache_k) == ("q8_0", "int8", None)
    assert KVCacheTypes.of(args.kv_cache) == KVCacheTypes("q8_0", "q8_0")
