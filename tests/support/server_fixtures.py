"""Shared test fixtures for the frontend: a real byte-level BPE tokenizer built offline,
a scripted fake executor, and helpers that run a real server on 127.0.0.1
(`start_fake_server`: in this process, over the fake executor; `ServerProcess`: the
CLI in a subprocess).

The fake executor ("echo" model) makes output predictable, so text-level behaviour
(UTF-8 splits, stop strings across tokens) can be asserted exactly:
  * greedy (temperature 0): output token k is prompt token k (cyclically);
  * sampled: a seeded `random.Random` over the non-special ids;
  * a prompt containing `fail_token_id` fails that request in the "model step";
  * `fault_steps` (e.g. {10}) raises inside those steps (counting steps with work, as
    `EngineCore.num_steps` does): the whole step fails, as a fault in a real forward
    pass would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.outputs import KVCacheInfo, Logprobs, ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from server.common.lifecycle import ServerLimits

if TYPE_CHECKING:
    from server.http.api_server import APIServer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REPO = Path(__file__).resolve().parents[2]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Stop strings may span several tokens; the server must hold them back.",
    "你好，世界。今天天气很好。我们一起去公园散步吧。",
    "大型语言模型的推理服务需要高效的内存管理。",
    "Numbers 0123456789 and punctuation: ; , . ! ? ( ) [ ] { } < > = + - * /",
] * 20


def build_tokenizer_dir(path: Path, vocab_size: int = 700) -> Path:
    """Train a small byte-level BPE (GPT-2 style) and save it as an HF tokenizer dir.

    Common Chinese characters merge into whole-character tokens; emoji and rare
    characters stay split across byte tokens, which is what UTF-8 tests need.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


@dataclass
class _FakeRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    rng: random.Random
    output_token_ids: list[int] = field(default_factory=list)


