"""The server with a real (tiny, random) Llama checkpoint, started through the CLI
(`python -m server serve ...` in a subprocess), driven by the `openai` client.

Flags come partly from PAGEDSERVE_* environment variables, so the env mapping is
checked end to end. Random weights produce arbitrary tokens; requests bias the
sampler towards printable ASCII tokens (logit_bias) where text matters.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.model_fixtures import build_tiny_checkpoint, build_tiny_tokenizer
from tests.support.server_fixtures import ServerProcess, serving

API_KEY = "model-test-key"
MAX_MODEL_LEN = 200


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = ServerProcess(
        ["--model", str(checkpoint), "--port", "0", "--kv-cache-memory", "32M",
         "--served-model-name", "tiny", "tiny-alias"],
        env={"PAGEDSERVE_API_KEY": API_KEY, "PAGEDSERVE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
             "PAGEDSERVE_MAX_NUM_SEQS": "32", "PAGEDSERVE_LOG_LEVEL": "info"})
    with serving(proc):
        yield proc
    assert any("server stopped" in line for line in proc.lines)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def ascii_bias() -> dict[str, int]:
    """Forbid tokens that are not printable ASCII (or are beyond the tokenizer)."""
    tokenizer = build_tiny_tokenizer()
    bias = {}
    for token_id in range(512):
        text = tokenizer.decode([token_id]) if token_id < len(tokenizer) else ""
        special = token_id in tokenizer.all_special_ids
        if special or not text or not all(32 <= ord(c) < 127 for c in text):
            bias[str(token_id)] = -100
    return bias


def test_env_flags_and_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN  # from the env
    result = client.completions.create(model="tiny-alias", prompt="Hello", max_tokens=2)
    assert result.model == "tiny"
    assert httpx.get(server.url + "/v1/models").status_code == 401  # key from the env
    assert httpx.get(server.url + "/health").status_code == 200


def test_greedy_stream_matches_non_stream(client, ascii_bias):
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0,
                  logit_bias=ascii_bias, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert full.usage.completion_tokens == 24
    text = full.choices[0].text
    assert text and text.isascii()
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == text
    chat_kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Say something"}],
                       max_tokens=16, temperature=0, logit_bias=ascii_bias)
    message = client.chat.completions.create(**chat_kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **chat_kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message


def test_logit_bias_forces_a_token(client):
    tokenizer = build_tiny_tokenizer()
    token_id = tokenizer.encode("fox")[0]
    result = client.completions.create(model="tiny", prompt="a b c", max_tokens=4,
                                       temperature=0, logit_bias={str(token_id): 100})
    assert result.choices[0].text == tokenizer.decode([token_id] * 4)


def test_stop_string_across_token_boundary(client, ascii_bias):
    """Find two adjacent output tokens, stop on a string spanning them."""
    kwargs = dict(model="tiny", max_tokens=40, temperature=0, logit_bias=ascii_bias,
                  extra_body={"ignore_eos": True})
    for prompt in ("Hello world", "Paged attention", "One two three", "def forward"):
        result = client.completions.create(prompt=prompt, logprobs=0, **kwargs)
        text, tokens = result.choices[0].text, result.choices[0].logprobs.tokens
        assert "".join(tokens) == text
        offset = 0
        for left, right in zip(tokens, tokens[1:], strict=False):
            offset += len(left)
            stop = left[-2:] + right[:2]
            if len(left) >= 1 and len(right) >= 1 and text.find(stop) == offset - len(left[-2:]):
                break
        else:
            continue
        expected = text[:text.find(stop)]
        stopped = client.completions.create(prompt=prompt, stop=stop, **kwargs).choices[0]
        assert stopped.text == expected and stopped.finish_reason == "stop"
        pieces = [c.choices[0].text
                  for c in client.completions.create(prompt=prompt, stop=stop, stream=True,
                                                     **kwargs)]
        assert "".join(pieces) == expected
        return
    pytest.fail("no output had two adjacent tokens to stop across")


def test_logprobs_are_real(client):
    result = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6,
                                       temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_logprob <= 0
        values = list(top.values())
        # Greedy: the chosen token is the most likely one.
        assert abs(max(values) - token_logprob) < 1e-4
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3)
    for entry in chat.choices[0].logprobs.content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert abs(tops[0] - entry.logprob) < 1e-4
    echoed = client.completions.create(model="tiny", prompt="Hello world again", max_tokens=1,
                                       temperature=0, logprobs=1, echo=True)
    lp = echoed.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def test_n_with_seed(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3,
                  seed=7, extra_body={"ignore_eos": True})
    first = sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)
    second = sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)
    assert [c.text for c in first] == [c.text for c in second]
    assert len({c.text for c in first}) == 3


def test_same_greedy_text_alone_and_among_16(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as aclient:
            probe = dict(model="tiny", prompt="Continuous batching schedules requests",
                         max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
            alone = (await aclient.completions.create(**probe)).choices[0]
            others = [aclient.completions.create(
                model="tiny", prompt=f"Another prompt number {i} " * (1 + i % 4),
                max_tokens=10 + i, temperature=0.8, seed=i) for i in range(16)]
            together = await asyncio.gather(aclient.completions.create(**probe), *others)
            assert together[0].choices[0].text == alone.text
            assert all(r.choices[0].finish_reason in ("stop", "length") for r in together)

    asyncio.run(main())


def test_errors_then_good_request(client, server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    too_long = httpx.post(server.url + "/v1/completions", headers=headers,
                          json={"model": "tiny", "prompt": "x", "max_tokens": MAX_MODEL_LEN})
    assert too_long.status_code == 400
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in too_long.json()["error"]["message"]
    out_of_vocab = httpx.post(server.url + "/v1/completions", headers=headers,
                              json={"model": "tiny", "prompt": [512]})
    assert out_of_vocab.status_code == 400
    result = client.completions.create(model="tiny", prompt="fine", max_tokens=3)
    assert result.usage.completion_tokens >= 1


def _process_maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_api_server_process_loads_no_torch(server):
    """The HTTP frontend runs no model (server/http/torch_free.py): libtorch is mapped in the
    engine core's process only."""
    frontend = server.process.pid
    assert "libtorch" not in _process_maps(frontend)
    assert any("libtorch" in _process_maps(child) for child in _children(frontend))


