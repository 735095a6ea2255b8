"""Every README example a user can paste runs against a live default-model server, as
written, and ends in seconds with an answer that is not an error.

The server is the CLI with no --model (the default model, at its default dtype) on a free
port; examples name 127.0.0.1:8000, which is rewritten to that port and nothing else.
Shell blocks that call curl run in bash, whole; Python blocks run in README order in one
interpreter (as a reader running them top to bottom would: later blocks use the `client`
an earlier one made). Blocks that install, build or start something (make, pip, docker,
kubectl, `pagedserve serve`) are not examples to run here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.server_fixtures import ServerProcess, serving

ROOT = Path(__file__).resolve().parents[2]
README_URL = "127.0.0.1:8000"
SECONDS_PER_EXAMPLE = 60
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def readme_blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [body for lang, body in FENCE.findall(text) if lang == language]


def curl_blocks() -> list[str]:
    return [block for block in readme_blocks("bash") if "curl " in block]


@pytest.fixture(scope="module")
def server():
    from engine.model_loader.source import ModelSourceError, resolve_model

    try:
        resolve_model(None)
    except ModelSourceError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    # 512M: the default 8192-token context in float32 (--dtype auto on a CPU without
    # avx512_bf16) takes 360 MiB of SmolLM2's KV; bfloat16 half of it.
    proc = ServerProcess(["--port", "0", "--kv-cache-memory", "512M"], env={})
    with serving(proc):
        yield proc


def test_the_readme_has_examples_to_run():
    assert len(curl_blocks()) >= 3 and len(readme_blocks("python")) >= 3


@pytest.mark.parametrize("index", range(len(curl_blocks())))
def test_curl_example(server, index):
    block = curl_blocks()[index]
    script = "set -euo pipefail\n" + block.replace(README_URL, server.url.removeprefix("http://"))
    num_calls = block.count("curl ")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                            timeout=SECONDS_PER_EXAMPLE * num_calls)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.strip(), "no answer"
    values = json_values(out)
    assert len(values) >= num_calls, out[:2000]  # each call answered (a stream: its chunks)
    errors = [v for v in values if isinstance(v, dict)
              and (v.get("error") is not None or v.get("type") == "error")]
    assert not errors, errors


def json_values(text: str) -> list:
    """The JSON values in curl's output: answers back to back, SSE `data:` lines, [DONE]."""
    text = re.sub(r"data: (\[DONE\])?", " ", text)  # a stream may follow an answer's "}"
    decoder, values, position = json.JSONDecoder(), [], 0
    while (position := len(text) - len(text[position:].lstrip())) < len(text):
        value, position = decoder.raw_decode(text, position)
        values.append(value)
    return values


def test_python_examples(server, tmp_path):
    """Each block is timed on its own; all must finish within the limit each."""
    blocks = [block.replace(f"http://{README_URL}", server.url) for block in
              readme_blocks("python")]
    driver = tmp_path / "run_examples.py"
    driver.write_text(textwrap.dedent('''
        import json, sys, time
        blocks = json.load(open(sys.argv[1]))
        namespace = {}
        for block in blocks:
            started = time.perf_counter()
            exec(compile(block, "<README block>", "exec"), namespace)
            print("BLOCK-SECONDS", time.perf_counter() - started, flush=True)
    '''))
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    result = subprocess.run([sys.executable, str(driver), str(tmp_path / "blocks.json")],
                            capture_output=True, text=True, cwd=ROOT,
                            timeout=SECONDS_PER_EXAMPLE * len(blocks))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    seconds = [float(line.split()[1]) for line in result.stdout.splitlines()
               if line.startswith("BLOCK-SECONDS")]
    assert len(seconds) == len(blocks)
    assert max(seconds) < SECONDS_PER_EXAMPLE, seconds
    printed = [line for line in result.stdout.splitlines()
               if line.strip() and not line.startswith("BLOCK-SECONDS")]
    assert len(printed) >= len(blocks), result.stdout  # each block printed its answer