class FakeExecutor:
    """An `Executor` that follows the scheduler's protocol but computes nothing."""

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        num_special_tokens: int = len(SPECIAL_TOKENS),
        num_blocks: int = 512,
        max_model_len: int | None = None,
        step_delay_s: float = 0.0,
        fail_token_id: int | None = None,
        fault_steps: Collection[int] = (),
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.num_special_tokens = num_special_tokens
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len or config.model_config.max_model_len or 256
        self.step_delay_s = step_delay_s
        self.fail_token_id = fail_token_id
        self.fault_steps = frozenset(fault_steps)
        self.num_steps = 0  # steps with work, numbered from 1
        self.requests: dict[str, _FakeRequest] = {}

    def initialize(self) -> KVCacheInfo:
        return KVCacheInfo(
            num_blocks=self.num_blocks,
            block_size=self.config.cache_config.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not scheduler_output.is_empty:
            self.num_steps += 1
            if self.num_steps in self.fault_steps:
                raise RuntimeError(f"injected fault in step {self.num_steps} (fault_steps)")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        computed_before: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            seed = new.sampling_params.seed
            self.requests[new.req_id] = _FakeRequest(
                list(new.prompt_token_ids), new.sampling_params, random.Random(seed)
            )
            computed_before[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            computed_before[req_id] = num_computed

        req_ids = list(scheduler_output.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[[] for _ in req_ids],
        )
        for index, req_id in enumerate(req_ids):
            request = self.requests[req_id]
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            done = computed_before[req_id] + scheduler_output.num_scheduled_tokens[req_id]
            if self.fail_token_id is not None and self.fail_token_id in request.prompt_token_ids:
                output.errors[req_id] = "fake model failure (fail_token_id in prompt)"
                continue
            if done < num_tokens:
                continue  # mid-prefill
            if not request.output_token_ids and request.params.prompt_logprobs is not None:
                output.prompt_logprobs[req_id] = self._logprob_rows(
                    request.prompt_token_ids[1:], request.params.prompt_logprobs)
            token_id = self._sample(request)
            request.output_token_ids.append(token_id)
            output.sampled_token_ids[index] = [token_id]
            if request.params.logprobs is not None:
                output.logprobs[req_id] = self._logprob_rows([token_id], request.params.logprobs)
        return output

    def _sample(self, request: _FakeRequest) -> int:
        if request.params.greedy:
            prompt = request.prompt_token_ids
            return prompt[len(request.output_token_ids) % len(prompt)]
        return request.rng.randrange(self.num_special_tokens, self.vocab_size)

    def _logprob_rows(self, token_ids: list[int], num_top: int) -> Logprobs:
        """Row per token: the token itself (rank 1, logprob -0.25), then top-N ids."""
        rows = Logprobs()
        for token_id in token_ids:
            top = [token_id] + [
                (token_id + j) % self.vocab_size for j in range(1, num_top)
            ]
            rows.token_ids.append([token_id] + top[:num_top])
            rows.logprobs.append([-0.25] + [-0.25 - j for j in range(len(top[:num_top]))])
            rows.ranks.append(1)
        return rows

    def shutdown(self) -> None:
        self.requests.clear()


# --------------------------------------------------------------------------- servers
class ServerThread:
    """Runs an `APIServer` (engine core in its own process) on a thread's event loop."""

    def __init__(self, server):
        self.server = server
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, timeout_s: float = 600.0) -> ServerThread:
        def main() -> None:
            async def run() -> None:
                try:
                    await self.server.start()
                except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
                    self._error = exc
                    self._ready.set()
                    return
                self._ready.set()
                await self.server.serve()

            asyncio.run(run())

        self._thread = threading.Thread(target=main, daemon=True, name="api-server")
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the server did not start in time")
        if self._error is not None:
            raise self._error
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start in time")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)


def build_fake_server(
    tokenizer_dir: Path,
    *,
    max_model_len: int = 256,
    api_key: str | None = None,
    served_model_name: str = "fake-echo",
    executor_kwargs: dict | None = None,
    max_num_seqs: int = 64,
    allowed_origins: list[str] | None = None,
    limits: ServerLimits | None = None,
    shutdown_timeout_s: float = 5.0,
    log_level: str = "warning",
    async_scheduling: bool = False,
) -> APIServer:
    """A real server (HTTP, AsyncEngine, core process) over the echo FakeExecutor."""
    from transformers import AutoTokenizer

    from engine.config import ModelConfig, SchedulerConfig
    from engine.executor.abstract import ExecutorSpec
    from server.http.api_server import APIServer, ServeOptions

    vocab_size = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    kwargs = {"vocab_size": vocab_size, **(executor_kwargs or {})}
    config = EngineConfig(
        model_config=ModelConfig(model=str(tokenizer_dir), max_model_len=max_model_len),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         async_scheduling=async_scheduling),
    )
    spec = ExecutorSpec(f"{FakeExecutor.__module__}:FakeExecutor", kwargs)
    options = ServeOptions(host="127.0.0.1", port=0, api_key=api_key, log_level=log_level,
                           allowed_origins=allowed_origins or [],
                           limits=limits or ServerLimits(),
                           shutdown_timeout_s=shutdown_timeout_s)
    return APIServer(options, config, tokenizer_dir, [served_model_name], executor_spec=spec)


def start_fake_server(tokenizer_dir: Path, **options) -> ServerThread:
    """`build_fake_server(tokenizer_dir, **options)`, started in this process."""
    return ServerThread(build_fake_server(tokenizer_dir, **options)).start()