def test_grammar_errors_come_from_the_core_as_400s(client, server):
    """The grammar library runs in the engine core (it imports torch): its refusal is
    still a 400 naming the field, and a valid spec is then enforced."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "[ab]+("})
    error = refused.value.body
    assert error["param"] == "guided_regex" and "invalid regex" in error["message"]
    result = client.completions.create(model="tiny", prompt="x", max_tokens=8,
                                       extra_body={"guided_regex": "[ab]{3}"})
    assert len(result.choices[0].text) == 3 and set(result.choices[0].text) <= {"a", "b"}


def test_cli_reports_engine_startup_errors(checkpoint):
    proc = ServerProcess(["--model", str(checkpoint), "--port", "0", "--max-model-len", "100000",
                          "--kv-cache-memory", "32M"], env={})
    try:
        code = proc.process.wait(ServerProcess.START_TIMEOUT_S)
    finally:
        proc.stop()
    assert code == 1
    errors = [line for line in proc.lines if line.startswith("error:")]
    assert errors and "the engine failed to start" in errors[0]
    assert "100000" in errors[0], "\n".join(proc.lines[-20:])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_live_run_against_pagedserve(server, checkpoint, endpoint):
    """The serving benchmark, end to end against this real server: no failed request."""
    from tests.support.bench import run_bench

    metrics = run_bench(
        server.url + "/v1", "--api-key", API_KEY, "--model", "tiny", "--endpoint", endpoint,
        "--tokenizer", str(checkpoint), "--num-prompts", "8", "--random-input-len", "24",
        "--random-output-len", "12", "--max-concurrency", "4", "--seed", "0",
    )
    assert (metrics.completed, metrics.failed) == (8, 0)
    assert metrics.total_output_tokens > 0
    assert 1 <= metrics.peak_concurrency <= 4
