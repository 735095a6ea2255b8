"""Start-up and shutdown of one server: socket, tokenizer, engine, app, uvicorn.

    APIServer.start():  bind the socket (fail fast if the port is taken), load the
                        tokenizer and EOS ids (load_model_resources) while the engine
                        core starts (its own process), build the app
    APIServer.serve():  run uvicorn on the bound socket until asked to stop, then shut
                        the engine down

Stopping (SIGTERM or SIGINT in the main thread, or `request_stop()` from anywhere):
/health and every new request get 503 at once while the listener stays open; the
requests in flight get up to `shutdown_timeout_s` to finish, then the rest are aborted
(finish_reason "abort"); then uvicorn closes its connections, the engine core process
is stopped and joined, and `serve()` returns (the CLI exits 0). A second signal skips
the wait. uvicorn's own signal handling is replaced: it would re-raise the signal after
its shutdown and kill the process with it.

One of several API server processes (`serve --api-server-count N`, server/http/launcher.py):
the same class, given the launcher's listening socket and a `SharedCoreLink` instead of
binding one and starting a core; it then leaves signals to the launcher (which asks it
to stop with `request_stop`), records metrics in multiprocess mode, and says which API
server answered in an `x-pagedserve-api-server` header.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import anyio
import uvicorn

from engine.config import (
    Declared,
    EngineConfig,
    Option,
    declared_options,
    from_options,
    option,
    positive_int,
    seconds,
)
from engine.executor.abstract import ExecutorSpec
from engine.frontend.async_engine import HEALTH_PING_TIMEOUT_S, HEALTH_STEP_TIMEOUT_S, AsyncEngine
from engine.frontend.core_client import DEFAULT_STARTUP_TIMEOUT_S, start_async_client
from engine.frontend.shared_core_client import AsyncSharedCoreClient
from engine.ipc import SharedCoreLink
from engine.model_loader.chat_templates import content_format
from engine.model_loader.pooling_config import (
    embedding_size_of,
    is_cross_encoder,
    model_runner_kind,
    pairs_as_one_text,
    read_embedding_prompts,
)
from engine.model_loader.resources import load_model_resources
from engine.multimodal.processor import ImagePromptProcessor
from engine.sampling_defaults import SamplingDefaults, resolve_sampling_defaults
from server.chat.reasoning import REASONING_PARSERS
from server.chat.tool_parsers import TOOL_CALL_PARSERS, parser_for_model_type
from server.common.lifecycle import ServerLimits
from server.common.lora import (
    LoRAAdapters,
    lora_modules_list,
    parse_lora_module,
    runtime_updating_allowed,
)
from server.common.metrics import ServerMetrics
from server.common.state import ServerState, XrayOptions
from server.http.app import build_app

logger = logging.getLogger("pagedserve")


def origins_list(text: str) -> list[str]:
    """--allowed-origins: a JSON list ('["http://a", "http://b"]') or a comma-separated list."""
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


@dataclass
class ServeOptions:
    """How one server serves: the `pagedserve serve` flags that are not the engine's
    (declared here, on ServerLimits and in XRAY_OPTIONS; see engine/config.py `option`)."""

    host: str = option("127.0.0.1", "--host", "Address to listen on.", group="server")
    port: int = option(  # 0: any free port (see APIServer.url)
        8000, "--port", "Port to listen on (0: any free port; the start-up log line says "
        "which).", group="server", type=int)
    api_server_count: int = option(  # > 1: server/http/launcher.py
        1, "--api-server-count", "HTTP frontend processes (API servers) serving the one "
        "--port, all over one engine core, for when a single frontend's tokenization, "
        "detokenization and streaming are the limit (vLLM's flag; see "
        "server/http/launcher.py).", group="server", type=positive_int)
    api_key: str | None = option(
        None, "--api-key", "Require 'Authorization: Bearer <key>' (or 'x-api-key: <key>', "
        "Anthropic's header) on the inference routes (/v1/*, /api/* but /api/version, "
        "/tokenize, /detokenize, /get_load) and on /xray; /health, /metrics and /version stay "
        "open.",
        group="server")
    allowed_origins: list[str] = option(
        None, "--allowed-origins", "CORS origins allowed to call the API: a JSON list or a "
        "comma-separated list (e.g. '[\"*\"]'). Default: none (no CORS headers).",
        group="server", type=origins_list, default_factory=list)
    metrics_names: str = option(
        "both", "--metrics-names", "Names on /metrics: 'pagedserve' (pagedserve:*), 'vllm' "
        "(the families vLLM has, as vllm:*, for routers and dashboards built for vLLM: "
        "num_requests_waiting, kv_cache_usage_perc, cache_config_info, lora_requests_info, "
        "...), or 'both'.", group="observability", choices=("both", "pagedserve", "vllm"))
    lora_modules: list[str] = option(
        None, "--lora-modules", "LoRA adapters to serve (with --enable-lora), each under its "
        "own model name: name=path entries separated by spaces ('sql=/a/sql chat=/a/chat'), "
        "vLLM's JSON object '{\"name\": \"chat\", \"path\": \"/a/chat\"}', or a JSON "
        "list of either.", group="lora", type=lora_modules_list, default_factory=list)
    allow_runtime_lora_updating: bool = option(
        False, "--allow-runtime-lora-updating", "Serve POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, "
        "vLLM's switch).", group="lora")
    log_level: str = option("info", "--log-level", "Log level.", group="observability",
                            choices=("debug", "info", "warning", "error"))
    engine_mode: Literal["process", "thread"] = "process"
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    shutdown_timeout_s: float = option(  # drain: how long in-flight requests may still run
        5.0, "--shutdown-timeout", "On SIGTERM/SIGINT: refuse new requests (503) and let the "
        "in-flight ones finish for up to this many seconds, then abort the rest and exit.",
        group="server", type=seconds)
    limits: ServerLimits = field(default_factory=ServerLimits)
    health_ping_timeout_s: float = HEALTH_PING_TIMEOUT_S
    health_step_timeout_s: float = HEALTH_STEP_TIMEOUT_S
    xray: XrayOptions = field(default_factory=XrayOptions)
    # Chat: tool calls and reasoning (server/chat/tools.py, server/chat/reasoning.py).
    # "auto": by the model's family (server/chat/tool_parsers.py); "none": no parser.
    tool_call_parser: str = option(
        "auto", "--tool-call-parser", "How tool_choice 'auto' finds tool calls in the output: "
        "'hermes' (<tool_call> JSON, Qwen2/Qwen3), 'llama3_json' (Llama 3 JSON calls), "
        "'mistral' ([TOOL_CALLS] and a JSON list), 'phi4_mini_json' (<|tool_call|> and a "
        "JSON list, Phi-4-mini), 'pythonic' ([f(a=1)], Gemma 3), 'auto' (by the model's "
        "family: hermes for Qwen, llama3_json for Llama, mistral for Mistral, "
        "phi4_mini_json for Phi-3/4, pythonic for Gemma 3), or 'none' (tool_choice 'auto' "
        "is refused; 'required' and named functions always work).", group="server",
        choices=("auto", *TOOL_CALL_PARSERS, "none"))
    reasoning_parser: str | None = option(
        None, "--reasoning-parser", "Split a thinking model's output: 'qwen3' sends the text "
        "between <think> and </think> as reasoning_content (Qwen3, Phi-4 reasoning), "
        "'mistral' the text between [THINK] and [/THINK] (Magistral). Default: none.",
        group="server", choices=tuple(REASONING_PARSERS))

    @classmethod
    def from_options(cls, values: Mapping[str, Any], **fields: Any) -> ServeOptions:
        """ServeOptions with its limits and x-ray options from the option values in
        `values` (by name, as `serve_options()` lists them), the rest at their defaults."""
        limits = from_options(ServerLimits, values)
        # A negative --responses-store-size keeps no responses, as 0 does.
        limits = replace(limits, responses_store_size=max(0, limits.responses_store_size))
        return from_options(cls, values, limits=limits,
                            xray=from_options(XrayOptions, values, XRAY_OPTIONS), **fields)


# --xray and --xray-show-text set XrayOptions' fields (server/common/state.py).
XRAY_OPTIONS = [
    Declared("xray", "enabled", XrayOptions.enabled, Option(
        "Serve the engine x-ray: GET /xray, a live page of the scheduler, the KV block pool "
        "and the prefix cache, and GET /xray/state, its JSON (default: on; --no-xray removes "
        "both).", "observability", "--xray", negatable=True)),
    Declared("xray_show_text", "show_text", XrayOptions.show_text, Option(
        "Show prompt and output text on /xray (default: token counts, block ids and hashes "
        "only).", "observability", "--xray-show-text")),
]


def serve_options() -> list[Declared]:
    """Every option of the server besides the engine's (the CLI's other flags)."""
    return [*declared_options(ServeOptions), *declared_options(ServerLimits), *XRAY_OPTIONS]


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers (APIServer.serve installs its own)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


def resolve_tool_call_parser(name: str, model_dir: str | Path) -> str | None:
    """--tool-call-parser: "auto" picks by config.json's model_type; "none" is None."""
    if name == "none":
        return None
    if name != "auto":
        return name
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    return parser_for_model_type(model_type)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose
    # proto says TCP. Without it a response written in two parts (head, then body) waits
    # for the client's delayed ACK: +40 ms on every JSON answer.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def _warm_up() -> None:
    """Keep start-up costs off the requests' event loop.

    * Import now what the first requests would import lazily: anyio's asyncio backend
      (Starlette's streaming responses use its task groups) blocks the loop for 0.2-0.7 s.
    * When the server owns the process (it runs in the main thread: the CLI), freeze the
      start-up heap (torch, transformers, the tokenizer: some 300k objects) out of the
      garbage collector's reach: otherwise every full collection walks all of it,
      100-400 ms with the loop blocked, and a burst of requests triggers several.
      `serve()` unfreezes it when it ends.
    """
    async with anyio.create_task_group():
        pass
    if threading.current_thread() is threading.main_thread():
        gc.collect()
        gc.freeze()


