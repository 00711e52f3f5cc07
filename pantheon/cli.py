"""The `pantheon` command: subcommands dispatched to the side that owns them.

Each subcommand imports only its own side (frontend or worker), so starting
a frontend never imports the forward and a worker never imports Starlette.
"""
from __future__ import annotations

import argparse
import logging
import sys

from pantheon.common import settings


def model_path(arg: str | None):
    from pantheon.common.default_model import default_model_path
    return arg or str(default_model_path(log=lambda m: print(m, file=sys.stderr)))


def cmd_models(args) -> int:
    from pantheon.common.default_model import FetchError, fetch_default
    try:
        print(fetch_default(log=lambda m: print(m, file=sys.stderr)))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_run(args) -> int:
    from pantheon.worker.run import run_chat
    from pantheon.worker.sampler import SamplingParams
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed)
    run_chat(model_path(args.model), args.prompt, system=args.system,
             max_tokens=args.max_tokens, params=params)
    return 0


def cmd_bench(args) -> int:
    if args.bench == "engine":
        from pantheon.bench.engine import main
        args.model = model_path(args.model)
        return main(args)
    raise SystemExit(f"unknown benchmark {args.bench}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pantheon", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser("fetch-default", help="fetch the embedded default model into the cache")
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
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    engine = bench_sub.add_parser("engine", help="in-process forward speed, as JSON")
    engine.add_argument("-m", "--model")
    engine.add_argument("--die", default="cpu", help="cpu or a CUDA device number")
    engine.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
