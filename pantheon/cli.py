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

from pantheon.common import logs, settings
from pantheon.common.weight_format import QUANTIZE_MODES as QUANTIZE_CHOICES


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
    args.api_key = args.api_key or settings.api_key()
    args.admin_key = args.admin_key or settings.admin_key()
    args.admin_addr = args.admin_addr or settings.admin_addr()
    args.keys = args.keys or settings.keys_dir()
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
    args.keys = args.keys or settings.keys_dir()
    from pantheon.worker.main import main
    return main(args)


def core_list(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cores are a comma-separated list of numbers: {text!r}")


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_lifecycle_arguments(serve: argparse.ArgumentParser) -> None:
    """`serve`'s catalog and model lifecycle (docs/models.md, "Models on demand")."""
    serve.add_argument("--alias", action="append", metavar="NAME=PATH",
                       help="one more name for a model file or folder (or for a catalog "
                            "name); repeatable")
    serve.add_argument("--pin", action="append", metavar="NAME",
                       help="never unload or evict this model (the --model ones are pinned); "
                            "repeatable")
    serve.add_argument("--keep-alive", type=float, default=300.0, metavar="S",
                       help="unload a replica after S seconds without a request (default "
                            "300; -1: never); a request's keep_alive overrides it")
    serve.add_argument("--max-loaded", type=int, default=0, metavar="N",
                       help="resident models at most; a load past it evicts the least "
                            "recently used idle one (default 0: no cap but memory)")
    serve.add_argument("--no-autoload", action="store_true",
                       help="a request for a model that is not loaded is a 503: only "
                            "--model and the admin API load")
    serve.add_argument("--no-preload", action="store_true",
                       help="load nothing at start: the --model files (or the default) "
                            "load on their first request")


def add_security_arguments(serve: argparse.ArgumentParser) -> None:
    """`serve`'s guards off loopback and its bounds on clients (docs/security.md)."""
    s = settings
    serve.add_argument("--keys", metavar="DIR", help="CURVE on the worker link and the admin "
                       "socket: a folder from `pantheon keys generate` (env "
                       "PANTHEON_KEYS_DIR); required off loopback")
    serve.add_argument("--insecure", action="store_true",
                       help="start even where a bind off loopback lacks its key, and let "
                            "workers join the link without keys (warned at every start)")
    serve.add_argument("--no-http-admin", action="store_true",
                       help="no /admin/ routes on the HTTP server (the admin socket stays; "
                            "no dashboard)")
    serve.add_argument("--dashboard", choices=("on", "readonly", "off"), default="on",
                       help="the operator's page at /dashboard (behind the admin key when "
                            "one is set): on, readonly (no load/unload buttons) or off "
                            "(default on)")
    serve.add_argument("--model-dir", action="append", metavar="DIR",
                       help="a folder of models: each *.gguf and Hugging Face folder in it "
                            "is served on request under its name, and /admin/models/load "
                            "may open models from it; repeatable (default for loads: the "
                            "cache folder and those of the --model files)")
    serve.add_argument("--allowed-hosts", metavar="NAMES", type=comma_list, default=[],
                       help="Host header names accepted besides localhost, 127.0.0.1, [::1] "
                            "and the bind address (comma list; '*': any). Off loopback the "
                            "Host is checked only when this is given")
    serve.add_argument("--cors-origins", metavar="ORIGINS", type=comma_list, default=[],
                       help="web origins a browser client may call the API from (comma "
                            "list, e.g. https://app.example; '*': any); default none: no "
                            "CORS headers, cross-site requests refused")
    serve.add_argument("--max-connections-per-client", type=int,
                       default=s.MAX_CONNECTIONS_PER_CLIENT,
                       help="open HTTP connections from one IP address (its idle ones are "
                            "closed first, then 503)")
    serve.add_argument("--max-request-slots", type=int, default=0,
                       help="slots one request's choices (n x prompts) hold at once; the "
                            "rest run as those finish, queued behind other requests "
                            "(default 0: half a replica's slots)")
    serve.add_argument("--prepare-timeout", type=float, default=s.PREPARE_TIMEOUT_S,
                       help="seconds for a request's templating and tokenization, queue "
                            "included (503 beyond)")
    serve.add_argument("--responses-ttl", type=float, default=s.RESPONSES_TTL_S, metavar="S",
                       help="seconds a stored /v1/responses response (and its conversation, "
                            "for previous_response_id) is kept")
    serve.add_argument("--responses-max-mb", type=float, default=s.RESPONSES_MAX_MB,
                       metavar="MB", help="stored responses together, MB (the oldest go "
                                          "first)")
    serve.add_argument("--pooling", choices=["auto", "mean", "last"], default="auto",
                       help="how /v1/embeddings pools a prompt's final hidden states: auto "
                            "(as the model file says; mean when it says nothing), mean, or "
                            "the last token's")
    serve.add_argument("--header-timeout", type=float, default=s.HEADER_TIMEOUT_S,
                       help="seconds for a request's line and headers (408 beyond)")
    serve.add_argument("--body-timeout", type=float, default=s.BODY_TIMEOUT_S,
                       help="seconds for a request's body after its headers (408 beyond)")
    serve.add_argument("--write-timeout", type=float, default=s.WRITE_TIMEOUT_S,
                       help="seconds a client may read nothing while data waits for it "
                            "before its connection is dropped")
    serve.add_argument("--max-header-bytes", type=int, default=s.MAX_HEADER_BYTES,
                       help="request line and headers, bytes (431 beyond)")
    serve.add_argument("--max-connections", type=int, default=s.MAX_CONNECTIONS,
                       help="open HTTP connections (503 beyond)")
    serve.add_argument("--send-buffer-bytes", type=int, default=s.SEND_BUFFER_BYTES,
                       help="per connection: the socket's send buffer and ours (0: the "
                            "kernel's autotuned one)")
    serve.add_argument("--max-messages", type=int, default=s.MAX_MESSAGES,
                       help="chat messages per request (400 beyond)")
    serve.add_argument("--max-request-tokens", type=int, default=s.MAX_REQUEST_TOKENS,
                       help="n x max_tokens (x prompts) per request (400 beyond)")
    serve.add_argument("--max-request-choices", type=int, default=s.MAX_REQUEST_CHOICES,
                       help="n x prompts per request (400 beyond)")
    serve.add_argument("--max-stop-chars", type=int, default=s.MAX_STOP_CHARS,
                       help="characters per stop string (400 beyond)")
    serve.add_argument("--max-tool-schema-bytes", type=int, default=s.MAX_TOOL_SCHEMA_BYTES,
                       help="`tools` as compact JSON, bytes (400 beyond)")
    serve.add_argument("--max-tool-schema-depth", type=int, default=s.MAX_TOOL_SCHEMA_DEPTH,
                       help="`tools` nesting depth (400 beyond)")
    serve.add_argument("--stream-buffer-tokens", type=int, default=s.STREAM_BUFFER_TOKENS,
                       help="tokens held for a client that stops reading its stream; its "
                            "request is aborted beyond")


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
    run.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto",
                     help="weights in memory: auto (as stored), none (fp32), q8_0, q4")
    add_kv_cache(run)
    add_activations(run)
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser("serve", help="the OpenAI-compatible server (frontend + workers)")
    serve.add_argument("--host", default=settings.HOST, help="HTTP bind address")
    serve.add_argument("--port", type=int, default=settings.PORT)
    serve.add_argument("--model", action="append", metavar="PATH",
                       help="GGUF file or Hugging Face folder; repeatable (default: SmolLM2)")
    serve.add_argument("--name", action="append", metavar="NAME",
                       help="served name of the --model at the same position")
    serve.add_argument("--model-dies", action="append", metavar="A,B",
                       help="split the --model at the same position across these two dies "
                       "(pipeline stages, one per die)")
    serve.add_argument("--spawn-workers", default="cpu", metavar="DIES",
                       help="dies to spawn workers for: cpu, CUDA numbers, emu:INDEX[:SIZE] "
                       "(an emulated CUDA die), e.g. cpu,0,1")
    serve.add_argument("--no-spawn", action="store_true",
                       help="spawn nothing; wait for externally supervised workers")
    serve.add_argument("--worker-addr", default=settings.WORKER_ADDR,
                       help="ZeroMQ address the frontend binds for workers")
    serve.add_argument("--slots", type=int, default=settings.SLOTS,
                       help="KV slots per model replica (1: single-user mode)")
    serve.add_argument("--prefill-chunk", type=int, default=None,
                       help="prompt tokens per step; bounds a decode stall to one chunk "
                       "(default 128, or QWEN35_BS_PREFILL_CHUNK)")
    serve.add_argument("--prefix-cache-mb", type=float, default=settings.PREFIX_CACHE_MB,
                       help="per worker: host memory for KV states of idle conversations")
    serve.add_argument("--queue-depth", type=int, default=None,
                       help="requests that may wait for a slot per model (env BS_QUEUE_DEPTH, "
                            f"default {settings.QUEUE_DEPTH})")
    serve.add_argument("--queue-timeout", type=float, default=settings.QUEUE_TIMEOUT_S,
                       help="seconds a request may wait for a slot before a 429")
    serve.add_argument("--ctx", type=int, default=0,
                       help="context per slot (default: the model's, at most 4096)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (env "
                       "PANTHEON_API_KEY); visible to every user in the process list: "
                       "prefer --api-key-file")
    serve.add_argument("--api-key-file", metavar="FILE", help="API keys, one per line, "
                       "reread when the file changes (chmod 600)")
    serve.add_argument("--admin-key", help="key for /admin/ routes and the admin socket "
                       "(env PANTHEON_ADMIN_KEY; default: the API key guards /admin/); "
                       "visible in the process list: prefer --admin-key-file")
    serve.add_argument("--admin-key-file", metavar="FILE", help="admin keys, one per "
                       "line, reread when the file changes (chmod 600)")
    serve.add_argument("--admin-addr", help="ZeroMQ admin socket to bind "
                       f"(env PANTHEON_ADMIN_ADDR, default {settings.ADMIN_ADDR})")
    serve.add_argument("--max-models", type=int, default=settings.MAX_MODELS,
                       help="resident replicas at most (the spec's MR_MAX_MODELS)")
    serve.add_argument("--max-body-bytes", type=int, default=settings.MAX_BODY_BYTES)
    serve.add_argument("--no-context-cap", action="store_true",
                       help="refuse (400) a conversation longer than the context instead of "
                            "dropping its oldest turns")
    serve.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto",
                       help="weights in memory: auto (GGUF blocks as stored, float tensors "
                            "as stored), none (dense fp32, the exact reference), q8_0 or q4 "
                            "(float tensors quantized at load)")
    add_kv_cache(serve)
    add_activations(serve)
    serve.add_argument("--spec", default="", metavar="KIND",
                       help="speculative decoding of every --model: ngram (prompt lookup: "
                            "the sequence's last tokens matched earlier in its prompt and "
                            "output propose what followed) or draft (--draft-model); exact, "
                            "greedy and sampled")
    serve.add_argument("--draft-model", metavar="PATH",
                       help="--spec draft: a small model of the same tokenizer, on the same "
                            "die, proposing its greedy tokens")
    serve.add_argument("--spec-n", type=int, default=3, metavar="N",
                       help="prompt lookup's longest n-gram (1-64, default 3)")
    serve.add_argument("--spec-k", type=int, default=8, metavar="K",
                       help="the longest proposal verified in one step (1-16, default 8)")
    serve.add_argument("--shutdown-timeout", type=float, default=settings.SHUTDOWN_TIMEOUT_S,
                       metavar="S", help="on SIGTERM/SIGINT, seconds that running and queued "
                       "requests may take to finish before they are ended (a second signal "
                       "skips the wait)")
    serve.add_argument("--metrics-auth", action="store_true",
                       help="GET /metrics takes the API key (default: public, like /health)")
    serve.add_argument("--log-format", choices=["text", "json"],
                       help="log lines as text or one JSON object each (env PANTHEON_LOG_FORMAT)")
    serve.add_argument("--log-prompts", action="store_true",
                       help="put each request's prompt text in its access-log line")
    serve.add_argument("--worker-timeout", type=float, default=settings.WORKER_TIMEOUT_S,
                       help="seconds of silence (or of one step) after which a worker is "
                            "slow: it keeps its requests and gets new ones only when no "
                            "other replica can serve")
    serve.add_argument("--worker-lost-after", type=float,
                       default=settings.WORKER_LOST_AFTER_S,
                       help="seconds a worker may answer neither heartbeats nor probes "
                            "before it is lost (a spawned one is then killed and restarted)")
    add_security_arguments(serve)
    add_lifecycle_arguments(serve)
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
    load.add_argument("--activations", choices=settings.ACTIVATIONS,
                      help="its CPU products' activations (default: the server's "
                           "--activations)")
    add_kv_cache(load)
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
    worker.add_argument("--die", default="cpu", help="cpu (or cpu:N), a CUDA device number, "
                        "or emu:INDEX[:SIZE] (an emulated CUDA die, for tests)")
    worker.add_argument("--frontend", default=settings.WORKER_ADDR,
                        help="the frontend's ZeroMQ address")
    worker.add_argument("--slots", type=int, default=settings.SLOTS,
                        help="default KV slots per model")
    worker.add_argument("--cores", type=core_list, help="pin to these CPU cores, e.g. 0,1")
    worker.add_argument("--prefix-cache-mb", type=float, default=settings.PREFIX_CACHE_MB,
                        help="host memory for KV states of idle conversations (0: off)")
    worker.add_argument("--budget-mb", type=float,
                        help="memory models may use on this die (default: all of it)")
    worker.add_argument("--log-format", choices=["text", "json"],
                        help="log lines as text or one JSON object each (env PANTHEON_LOG_FORMAT)")
    worker.add_argument("--parent-pid", type=int,
                        help="exit when this process (the spawning frontend) is gone")
    worker.add_argument("--keys", metavar="DIR", help="CURVE: a worker folder from `pantheon "
                        "keys generate` (server.key, worker.key_secret; env PANTHEON_KEYS_DIR); "
                        "required unless --insecure")
    worker.add_argument("--insecure", action="store_true",
                        help="connect to the frontend without keys, on loopback too: the "
                             "worker obeys whatever process bound the address (warned)")
    add_kv_cache(worker)
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
    engine.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    engine.add_argument("--batches", metavar="N,N", default="1,4,8",
                        help="decode batch sizes (aggregate tokens/s each); default 1,4,8")
    engine.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto",
                        help="weights in memory, as `serve --quantize`")
    add_kv_cache(engine)
    add_activations(engine, default="int16")
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