API_SERVER_HEADER = b"x-pagedserve-api-server"


class APIServerHeader:
    """ASGI middleware: every response says which API server process answered it."""

    def __init__(self, app, index: int):
        self.app = app
        self.value = str(index).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (API_SERVER_HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class APIServer:
    def __init__(
        self,
        options: ServeOptions,
        engine_config: EngineConfig,
        model_dir: str | Path,
        served_model_names: list[str],
        executor_spec: ExecutorSpec | None = None,
        *,
        shared_core: SharedCoreLink | None = None,
        sock: socket.socket | None = None,
    ):
        """`shared_core` and `sock`: one of several API server processes (module doc)."""
        self.options = options
        self.engine_config = engine_config
        self.model_dir = str(model_dir)
        self.served_model_names = served_model_names
        self.executor_spec = executor_spec
        self.shared_core = shared_core
        self._given_socket = sock
        self.state: ServerState | None = None
        self.socket: socket.socket | None = None
        self._uvicorn: uvicorn.Server | None = None
        # Stopping (see the module doc): the serving loop, its stop event, and whether a
        # stop was asked for (before serve() started, too) or forced by a second signal.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._force = False

    @property
    def url(self) -> str:
        assert self.socket is not None, "start() first"
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def _lora_adapters(self, options: ServeOptions) -> LoRAAdapters | None:
        """--enable-lora: the --lora-modules adapters, each checked against the base (a
        bad one stops the start with its reason)."""
        lora = self.engine_config.lora_config
        if not lora.enable_lora:
            if options.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(self.model_dir).get_text_config()
        adapters = LoRAAdapters(hf_config, lora.max_lora_rank, self.served_model_names)
        for module in options.lora_modules:
            spec = parse_lora_module(module)
            adapters.add(spec["name"], spec["path"])
        return adapters

    def sampling_defaults(self, generation_config: dict[str, Any]) -> SamplingDefaults:
        """This server's sampling defaults (logged once; the model's generation config
        read by load_model_resources)."""
        model = self.engine_config.model_config
        defaults = resolve_sampling_defaults(
            model.generation_config, generation_config, model.override_generation_config,
            model.max_tokens_default,
            model_source=str(Path(self.model_dir) / "generation_config.json"))
        logger.info("%s", defaults.describe())
        return defaults

    async def start(self) -> None:
        """Bind, load, start the engine. Raises OSError / EngineStartupError."""
        options = self.options
        self.socket = self._given_socket or bind_socket(options.host, options.port)
        try:
            # The tokenizer and EOS ids load in a thread while the engine core starts.
            resources_load = asyncio.ensure_future(
                asyncio.to_thread(load_model_resources, self.model_dir,
                                  self.engine_config.model_config.chat_template,
                                  self.engine_config.model_config.hf_overrides))
            try:
                if self.shared_core is not None:
                    client = await AsyncSharedCoreClient.start(self.shared_core,
                                                               options.startup_timeout_s)
                else:
                    client = await start_async_client(
                        self.engine_config, self.executor_spec, options.engine_mode,
                        options.startup_timeout_s, options.log_level)
            except BaseException:
                resources_load.cancel()
                raise
            try:
                resources = await resources_load
                sampling_defaults = self.sampling_defaults(resources.generation_config)
                logger.info("chat template: %s", resources.chat_template_source)
            except BaseException:
                client.shutdown()
                raise
            lora_config = self.engine_config.lora_config
            metrics = ServerMetrics(self.served_model_names[0],
                                    multiprocess=self.shared_core is not None,
                                    names=options.metrics_names,
                                    max_loras=lora_config.max_loras if lora_config.enable_lora
                                    else 0)
            engine = AsyncEngine.from_client(client, resources.tokenizer,
                                             eos_token_id=resources.eos_token_id,
                                             observer=metrics)
        except BaseException:
            self.socket.close()
            raise
        metrics.set_cache_config(self.engine_config.cache_config, engine.kv_cache_info)
        embedding_size = embedding_size_of(self.model_dir)
        hf_overrides = self.engine_config.model_config.hf_overrides
        self.state = ServerState(
            engine=engine, tokenizer=resources.tokenizer,
            served_model_names=self.served_model_names, model_root=self.model_dir, metrics=metrics, api_key=options.api_key,
            scheduling_policy=self.engine_config.scheduler_config.policy,
            max_running_requests=self.engine_config.scheduler_config.max_num_seqs,
            extra_stop_token_ids=resources.extra_stop_token_ids,
            sampling_defaults=sampling_defaults, limits=options.limits,
            chat_template_source=resources.chat_template_source,
            chat_content_format=content_format(
                resources.chat_template,
                self.engine_config.model_config.chat_template_content_format),
            health_ping_timeout_s=options.health_ping_timeout_s,
            health_step_timeout_s=options.health_step_timeout_s, xray=options.xray,
            tool_call_parser=resolve_tool_call_parser(options.tool_call_parser, self.model_dir),
            reasoning_parser=options.reasoning_parser,
            runner=model_runner_kind(self.model_dir, self.engine_config.model_config.runner,
                                     hf_overrides),
            pooling=resources.pooling,
            embedding_size=embedding_size[0], matryoshka=embedding_size[1],
            cross_encoder=is_cross_encoder(self.model_dir, hf_overrides),
            embedding_prompts=read_embedding_prompts(self.model_dir),
            pairs_as_one_text=pairs_as_one_text(self.model_dir, hf_overrides),
            lora=self._lora_adapters(options),
            lora_runtime_updating=runtime_updating_allowed(options.allow_runtime_lora_updating),
            image_processor=ImagePromptProcessor.for_model(
                self.model_dir, options.limits.mm_processor_cache_bytes),
        )
        app = build_app(self.state, options.allowed_origins)
        if self.shared_core is not None:
            app.add_middleware(APIServerHeader, index=self.shared_core.client_index)
        await _warm_up()
        host, port = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app, host=host, port=port, log_config=None, access_log=False,
            log_level=options.log_level.lower(), lifespan="off",
            # The drain already waited for the requests; this only closes connections.
            timeout_graceful_shutdown=1,
            # h11 (pure Python) enforces a limit on the request head; httptools has none.
            http="h11", h11_max_incomplete_event_size=options.limits.max_header_bytes,
        )
        self._uvicorn = _Uvicorn(config)
        kv = engine.kv_cache_info
        if self.shared_core is not None:  # the launcher says "serving ... at <url>;"
            logger.info("API server %d (pid %d) ready on %s; max_model_len=%d, KV cache %d "
                        "blocks x %d tokens", self.shared_core.client_index, os.getpid(),
                        self.url, kv.max_model_len, kv.num_blocks, kv.block_size)
            return
        logger.info(
            "serving %s (%s) at %s; max_model_len=%d, KV cache %d blocks x %d tokens",
            ", ".join(self.served_model_names), self.model_dir, self.url, kv.max_model_len,
            kv.num_blocks, kv.block_size)

    async def serve(self) -> None:
        """Serve until `request_stop()` (or SIGINT/SIGTERM in the main thread), drain,
        stop the engine."""
        assert self._uvicorn is not None and self.state is not None, "start() first"
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        signals = []
        # SIGTERM/SIGINT handlers (main thread only); the launcher's API servers leave
        # signals to the launcher.
        if self.shared_core is None and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
                signals.append(sig)
        serving = loop.create_task(self._uvicorn.serve(sockets=[self.socket]))
        stopping = loop.create_task(self._stop.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                await self.state.lifecycle.drain(
                    0.0 if self._force else self.options.shutdown_timeout_s)
                self._uvicorn.should_exit = True
            await serving
        finally:
            stopping.cancel()
            try:
                await self.state.engine.shutdown()
                self.socket.close()
            finally:
                for sig in signals:  # kept until here: a signal must not cut the clean-up
                    loop.remove_signal_handler(sig)
                gc.unfreeze()
            logger.info("server stopped")

    async def run(self) -> None:
        await self.start()
        await self.serve()

    def _on_signal(self, sig: int) -> None:
        self._on_stop_request(f"received {signal.Signals(sig).name}")

    def _on_stop_request(self, what: str) -> None:
        """The first request drains, a second one aborts what is left at once."""
        if self._stop_requested:
            logger.warning("%s again: aborting the remaining requests now", what)
            self._force = True
            self.state.lifecycle.draining = True
            for active in list(self.state.lifecycle.active):
                active.abort("shutdown")
            return
        logger.info("%s: shutting down (drain up to %.1f s)", what,
                    self.options.shutdown_timeout_s)
        self._begin_stop()

    def _begin_stop(self) -> None:
        self._stop_requested = True
        if self.state is not None:
            self.state.lifecycle.draining = True  # 503 from now on, not from the next tick
        if self._stop is not None:
            self._stop.set()

    def request_stop(self, reason: str | None = None) -> None:
        """Start the graceful shutdown (as SIGTERM does); safe from any thread.

        With a `reason` (logged), it acts like a signal: asked again, the requests
        still in flight are aborted at once."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stop_requested = True
            return
        try:
            if reason is None:
                loop.call_soon_threadsafe(self._begin_stop)
            else:
                loop.call_soon_threadsafe(self._on_stop_request, reason)
        except RuntimeError:  # the loop just closed
            pass

    @property
    def started(self) -> bool:
        return self._uvicorn is not None and self._uvicorn.started
