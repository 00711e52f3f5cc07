"""The one table of configuration options: each option once, with its flag, type,
default, environment variable, help, the commands that take it and the config field it
fills.

`pantheon/cli.py` builds the flags of `serve`, `worker`, `run` and `bench engine` from
it (`add_options`), and `serve` and `worker` build their configs from the parsed flags
(`config`). An option's default may come from the environment: its `env` names a reader
in common/settings.py, used when the flag is not given (`resolve`), so a flag always
wins and a bad variable is refused at start with its name.

What a worker must agree on with the frontend (quantization, activations, KV types,
prefill chunk, slots, context) is not read from the environment by the worker: it
travels in each Load message. The only variables set for the processes themselves are
the BLAS ones, in common/blas_env.py.

A command's own arguments (a prompt, sampling settings of `run`, what `bench engine`
measures) are not configuration and stay beside their command in cli.py.

To add an option: one `Option` here (with `field="Config.name"` if a config holds it), the
field on that config, and a line on docs/cli.md; tests/test_options.py checks that every
config field has its option (or is listed as derived) and every option's field exists.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Callable

from . import settings
from .stage_bind import StageBind
from .weight_format import QUANTIZE_MODES

SERVE, WORKER, RUN, BENCH = "serve", "worker", "run", "bench-engine"
ADMIN_LOAD = "admin-load"        # the admin client's load: its flags go in the request


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]               # ("--kv-cache",)
    commands: tuple[str, ...]            # the commands that take it
    help: str | None = None
    type: Callable | None = None
    default: Any = None
    env: Callable[[], Any] | None = None  # the default's reader (common/settings.py)
    choices: tuple | None = None
    metavar: str | None = None
    action: str | None = None            # store_true, append
    field: str | None = None             # "Config.name" it fills; None: read by its command
    invert: bool = False                 # a --no-X flag: the field holds its negation
    convert: Callable | None = None      # the parsed value -> the field's value

    @property
    def dest(self) -> str:
        return self.flags[-1].lstrip("-").replace("-", "_")


def core_list(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cores are a comma-separated list of numbers: {text!r}")


def stage_bind(text: str):
    try:
        return StageBind.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def dies_of(values: list[str] | None) -> list:
    """--model-dies A,B per --model: [a, b] (split) or None."""
    return [[d for d in v.split(",") if d] if v else None for v in values or []]


def mib(value: float | None) -> int:
    return int((value or 0) * (1 << 20))


s = settings
KV_HELP = ("KV cache type of keys and values: f32 (a CPU's default), f16 (a GPU's), q8_0 or "
           "q4_0 (blocks of 32 with an fp16 scale, llama.cpp's layout); env "
           "PANTHEON_KV_CACHE, QWEN35_KV_Q4=1: q4_0")
ACTIVATIONS_HELP = ("what a CPU die's Q4_K/Q5_K/Q6_K/IQ4_XS products take (AVX2 builds): "
                    "int16 (16000 steps per 256), int8 (127: vpmaddubsw products, 1.2-1.5x "
                    "faster, coarser) or auto (int8 where a short text measured at the file's "
                    "first load, as a prefill and token by token, stays within top-1 99 %% "
                    "and KL 0.01 of int16; cached); default ")
ENGINE = (SERVE, RUN, BENCH)

OPTIONS: tuple[Option, ...] = (
    # -- serve: where it listens and what it serves
    Option(("--host",), (SERVE,), "HTTP bind address", default=s.HOST, field="ServeConfig.host"),
    Option(("--port",), (SERVE,), None, int, s.PORT, field="ServeConfig.port"),
    Option(("--model",), (SERVE,), "GGUF file or Hugging Face folder; repeatable (default: "
           "SmolLM2)", metavar="PATH", action="append"),
    Option(("--name",), (SERVE,), "served name of the --model at the same position",
           metavar="NAME", action="append"),
    Option(("--model-dies",), (SERVE,), "split the --model at the same position across these "
           "two dies (pipeline stages, one per die)", metavar="A,B", action="append",
           field="ServeConfig.model_dies", convert=dies_of),
    Option(("--spawn-workers",), (SERVE,), "dies to spawn workers for: cpu, CUDA numbers, "
           "emu:INDEX[:SIZE] (an emulated CUDA die), e.g. cpu,0,1", default="cpu",
           metavar="DIES"),
    Option(("--no-spawn",), (SERVE,), "spawn nothing; wait for externally supervised workers",
           action="store_true"),
    Option(("--worker-addr",), (SERVE,), "ZeroMQ address the frontend binds for workers",
           default=s.WORKER_ADDR, field="ServeConfig.worker_addr"),
    Option(("--slots",), (SERVE,), "KV slots per model replica (1: single-user mode)", int,
           s.SLOTS, field="ServeConfig.slots"),
    Option(("--prefill-chunk",), (SERVE,), "prompt tokens per step; bounds a decode stall to "
           "one chunk (default 128, or QWEN35_BS_PREFILL_CHUNK)", int, env=s.prefill_chunk,
           field="ServeConfig.prefill_chunk"),
    Option(("--prefix-cache-mb",), (SERVE,), "per worker: host memory for KV states of idle "
           "conversations", float, s.PREFIX_CACHE_MB, field="ServeConfig.prefix_cache_mb"),
    Option(("--queue-depth",), (SERVE,), "requests that may wait for a slot per model (env "
           f"BS_QUEUE_DEPTH, default {s.QUEUE_DEPTH})", int, env=s.queue_depth,
           field="ServeConfig.queue_depth"),
    Option(("--queue-timeout",), (SERVE,), "seconds a request may wait for a slot before a "
           "429", float, s.QUEUE_TIMEOUT_S, field="ServeConfig.queue_timeout_s"),
    Option(("--ctx",), (SERVE,), "context per slot (default: the model's, at most 4096)", int,
           0, field="ServeConfig.ctx"),
    Option(("--api-key",), (SERVE,), "require 'Authorization: Bearer KEY' (env "
           "PANTHEON_API_KEY); visible to every user in the process list: prefer "
           "--api-key-file", env=s.api_key),
    Option(("--api-key-file",), (SERVE,), "API keys, one per line, reread when the file "
           "changes (chmod 600)", metavar="FILE"),
    Option(("--admin-key",), (SERVE,), "key for /admin/ routes and the admin socket (env "
           "PANTHEON_ADMIN_KEY; default: the API key guards /admin/); visible in the process "
           "list: prefer --admin-key-file", env=s.admin_key),
    Option(("--admin-key-file",), (SERVE,), "admin keys, one per line, reread when the file "
           "changes (chmod 600)", metavar="FILE"),
    Option(("--admin-addr",), (SERVE,), "ZeroMQ admin socket to bind (env PANTHEON_ADMIN_ADDR, "
           f"default {s.ADMIN_ADDR})", env=s.admin_addr, field="ServeConfig.admin_addr"),
    Option(("--max-models",), (SERVE,), "resident replicas at most (the spec's MR_MAX_MODELS)",
           int, s.MAX_MODELS, field="ServeConfig.max_models"),
    Option(("--max-body-bytes",), (SERVE,), None, int, s.MAX_BODY_BYTES,
           field="ServeConfig.max_body_bytes"),
    Option(("--no-context-cap",), (SERVE,), "refuse (400) a conversation longer than the "
           "context instead of dropping its oldest turns", action="store_true",
           field="ServeConfig.context_cap", invert=True),
    # -- the engine: serve passes these to its workers in each Load; run and bench use them
    Option(("--quantize",), (SERVE,), "weights in memory: auto (GGUF blocks as stored, float "
           "tensors as stored), none (dense fp32, the exact reference), q8_0 or q4 (float "
           "tensors quantized at load)", default="auto", choices=QUANTIZE_MODES,
           field="ServeConfig.quantize"),
    Option(("--quantize",), (RUN,), "weights in memory: auto (as stored), none (fp32), q8_0, "
           "q4", default="auto", choices=QUANTIZE_MODES),
    Option(("--quantize",), (BENCH,), "weights in memory, as `serve --quantize`",
           default="auto", choices=QUANTIZE_MODES),
    Option(("--kv-cache",), ENGINE + (WORKER, ADMIN_LOAD), KV_HELP, str.lower,
           choices=settings.KV_CACHE_TYPES),
    Option(("--kv-cache-k",), ENGINE + (WORKER, ADMIN_LOAD),
           "the keys' type alone (llama.cpp's -ctk)", str.lower,
           choices=settings.KV_CACHE_TYPES),
    Option(("--kv-cache-v",), ENGINE + (WORKER, ADMIN_LOAD),
           "the values' type alone (llama.cpp's -ctv)", str.lower,
           choices=settings.KV_CACHE_TYPES),
    Option(("--activations",), (SERVE, RUN), ACTIVATIONS_HELP + "auto", default="auto",
           choices=settings.ACTIVATIONS, field="ServeConfig.activations"),
    Option(("--activations",), (BENCH,), ACTIVATIONS_HELP + "int16", default="int16",
           choices=settings.ACTIVATIONS),
    Option(("--activations",), (ADMIN_LOAD,), "its CPU products' activations (default: the "
           "server's --activations)", choices=settings.ACTIVATIONS),
    Option(("--spec",), (SERVE,), "speculative decoding of every --model: ngram (prompt "
           "lookup: the sequence's last tokens matched earlier in its prompt and output "
           "propose what followed) or draft (--draft-model); exact, greedy and sampled",
           default="", metavar="KIND", field="ServeConfig.spec"),
    Option(("--draft-model",), (SERVE,), "--spec draft: a small model of the same tokenizer, on "
           "the same die, proposing its greedy tokens", metavar="PATH",
           field="ServeConfig.draft_model", convert=lambda v: v or ""),
    Option(("--spec-n",), (SERVE,), "prompt lookup's longest n-gram (1-64, default 3)", int, 3,
           metavar="N", field="ServeConfig.spec_n"),
    Option(("--spec-k",), (SERVE,), "the longest proposal verified in one step (1-16, default "
           "8)", int, 8, metavar="K", field="ServeConfig.spec_k"),
    # -- serve: operation
    Option(("--shutdown-timeout",), (SERVE,), "on SIGTERM/SIGINT, seconds that running and "
           "queued requests may take to finish before they are ended (a second signal skips "
           "the wait)", float, s.SHUTDOWN_TIMEOUT_S, metavar="S",
           field="ServeConfig.shutdown_timeout_s"),
    Option(("--metrics-auth",), (SERVE,), "GET /metrics takes the API key (default: public, "
           "like /health)", action="store_true", field="ServeConfig.metrics_auth"),
    Option(("--log-format",), (SERVE, WORKER), "log lines as text or one JSON object each (env "
           "PANTHEON_LOG_FORMAT)", env=s.log_format, choices=("text", "json"),
           field="ServeConfig.log_format"),
    Option(("--log-prompts",), (SERVE,), "put each request's prompt text in its access-log "
           "line", action="store_true", field="ServeConfig.log_prompts"),
    Option(("--worker-timeout",), (SERVE,), "seconds of silence (or of one step) after which a "
           "worker is slow: it keeps its requests and gets new ones only when no other "
           "replica can serve", float, s.WORKER_TIMEOUT_S, field="ServeConfig.worker_timeout_s"),
    Option(("--worker-lost-after",), (SERVE,), "seconds a worker may answer neither heartbeats "
           "nor probes before it is lost (a spawned one is then killed and restarted)", float,
           s.WORKER_LOST_AFTER_S, field="ServeConfig.worker_lost_after_s"),
    # -- serve: security (docs/security.md)
    Option(("--keys",), (SERVE,), "CURVE on the worker link and the admin socket: a folder "
           "from `pantheon keys generate` (env PANTHEON_KEYS_DIR); required off loopback",
           env=s.keys_dir, metavar="DIR", field="ServeConfig.keys_dir"),
    Option(("--insecure",), (SERVE,), "start even where a bind off loopback lacks its key, and "
           "let workers join the link without keys (warned at every start)",
           action="store_true", field="ServeConfig.insecure"),
    Option(("--no-http-admin",), (SERVE,), "no /admin/ routes on the HTTP server (the admin "
           "socket stays; no dashboard)", action="store_true", field="ServeConfig.http_admin",
           invert=True),
    Option(("--dashboard",), (SERVE,), "the operator's page at /dashboard (behind the admin key "
           "when one is set): on, readonly (no load/unload buttons) or off (default on)",
           default="on", choices=("on", "readonly", "off"), field="ServeConfig.dashboard"),
    Option(("--model-dir",), (SERVE,), "a folder of models: each *.gguf and Hugging Face folder "
           "in it is served on request under its name, and /admin/models/load may open "
           "models from it; repeatable (default for loads: the cache folder and those of the "
           "--model files)", metavar="DIR", action="append", field="ServeConfig.model_dirs"),
    Option(("--allowed-hosts",), (SERVE,), "Host header names accepted besides localhost, "
           "127.0.0.1, [::1] and the bind address (comma list; '*': any). Off loopback the "
           "Host is checked only when this is given", comma_list, [], metavar="NAMES",
           field="ServeConfig.allowed_hosts"),
    Option(("--cors-origins",), (SERVE,), "web origins a browser client may call the API from "
           "(comma list, e.g. https://app.example; '*': any); default none: no CORS headers, "
           "cross-site requests refused", comma_list, [], metavar="ORIGINS",
           field="ServeConfig.cors_origins"),
    Option(("--max-connections-per-client",), (SERVE,), "open HTTP connections from one IP "
           "address (its idle ones are closed first, then 503)", int,
           s.MAX_CONNECTIONS_PER_CLIENT, field="ConnectionLimits.max_connections_per_client"),
    Option(("--max-request-slots",), (SERVE,), "slots one request's choices (n x prompts) hold "
           "at once; the rest run as those finish, queued behind other requests (default 0: "
           "half a replica's slots)", int, 0, field="ServeConfig.max_request_slots"),
    Option(("--prepare-timeout",), (SERVE,), "seconds for a request's templating and "
           "tokenization, queue included (503 beyond)", float, s.PREPARE_TIMEOUT_S,
           field="ServeConfig.prepare_timeout_s"),
    Option(("--responses-ttl",), (SERVE,), "seconds a stored /v1/responses response (and its "
           "conversation, for previous_response_id) is kept", float, s.RESPONSES_TTL_S,
           metavar="S", field="ServeConfig.responses_ttl_s"),
    Option(("--responses-max-mb",), (SERVE,), "stored responses together, MB (the oldest go "
           "first)", float, s.RESPONSES_MAX_MB, metavar="MB",
           field="ServeConfig.responses_max_mb"),
    Option(("--pooling",), (SERVE,), "how /v1/embeddings pools a prompt's final hidden states: "
           "auto (as the model file says; mean when it says nothing), mean, or the last "
           "token's", default="auto", choices=("auto", "mean", "last"),
           field="ServeConfig.pooling"),
    # -- serve: what one connection and one request may hold (frontend/limits.py)
    Option(("--header-timeout",), (SERVE,), "seconds for a request's line and headers (408 "
           "beyond)", float, s.HEADER_TIMEOUT_S, field="ConnectionLimits.header_timeout_s"),
    Option(("--body-timeout",), (SERVE,), "seconds for a request's body after its headers (408 "
           "beyond)", float, s.BODY_TIMEOUT_S, field="ConnectionLimits.body_timeout_s"),
    Option(("--write-timeout",), (SERVE,), "seconds a client may read nothing while data waits "
           "for it before its connection is dropped", float, s.WRITE_TIMEOUT_S,
           field="ConnectionLimits.write_timeout_s"),
    Option(("--max-header-bytes",), (SERVE,), "request line and headers, bytes (431 beyond)",
           int, s.MAX_HEADER_BYTES, field="ConnectionLimits.max_header_bytes"),
    Option(("--max-connections",), (SERVE,), "open HTTP connections (503 beyond)", int,
           s.MAX_CONNECTIONS, field="ConnectionLimits.max_connections"),
    Option(("--send-buffer-bytes",), (SERVE,), "per connection: the socket's send buffer and "
           "ours (0: the kernel's autotuned one)", int, s.SEND_BUFFER_BYTES,
           field="ConnectionLimits.send_buffer_bytes"),
    Option(("--max-messages",), (SERVE,), "chat messages per request (400 beyond)", int,
           s.MAX_MESSAGES, field="RequestLimits.max_messages"),
    Option(("--max-request-tokens",), (SERVE,), "n x max_tokens (x prompts) per request (400 "
           "beyond)", int, s.MAX_REQUEST_TOKENS, field="RequestLimits.max_request_tokens"),
    Option(("--max-request-choices",), (SERVE,), "n x prompts per request (400 beyond)", int,
           s.MAX_REQUEST_CHOICES, field="RequestLimits.max_choices"),
    Option(("--max-stop-chars",), (SERVE,), "characters per stop string (400 beyond)", int,
           s.MAX_STOP_CHARS, field="RequestLimits.max_stop_chars"),
    Option(("--max-tool-schema-bytes",), (SERVE,), "`tools` as compact JSON, bytes (400 "
           "beyond)", int, s.MAX_TOOL_SCHEMA_BYTES, field="RequestLimits.max_tool_schema_bytes"),
    Option(("--max-tool-schema-depth",), (SERVE,), "`tools` nesting depth (400 beyond)", int,
           s.MAX_TOOL_SCHEMA_DEPTH, field="RequestLimits.max_tool_schema_depth"),
    Option(("--stream-buffer-tokens",), (SERVE,), "tokens held for a client that stops reading "
           "its stream; its request is aborted beyond", int, s.STREAM_BUFFER_TOKENS,
           field="ServeConfig.stream_buffer_tokens"),
    # -- serve: models on demand (docs/models.md)
    Option(("--alias",), (SERVE,), "one more name for a model file or folder (or for a catalog "
           "name); repeatable", metavar="NAME=PATH", action="append"),
    Option(("--pin",), (SERVE,), "never unload or evict this model (the --model ones are "
           "pinned); repeatable", metavar="NAME", action="append", field="LifecycleConfig.pins",
           convert=lambda v: v or []),
    Option(("--keep-alive",), (SERVE,), "unload a replica after S seconds without a request "
           "(default 300; -1: never); a request's keep_alive overrides it", float, 300.0,
           metavar="S", field="LifecycleConfig.keep_alive_s"),
    Option(("--max-loaded",), (SERVE,), "resident models at most; a load past it evicts the "
           "least recently used idle one (default 0: no cap but memory)", int, 0, metavar="N",
           field="LifecycleConfig.max_loaded"),
    Option(("--no-autoload",), (SERVE,), "a request for a model that is not loaded is a 503: "
           "only --model and the admin API load", action="store_true",
           field="LifecycleConfig.autoload", invert=True),
    Option(("--no-preload",), (SERVE,), "load nothing at start: the --model files (or the "
           "default) load on their first request", action="store_true",
           field="LifecycleConfig.preload", invert=True),
    # -- worker
    Option(("--die",), (WORKER,), "cpu (or cpu:N), a CUDA device number, or emu:INDEX[:SIZE] "
           "(an emulated CUDA die, for tests)", default="cpu", field="WorkerConfig.die"),
    Option(("--frontend",), (WORKER,), "the frontend's ZeroMQ address", default=s.WORKER_ADDR,
           field="WorkerConfig.frontend"),
    Option(("--slots",), (WORKER,), "default KV slots per model", int, s.SLOTS,
           field="WorkerConfig.slots"),
    Option(("--cores",), (WORKER,), "pin to these CPU cores, e.g. 0,1", core_list,
           field="WorkerConfig.cores"),
    Option(("--prefix-cache-mb",), (WORKER,), "host memory for KV states of idle conversations "
           "(0: off)", float, s.PREFIX_CACHE_MB, field="WorkerConfig.prefix_cache_bytes",
           convert=mib),
    Option(("--budget-mb",), (WORKER,), "memory models may use on this die (default: all of "
           "it)", float, field="WorkerConfig.budget_bytes", convert=mib),
    Option(("--parent-pid",), (WORKER,), "exit when this process (the spawning frontend) is "
           "gone", int, field="WorkerConfig.parent_pid", convert=lambda v: v or 0),
    Option(("--keys",), (WORKER,), "CURVE: a worker folder from `pantheon keys generate` "
           "(server.key, worker.key_secret; env PANTHEON_KEYS_DIR); required unless "
           "--insecure", env=s.keys_dir, metavar="DIR", field="WorkerConfig.keys"),
    Option(("--insecure",), (WORKER,), "connect to the frontend without keys, on loopback too: "
           "the worker obeys whatever process bound the address (warned)",
           action="store_true", field="WorkerConfig.insecure"),
    Option(("--stage-bind",), (WORKER,), "where a tcp stage link of a split replica binds when "
           "this worker holds its second stage: HOST is bound and advertised to the first "
           "stage's worker (0.0.0.0: every interface, advertising the address toward the "
           "frontend); default: that address, any free port", stage_bind,
           metavar="HOST[:PORT[-PORT]]", field="WorkerConfig.stage_bind"),
    Option(("--stage-bind",), (SERVE,), "the --stage-bind of the workers this server spawns: "
           "where a tcp stage link binds on the die holding a split replica's second stage "
           "(default: the worker's address toward this server, any free port)", stage_bind,
           metavar="HOST[:PORT[-PORT]]", field="ServeConfig.stage_bind"),
)


def of(command: str) -> list[Option]:
    return [o for o in OPTIONS if command in o.commands]


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """`command`'s flags, in the table's order."""
    for o in of(command):
        kw: dict[str, Any] = {"help": o.help}
        if o.action == "store_true":
            kw["action"] = "store_true"
        else:
            kw |= {"default": None if o.env else o.default, "metavar": o.metavar}
            if o.action:
                kw["action"] = o.action
            if o.type is not None:
                kw["type"] = o.type
            if o.choices is not None:
                kw["choices"] = o.choices
        parser.add_argument(*o.flags, **kw)


def resolve(args: argparse.Namespace, command: str) -> None:
    """Fill each flag not given from its environment variable (a bad one raises
    ValueError naming the variable)."""
    for o in of(command):
        if o.env is not None and getattr(args, o.dest, None) is None:
            setattr(args, o.dest, o.env())


def config(cls: type, args: argparse.Namespace, command: str, **derived):
    """`cls` built from the parsed flags whose options fill its fields, plus `derived` (the
    fields built from several flags, or from none)."""
    values = dict(derived)
    for o in of(command):
        if o.field is None or o.field.split(".")[0] != cls.__name__:
            continue
        value = getattr(args, o.dest)
        if o.invert:
            value = not value
        if o.convert is not None:
            value = o.convert(value)
        values[o.field.split(".")[1]] = value
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    return cls(**values)
