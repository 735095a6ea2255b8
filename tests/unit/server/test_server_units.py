"""Server pieces without a running engine: CLI flags and environment variables,
error mapping, the catch-all error middleware, and the CLI's start-up failures."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.frontend.async_engine import EngineRequestError
from engine.frontend.core_client import EngineDeadError
from engine.frontend.processor import PromptError
from engine.sampling_params import SamplingParamsError
from server.common.errors import from_exception, install_error_handlers
from server.http.cli import (
    _build_cli_parser,
    engine_config_from_args,
    env_name,
    main,
    make_arg_parser,
)

REPO = Path(__file__).resolve().parents[3]

REQUIRED_FLAGS = [
    "--model", "--served-model-name", "--host", "--port", "--api-key", "--max-model-len",
    "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--kv-cache-memory",
    "--gpu-memory-utilization", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--dtype", "--device", "--attention-backend", "--allowed-origins", "--log-level", "--seed",
    "--quantization", "--cpu-threads", "--cpu-layout", "--cpu-turns", "--cpu-turns-share",
]


def parse(argv, monkeypatch=None, **env) -> argparse.Namespace:
    if monkeypatch is not None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    return make_arg_parser().parse_args(argv)


def test_every_flag_exists_with_help_and_env():
    parser = make_arg_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    for flag in REQUIRED_FLAGS:
        assert flag in options, flag
    help_text = parser.format_help()
    for flag in REQUIRED_FLAGS:
        if not flag.startswith("--no-"):
            assert env_name(flag) in help_text, flag


def test_defaults(monkeypatch):
    for flag in REQUIRED_FLAGS:
        monkeypatch.delenv(env_name(flag), raising=False)
    args = parse([])
    assert (args.model, args.host, args.port, args.api_key) == (None, "127.0.0.1", 8000, None)
    assert args.enable_prefix_caching is True and args.kv_cache_memory is None
    assert args.max_num_seqs == 128 and args.block_size == 16 and args.seed == 0


def test_environment_variables(monkeypatch):
    args = parse([], monkeypatch, PAGEDSERVE_MAX_NUM_SEQS="7", PAGEDSERVE_KV_CACHE_MEMORY="2G",
                 PAGEDSERVE_ENABLE_PREFIX_CACHING="0", PAGEDSERVE_API_KEY="k",
                 PAGEDSERVE_ALLOWED_ORIGINS='["http://a", "http://b"]',
                 PAGEDSERVE_SERVED_MODEL_NAME="x,y", PAGEDSERVE_DTYPE="float32")
    assert args.max_num_seqs == 7 and args.kv_cache_memory == 2 << 30
    assert args.enable_prefix_caching is False and args.api_key == "k"
    assert args.allowed_origins == ["http://a", "http://b"]
    assert args.served_model_name == ["x", "y"] and args.dtype == "float32"
    # The command line wins over the environment.
    args = make_arg_parser().parse_args(["--max-num-seqs", "9", "--enable-prefix-caching",
                                         "--allowed-origins", "http://c,http://d"])
    assert args.max_num_seqs == 9 and args.enable_prefix_caching is True
    assert args.allowed_origins == ["http://c", "http://d"]


def test_bad_values_are_reported_like_bad_flags(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "many")
    with pytest.raises(SystemExit) as info:
        make_arg_parser().parse_args([])
    assert info.value.code == 2
    assert "--max-num-seqs" in capsys.readouterr().err
    monkeypatch.delenv("PAGEDSERVE_MAX_NUM_SEQS")
    for argv in (["--kv-cache-memory", "lots"], ["--gpu-memory-utilization", "1.5"],
                 ["--dtype", "int3"], ["--max-num-seqs", "0"]):
        with pytest.raises(SystemExit):
            make_arg_parser().parse_args(argv)


def test_engine_config_from_args():
    args = make_arg_parser().parse_args([
        "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
        "--block-size", "32", "--kv-cache-memory", "64M", "--no-enable-prefix-caching",
        "--dtype", "bfloat16", "--device", "cpu", "--attention-backend", "torch", "--seed", "3",
        "--scheduling-policy", "priority", "--num-gpu-blocks-override", "100"])
    config = engine_config_from_args(args, "/models/m", "m")
    assert config.model_config.model == "/models/m"
    assert config.model_config.max_model_len == 512 and config.model_config.seed == 3
    assert config.model_config.dtype == "bfloat16"
    assert config.scheduler_config.max_num_seqs == 4
    assert config.scheduler_config.max_num_batched_tokens == 256
    assert config.scheduler_config.policy == "priority"
    assert config.cache_config.block_size == 32
    assert config.cache_config.kv_cache_memory_bytes == 64 << 20
    assert config.cache_config.enable_prefix_caching is False
    assert config.cache_config.num_gpu_blocks_override == 100
    assert config.device_config.device == "cpu"
    assert config.device_config.attention_backend == "torch"


def test_cli_help_and_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "PAGEDSERVE_MAX_NUM_SEQS" in out
    assert main([]) == 2
    # `bench serve` runs the benchmark as its own program (python -m benchmarks.serve).
    result = run_cli("bench", "serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--base-url" in result.stdout
    assert "bench" in _build_cli_parser().format_help()


def run_cli(*args: str, env: dict | None = None, timeout: float = 120):
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_model_source_error_is_one_line(tmp_path):
    result = run_cli("serve", "--model", str(tmp_path / "no-such-model"), "--port", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "no-such-model" in lines[0]


# ------------------------------------------------------------------------- errors
def test_exception_mapping():
    cases = [
        (SamplingParamsError("bad temp", "temperature"), 400, "temperature"),
        (PromptError("too long", "max_tokens", "context_length_exceeded"), 400, "max_tokens"),
        (EngineRequestError("boom"), 500, None),
        (EngineDeadError("gone"), 503, None),
        (RuntimeError("unexpected"), 500, None),
    ]
    for exc, status, param in cases:
        error = from_exception(exc)
        assert (error.status_code, error.param) == (status, param)
        body = error.to_response_model().model_dump()
        assert set(body["error"]) == {"message", "type", "param", "code"}


def test_unexpected_exception_is_a_500_error_object():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    with TestClient(app) as client:
        response = client.get("/boom")
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert "kaput" in response.json()["error"]["message"]
        assert client.get("/fine").json() == {"ok": True}
        missing = client.get("/nowhere")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        wrong_method = client.post("/fine")
        assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_split_cpus_keeps_the_first_cpu_for_the_frontend():
    from engine.cpu_info import split_cpus

    assert split_cpus((0, 1, 2, 3)) == ((0,), (1, 2, 3))
    assert split_cpus((4, 7)) == ((4,), (7,))
    assert split_cpus((3,)) == ((3,), (3,))  # one CPU: both share it


@pytest.mark.parametrize("char", ["\u0085", "\u2028", "\u2029"])
def test_sse_events_survive_clients_that_split_on_unicode_line_breaks(char):
    """httpx's iter_lines (str.splitlines) breaks lines at U+0085/U+2028/U+2029, which JSON
    leaves raw: a token holding one cut a streamed event in two (seen in a test run)."""
    import json

    from server.common.streaming import sse

    payload = {"delta": {"content": f"a{char}b é"}}
    event = sse(json.dumps(payload, ensure_ascii=False))
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == payload
    assert "é" in event  # other non-ASCII text stays as it is


# Every kind of character a chunk template must escape as pydantic does: controls,
# quotes, backslashes, non-ASCII, line separators, emoji.
CHUNK_TEXTS = ["", "hello", ' "quoted" \\ back', "tab\tnl\ncr\r\x00\x1f\x7f", "é中😀",
               "\u2028\u2029\u0085", "".join(chr(c) for c in range(0, 0x300))]


def test_completion_text_chunk_equals_the_pydantic_chunk():
    """The template behind nearly every streamed completion chunk writes exactly what
    CompletionStreamResponse writes, for every kind of character (controls, quotes,
    backslashes, non-ASCII, line separators, emoji) and odd ids/model names."""
    from server.apis.openai.completions import CompletionChunkWriter
    from server.common.protocol import CompletionStreamChoice

    for request_id, model in [("cmpl-1", "m"), ('cmpl-"x"', "org/模型\\v1")]:
        writer = CompletionChunkWriter(request_id, 1_700_000_000, model)
        for index in (0, 7):
            for text in CHUNK_TEXTS:
                assert writer.text(index, text) == writer.choice(
                    CompletionStreamChoice(index=index, text=text))


def test_chat_content_chunk_equals_the_pydantic_chunk():
    """The chat template writes exactly what ChatCompletionStreamResponse writes."""
    from server.apis.openai.chat import ChatChunkWriter
    from server.common.protocol import ChatCompletionStreamChoice, DeltaMessage

    for request_id, model in [("chatcmpl-1", "m"), ('chatcmpl-"x"', "org/模型\\v1")]:
        writer = ChatChunkWriter(request_id, 1_700_000_000, model)
        for index in (0, 3):
            for text in CHUNK_TEXTS:
                assert writer.content(index, text) == writer.choices(
                    [ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text))])
