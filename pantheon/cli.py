"""The `pantheon` command: subcommands dispatched to the side that owns them.

Each subcommand imports only its own side (frontend or worker), so starting
a frontend never imports the forward and a worker never imports Starlette.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from pantheon.common import blas_env  # noqa: E402  (no NumPy: before anything loads it)

blas_env.apply()

from pantheon.common import logs, options, settings


def model_path(arg: str | None):
    from pantheon.common.default_model import default_model_path
    return arg or str(default_model_path(log=lambda m: print(m, file=sys.stderr)))


def cmd_models(args) -> int:
    from pantheon.common import model_catalog as catalog
    from pantheon.common.default_model import DEFAULT
    if args.models_command == "list":
        if args.url:                   # a running server's catalog, with each model's status
            from pantheon.frontend.catalog_cli import show
            return show(args.url, args.api_key or settings.api_key())
        print(catalog.format_listing(catalog.listing()))
        return 0
    name = DEFAULT if args.models_command == "fetch-default" else args.name
    try:
        print(catalog.fetch(name, log=lambda m: print(m, file=sys.stderr)))
    except catalog.FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_run(args) -> int:
    from pantheon.worker.run import run_chat
    from pantheon.worker.sampler import SamplingParams
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed)
    run_chat(model_path(args.model), args.prompt, system=args.system,
             max_tokens=args.max_tokens, params=params, quantize=args.quantize,
             activations=args.activations, kv_cache=args.kv)
    return 0


def cmd_bench(args) -> int:
    if args.bench == "engine":
        from pantheon.bench.engine import main
        if args.write_gguf:
            if not args.synthetic:
                raise ValueError("bench engine --write-gguf needs --synthetic NAME")
            from pantheon.bench.synthetic import write_gguf
            print(write_gguf(args.synthetic, args.write_gguf))
            return 0
        if args.synthetic:
            from pantheon.bench.synthetic import synthetic_model
            args.model = synthetic_model(args.synthetic)
        else:
            args.model = model_path(args.model)
        if getattr(args, "dies", None):
            from pantheon.bench.two_die import main as split_main
            return split_main(args)
        return main(args)
    if args.bench == "prefix":
        from pantheon.bench.prefix import main
        return main(args)
    if args.bench == "join":
        from pantheon.bench.join import main
        return main(args)
    if args.bench == "router":
        from pantheon.bench.router import main
        return main(args)
    if args.bench == "spec":
        from pantheon.bench.spec import main
        args.model = model_path(args.model)
        if args.spec == "draft" and not args.draft_model:
            raise ValueError("bench spec --spec draft needs --draft-model")
        args.progress = sys.stderr
        return main(args)
    from pantheon.bench.serve import main
    return main(args)


def cmd_serve(args) -> int:
    from pantheon.frontend.serve import main
    return main(args)


def cmd_admin(args) -> int:
    from pantheon.frontend import admin_cli, admin_top
    args.addr = args.addr or settings.admin_addr()
    if args.key_file:
        from pantheon.common.key_set import first_key
        args.key = first_key(args.key_file)
    args.key = args.key or settings.admin_key()
    args.keys = args.keys or settings.keys_dir()
    return (admin_top if args.admin_command == "top" else admin_cli).main(args)


def cmd_keys(args) -> int:
    from pantheon.common.keys import generate
    for line in generate(args.dir, args.worker or ["worker-1"]):
        print(line)
    return 0


def cmd_worker(args) -> int:
    from pantheon.worker.main import main
    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pantheon", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser("fetch-default", help="fetch the embedded default model into the cache")
    fetch = models_sub.add_parser("fetch", help="fetch a catalogue model into the cache")
    fetch.add_argument("name", help="a name that `pantheon models list` shows")
    listing = models_sub.add_parser("list", help="the catalogue and the cache: name, status, "
                                    "size, path; with --url, what a running server serves")
    listing.add_argument("--url", metavar="URL", help="a running server (e.g. "
                         "http://127.0.0.1:8080): its models, loaded, loading or available")
    listing.add_argument("--api-key", help="its API key (env PANTHEON_API_KEY)")
    models.set_defaults(func=cmd_models)

    run = sub.add_parser("run", help="one chat turn in-process, streamed to stdout")
    run.add_argument("prompt")
    run.add_argument("-m", "--model", help="GGUF file or Hugging Face folder (default: SmolLM2)")
    run.add_argument("--system", help="system prompt")
    run.add_argument("-n", "--max-tokens", type=int, default=256)
    run.add_argument("-t", "--temperature", type=float, default=0.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int)
    options.add_options(run, options.RUN)
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser("serve", help="the OpenAI-compatible server (frontend + workers)")
    options.add_options(serve, options.SERVE)
    serve.set_defaults(func=cmd_serve)

    admin = sub.add_parser("admin", help="load, unload and inspect models on a running server")
    admin.add_argument("--addr", help="admin socket (env PANTHEON_ADMIN_ADDR, default "
                       f"{settings.ADMIN_ADDR})")
    admin.add_argument("--key", help="admin key (env PANTHEON_ADMIN_KEY); visible in the "
                       "process list: prefer --key-file")
    admin.add_argument("--key-file", metavar="FILE", help="a file holding the admin key "
                       "(its first line)")
    admin.add_argument("--timeout", type=float, default=settings.ADMIN_TIMEOUT_S,
                       help="seconds to wait for the server to answer (default "
                       f"{settings.ADMIN_TIMEOUT_S:g}); then 'the server is not answering at "
                       "ADDR' and exit 1. A load or unload then runs as long as it needs "
                       "while the server stays connected")
    admin.add_argument("--keys", metavar="DIR", help="a folder holding the server's public "
                       "key (server.key), when the admin socket uses CURVE (env "
                       "PANTHEON_KEYS_DIR)")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True)
    load = admin_sub.add_parser("load", help="load a model (a new name, or one more replica)")
    load.add_argument("path")
    load.add_argument("--name")
    load.add_argument("--die", action="append", dest="dies", help="pin to this die")
    load.add_argument("--dies", type=lambda v: [d for d in v.split(",") if d],
                      dest="dies_split", metavar="A,B",
                      help="split the replica across two dies (pipeline stages)")
    load.add_argument("--split", type=int, metavar="K",
                      help="with --dies A,B: the first layer of the second stage")
    load.add_argument("--link", choices=["auto", "ipc", "tcp"],
                      help="with --dies A,B: the stage link between them (default auto: ipc "
                      "when both dies' workers run on one host, else tcp; CURVE with --keys)")
    load.add_argument("--ctx", type=int, default=0)
    load.add_argument("--slots", type=int, default=0)
    load.add_argument("--pin", action="store_true",
                      help="never unload it when idle nor evict it to make room")
    load.add_argument("--no-evict", action="store_true",
                      help="a 507 when no die has room, rather than evicting idle, "
                           "unpinned replicas (least recently used first) to make it")
    load.add_argument("--spec", metavar="KIND",
                      help="its speculative decoding: ngram, draft (with --draft-model) or "
                           "none (default: the server's --spec)")
    load.add_argument("--draft-model", metavar="PATH", help="--spec draft: the draft model")
    load.add_argument("--spec-n", type=int, metavar="N", help="prompt lookup's longest n-gram")
    load.add_argument("--spec-k", type=int, metavar="K",
                      help="the longest proposal verified in one step")
    options.add_options(load, options.ADMIN_LOAD)
    unload = admin_sub.add_parser("unload", help="unload every replica of a name, one die's, "
                                  "or one replica (--id)")
    unload.add_argument("name", nargs="?", help="the model's name (optional with --id)")
    unload.add_argument("--die")
    unload.add_argument("--id", dest="replica_id",
                        help="one replica, as `admin models` lists it (e.g. NAME#2)")
    unload.add_argument("--timeout-s", type=float, default=settings.UNLOAD_TIMEOUT_S,
                        help="drain deadline before in-flight requests are aborted")
    top = admin_sub.add_parser("top", help="a live view of dies, slots, queues, tok/s and "
                               "TTFT (q quits; one snapshot through a pipe)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    for cmd in ("dies", "models", "status", "rescan"):
        admin_sub.add_parser(cmd, help=f"show {cmd}")
    admin.set_defaults(func=cmd_admin)

    worker = sub.add_parser("worker", help="one worker process for one die")
    options.add_options(worker, options.WORKER)
    worker.set_defaults(func=cmd_worker)

    keys = sub.add_parser("keys", help="CURVE keys for the ZeroMQ links off loopback")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    generate = keys_sub.add_parser("generate", help="write the server key pair (if absent) "
                                   "and a folder per worker, its public key allowed")
    generate.add_argument("dir")
    generate.add_argument("--worker", action="append", metavar="NAME",
                          help="a worker key pair to add; repeatable (default: worker-1)")
    keys.set_defaults(func=cmd_keys)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="in-process forward speed, as JSON")
    engine.add_argument("-m", "--model")
    engine.add_argument("--die", default="cpu", help="cpu or a CUDA device number")
    engine.add_argument("--dies", metavar="A,B",
                        help="two CPU dies (cpu,cpu): the model split across them against "
                        "one die (bench/two_die.py)")
    engine.add_argument("--split", type=int, metavar="K",
                        help="with --dies: the second stage's first layer (default: the k "
                        "that evens the stages' multiply-adds, the head matrix on the first)")
    engine.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    engine.add_argument("--batches", metavar="N,N", default="1,4,8",
                        help="decode batch sizes (aggregate tokens/s each); default 1,4,8")
    options.add_options(engine, options.BENCH)
    engine.add_argument("--contexts", metavar="N,N",
                        help="also time batch-1 decode after prompts of these lengths")
    engine.add_argument("--synthetic", choices=["qwen35-wide", "qwen35-0.8b"],
                        help="a random-weight model of this shape instead of -m (written "
                             "once into the cache directory)")
    engine.add_argument("--write-gguf", metavar="FILE",
                        help="with --synthetic: write that model to FILE and exit (e.g. "
                             "qwen35-0.8b as F16, for llama-quantize FILE OUT Q4_K_M)")
    engine.add_argument("--compare-llama", metavar="BIN_DIR",
                        help="also run llama.cpp's llama-bench (and llama-batched-bench for "
                             "the batch sizes, if BIN_DIR holds it) on the same file and "
                             "threads, and print the ratios")
    engine.add_argument("--rounds", type=int, default=1,
                        help="measure the speed figures this many times and print the "
                             "medians (llama-bench after each round); default 1")
    from pantheon.bench.serve import add_arguments
    add_arguments(bench_sub.add_parser("serve", help="OpenAI streaming load generator, as JSON"))
    from pantheon.bench import prefix
    prefix.add_arguments(bench_sub.add_parser(
        "prefix", help="second-turn TTFT with and without the session cache, as JSON"))
    from pantheon.bench import spec
    spec.add_arguments(bench_sub.add_parser(
        "spec", help="decode speed with and without speculation (edit and chat), as JSON"))
    from pantheon.bench import join
    join.add_arguments(bench_sub.add_parser(
        "join", help="inter-token latency of running streams while a long prompt joins"))
    from pantheon.bench import router
    router.add_arguments(bench_sub.add_parser(
        "router", help="TTFT a router adds in front of instances, and its turn-2 session "
                       "hit rate, as JSON"))
    bench.set_defaults(func=cmd_bench)
    return parser


def kv_cache_of(args):
    """The KV types a command's flags (and the environment's default) ask for."""
    from pantheon.common.kv_cache import KVCacheTypes
    return KVCacheTypes.of(getattr(args, "kv_cache", None) or settings.kv_cache(),
                           getattr(args, "kv_cache_k", None), getattr(args, "kv_cache_v", None))


def command_of(args) -> str:
    """The option table's name of the parsed command (common/options.py)."""
    if args.command == "bench":
        return f"bench-{args.bench}"
    if args.command == "admin":
        return f"admin-{args.admin_command}"
    return args.command


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options.resolve(args, command_of(args))     # defaults from the environment
        logs.setup(settings.log_level(),
                   getattr(args, "log_format", None) or settings.log_format())
        logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per request: noise
        if args.command in ("run", "serve", "worker", "bench"):
            args.kv = kv_cache_of(args)     # a bad PANTHEON_KV_CACHE stops here, named
            settings.amx()                  # and a bad PANTHEON_AMX
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