def start_model_server(model_dir: str | Path, *args: str, name: str = "tiny") -> ServerThread:
    """A real model's server in this process (engine in a thread), from CLI flags
    (`--model model_dir --port 0` and `args`), serving it as `name`. The model is resolved
    as the CLI resolves it (a GGUF file becomes its converted directory)."""
    from engine.model_loader.source import resolve_model
    from server.http.api_server import APIServer, ServeOptions
    from server.http.cli import engine_config_from_args, make_arg_parser

    parsed = make_arg_parser().parse_args(
        ["--model", str(model_dir), "--port", "0", "--log-level", "warning", *args])
    resolved = str(resolve_model(parsed.model, mmproj=parsed.mmproj).path)
    options = ServeOptions.from_options(vars(parsed), engine_mode="thread")
    return ServerThread(APIServer(options, engine_config_from_args(parsed, resolved, name),
                                  resolved, [name])).start()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a socket a test binds
    itself, or hands to a program that cannot take port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoggedServerProcess:
    """A server in a subprocess, its merged stdout/stderr collected line by line.

    `wait_for_url()` returns the address the server logs once it listens.
    """

    # Generous: a start takes seconds, but on a busy machine it may first (re)build the
    # CPU kernels, or wait for another process's build of them (a shared build lock).
    START_TIMEOUT_S = 600.0

    def __init__(self, command: list[str], env: dict[str, str]):
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for_url(self, timeout_s: float | None = None) -> str:
        deadline = time.monotonic() + (timeout_s or self.START_TIMEOUT_S)
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(r" at (http://127\.0\.0\.1:\d+);", line)
                if match:
                    return match.group(1)
            if self.process.poll() is not None:
                raise RuntimeError("server exited:\n" + "\n".join(self.lines))
            time.sleep(0.05)
        raise TimeoutError("server did not start:\n" + "\n".join(self.lines))


def stop_process(process: subprocess.Popen, timeout_s: float,
                 stop_signal: int = signal.SIGTERM) -> None:
    """Send `stop_signal` to a running `process` and wait `timeout_s` for it to exit; kill
    it if it does not (then wait up to 10 s more)."""
    if process.poll() is not None:
        return
    process.send_signal(stop_signal)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


class ServerProcess(LoggedServerProcess):
    """`python -m server serve ...` in a subprocess; its log lines are collected."""

    def __init__(self, args: list[str], env: dict[str, str]):
        full_env = {**os.environ, **env}
        full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
        super().__init__([sys.executable, "-m", "server", "serve", *args], full_env)

    def stop(self) -> int:
        stop_process(self.process, 30, signal.SIGINT)
        self._reader.join(5)
        return self.process.returncode


@contextlib.contextmanager
def serving(proc: ServerProcess) -> Iterator[ServerProcess]:
    """Wait for `proc` to listen (`proc.url`), stopping it if it never does; on leaving,
    stop it and require a clean exit (status 0)."""
    try:
        proc.url = proc.wait_for_url()
    except BaseException:
        proc.stop()
        raise
    yield proc
    assert proc.stop() == 0, "\n".join(proc.lines[-30:])


# A chat template for the echo model under the API layers (Anthropic, Ollama, Responses):
# the prompt, and so the greedy answer up to EOS, is exactly what a test chose: system
# text as [sys:...], earlier turns' tool calls as name{arguments} and tool results as
# [call id:result], then the last message's content.
ECHO_CHAT_TEMPLATE = (
    "{% for m in messages[:-1] %}"
    "{% if m.role == 'system' %}[sys:{{ m.content }}]{% endif %}"
    "{% for c in m.tool_calls or [] %}"
    "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}:{{ m.content }}]{% endif %}{% endfor %}"
    "{{ messages[-1]['content'] }}<|im_end|>"
)


# In a message to the echo chat server, this text makes the fake model fail the request
# (its token, <|endoftext|>, is the executor's fail_token_id there).
FAIL_TEXT = "<|endoftext|>"


def start_echo_chat_server(tokenizer_dir: Path, **options) -> ServerThread:
    """The echo server with ECHO_CHAT_TEMPLATE, the hermes tool-call parser and the qwen3
    reasoning parser: a user message's text comes back as the answer, <think> blocks as
    reasoning and <tool_call> blocks as tool calls; a message with FAIL_TEXT fails in
    the model step."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = ECHO_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(tokenizer_dir))
    api_server = build_fake_server(tokenizer_dir, **{
        "max_model_len": 512, "executor_kwargs": {"fail_token_id": SPECIAL_TOKENS.index(FAIL_TEXT)},
        **options})
    api_server.options.tool_call_parser = "hermes"
    api_server.options.reasoning_parser = "qwen3"
    return ServerThread(api_server).start()