def add_kv_cache(parser) -> None:
    kinds = settings.KV_CACHE_TYPES
    parser.add_argument("--kv-cache", choices=kinds, type=str.lower,
                        help="KV cache type of keys and values: f32 (a CPU's default), f16 "
                             "(a GPU's), q8_0 or q4_0 (blocks of 32 with an fp16 scale, "
                             "llama.cpp's layout); env PANTHEON_KV_CACHE, QWEN35_KV_Q4=1: q4_0")
    parser.add_argument("--kv-cache-k", choices=kinds, type=str.lower,
                        help="the keys' type alone (llama.cpp's -ctk)")
    parser.add_argument("--kv-cache-v", choices=kinds, type=str.lower,
                        help="the values' type alone (llama.cpp's -ctv)")


def kv_cache_of(args):
    """The KV types a command's flags (and the environment's default) ask for."""
    from pantheon.common.kv_cache import KVCacheTypes
    return KVCacheTypes.of(getattr(args, "kv_cache", None) or settings.kv_cache(),
                           getattr(args, "kv_cache_k", None), getattr(args, "kv_cache_v", None))


def add_activations(parser, default: str = "auto") -> None:
    parser.add_argument("--activations", choices=settings.ACTIVATIONS, default=default,
                        help="what a CPU die's Q4_K/Q5_K/Q6_K products take at batch 1 "
                             "(AVX2 builds): int16 (16000 steps per 256), int8 (127: half "
                             "the multiplies, coarser) or auto (int8 where a short text "
                             "measured at the file's first load stays within top-1 99 %% "
                             f"and KL 0.01 of int16; cached); default {default}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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
