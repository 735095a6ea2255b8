"""AsyncEngine over the engine-core clients (thread and process), with the echo
FakeExecutor; the IPC codec; the core process's start-up errors and lifetime."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.executor.abstract import ExecutorSpec
from engine.frontend.async_engine import AsyncEngine, EngineRequestError
from engine.frontend.core_client import (
    EngineDeadError,
    EngineStartupError,
)
from engine.frontend.processor import PromptError, derive_seed
from engine.ipc import AbortRequests, AddRequest, Outputs, Ready, core_codec, frontend_codec
from engine.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    KVCacheInfo,
    Logprobs,
    SchedulerStats,
)
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams
from tests.support.server_fixtures import FakeExecutor, build_tokenizer_dir
from tests.support.sync_clients import InprocClient, SyncMPClient

FAKE = f"{FakeExecutor.__module__}:FakeExecutor"
FAIL_TOKEN = 7


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def make_config(max_model_len: int = 128) -> EngineConfig:
    return EngineConfig(ModelConfig(model="fake", max_model_len=max_model_len))


def spec(tokenizer, **kwargs) -> ExecutorSpec:
    return ExecutorSpec(FAKE, {"vocab_size": len(tokenizer), "fail_token_id": FAIL_TOKEN,
                               **kwargs})


class RecordingObserver:
    def __init__(self):
        self.steps = []
        self.finished = []

    def on_step(self, stats):
        self.steps.append(stats)

    def on_request_finished(self, output, error):
        self.finished.append((output, error))


# Waits below end as soon as their condition holds; the deadline only turns a hang into a
# failure, so it is generous enough for a busy machine.
DEADLINE_S = 60


async def until(condition, what: str, timeout_s: float = DEADLINE_S) -> None:
    """Poll `condition()` until it is true; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def collect(engine: AsyncEngine, prompt, params, req_id):
    outputs = []
    async for output in engine.generate(prompt, params, req_id):
        outputs.append(output)
    return outputs


def greedy(max_tokens=16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# ------------------------------------------------------------------------- codec
def test_ipc_codec_round_trip():
    params = SamplingParams(temperature=0.5, logit_bias={3: 1.5}, stop=["x"], seed=4)
    request = EngineCoreRequest("r", [1, 2, 3], params, eos_token_id=2, priority=1,
                                cache_salt="s")
    decoded = core_codec().decode(frontend_codec().encode(AddRequest(request)))
    assert decoded == AddRequest(request)
    assert core_codec().decode(frontend_codec().encode(AbortRequests(["a"]))).req_ids == ["a"]
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [5], "stop", stop_reason=9, num_cached_tokens=16,
                                  new_logprobs=Logprobs([[5, 6]], [[-0.1, -2.0]], [1]))],
        scheduler_stats=SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5),
        timestamp=1.0, scheduled_times={"r": 0.5})
    assert frontend_codec().decode(core_codec().encode(Outputs(outputs))).outputs == outputs
    info = KVCacheInfo(10, 16, 256, 500)
    assert frontend_codec().decode(core_codec().encode(Ready(info, 1))).kv_cache_info == info


def test_derive_seed():
    assert derive_seed(None, 3) is None
    assert derive_seed(42, 0) == 42
    seeds = [derive_seed(42, i) for i in range(8)]
    assert len(set(seeds)) == 8
    assert seeds == [derive_seed(42, i) for i in range(8)]
    assert all(0 <= s < 2**63 for s in seeds)


# ------------------------------------------------------------------ thread mode
@pytest.fixture
def thread_engine(tokenizer):
    observer = RecordingObserver()

    async def start():
        return await AsyncEngine.start(make_config(), tokenizer, eos_token_id=tokenizer.eos_token_id,
                                       observer=observer, executor_spec=spec(tokenizer),
                                       mode="thread")

    return start, observer


def test_generate_deltas_and_metrics(thread_engine, tokenizer):
    start, observer = thread_engine

    async def main():
        engine = await start()
        try:
            text = "你好，世界！🎉 hello"
            outputs = await collect(engine, text, greedy(40), "r1")
            final = outputs[-1]
            assert final.finished and all(not o.finished for o in outputs[:-1])
            seq = final.outputs[0]
            assert "".join(o.outputs[0].delta_text for o in outputs) == seq.text
            assert sum(len(o.outputs[0].delta_token_ids) for o in outputs) == len(seq.token_ids)
            # Echo model: greedy output repeats the prompt until max_tokens.
            assert seq.text.startswith(text)
            assert seq.finish_reason == "length" and len(seq.token_ids) == 40
            m = final.metrics
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
            assert final.num_prompt_tokens == len(tokenizer(text).input_ids)
            assert observer.finished and observer.finished[-1][1] is None
            assert observer.steps
            assert engine.num_unfinished_requests == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_n_with_seed_is_reproducible_and_distinct(thread_engine):
    start, _ = thread_engine

    async def main():
        engine = await start()
        try:
            params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, logprobs=2)
            first = (await collect(engine, "hello", params, "a"))[-1]
            second = (await collect(engine, "hello", params, "b"))[-1]
            samples = [o.token_ids for o in first.outputs]
            assert [o.index for o in first.outputs] == [0, 1, 2]
            assert len({tuple(s) for s in samples}) == 3
            assert samples == [o.token_ids for o in second.outputs]
            single = SamplingParams(temperature=1.0, seed=11, max_tokens=8)
            alone = (await collect(engine, "hello", single, "c"))[-1]
            assert alone.outputs[0].token_ids == samples[0]
            logprobs = first.outputs[0].logprobs
            assert len(logprobs) == 8 and logprobs[0].token_id == samples[0][0]
            assert len(logprobs[0].top) == 2
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_stop_string_stops_and_aborts_in_core(thread_engine):
    start, _ = thread_engine

    async def main():
        engine = await start()
        try:
            outputs = await collect(engine, "The quick brown fox jumps",
                                    greedy(60, stop=["fox jum"]), "s")
            seq = outputs[-1].outputs[0]
            assert seq.text == "The quick brown "
            assert seq.finish_reason == "stop" and seq.stop_reason == "fox jum"
            assert len(seq.token_ids) < 60
            core = engine.client._proc.core
            # The abort reaches the core thread asynchronously.
            await until(lambda: not core.has_unfinished_requests(), "the core to drop it")
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_closing_the_stream_aborts(tokenizer):
    async def main():
        engine = await AsyncEngine.start(
            make_config(), tokenizer, executor_spec=spec(tokenizer, step_delay_s=0.01),
            mode="thread")
        try:
            stream = engine.generate("hello there", greedy(100), "x")
            await stream.__anext__()
            await stream.aclose()
            assert engine.num_unfinished_requests == 0
            core = engine.client._proc.core
            await until(lambda: not core.has_unfinished_requests(), "the core to drop it")
            # abort_request() of a live request ends its stream with "abort". It is
            # live: it has sent its first output, and 99 more steps of 10 ms are left.
            stream = engine.generate("hello", greedy(100), "y")
            outputs = [await stream.__anext__()]
            assert engine.abort_request("y")
            outputs += [output async for output in stream]
            assert outputs[-1].outputs[0].finish_reason == "abort"
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_bad_prompts_and_engine_errors(thread_engine, tokenizer):
    start, observer = thread_engine

    async def main():
        engine = await start()
        try:
            with pytest.raises(PromptError, match="out of vocabulary"):
                await collect(engine, [len(tokenizer) + 5], greedy(), "v")
            with pytest.raises(PromptError, match="maximum context length is 128"):
                await collect(engine, [10] * 100, greedy(29), "l")
            with pytest.raises(PromptError, match="empty"):
                await collect(engine, [], greedy(), "e")
            with pytest.raises(EngineRequestError, match="fake model failure"):
                await collect(engine, [10, FAIL_TOKEN, 11], greedy(), "f")
            assert observer.finished[-1][1] is not None
            # The engine keeps serving.
            outputs = await collect(engine, [10, 11], greedy(4), "ok")
            assert outputs[-1].outputs[0].token_ids == [10, 11, 10, 11]
            assert engine.is_running
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_prompt_logprobs_rows(thread_engine):
    start, _ = thread_engine

    async def main():
        engine = await start()
        try:
            params = greedy(2, logprobs=1, prompt_logprobs=1)
            final = (await collect(engine, [10, 11, 12], params, "p"))[-1]
            assert final.prompt_logprobs[0] is None
            assert [p.token_id for p in final.prompt_logprobs[1:]] == [11, 12]
        finally:
            await engine.shutdown()

    asyncio.run(main())


# ----------------------------------------------------------------- process mode
def test_process_engine_serves_concurrent_requests(tokenizer):
    async def main():
        engine = await AsyncEngine.start(make_config(), tokenizer, executor_spec=spec(tokenizer))
        try:
            prompts = [[10 + i, 20 + i, 30 + i] for i in range(12)]
            results = await asyncio.gather(*[
                collect(engine, p, greedy(9), f"c{i}") for i, p in enumerate(prompts)])
            for prompt, outputs in zip(prompts, results, strict=True):
                assert outputs[-1].outputs[0].token_ids == prompt * 3
            assert await engine.reset_prefix_cache() in (True, False)
        finally:
            await engine.shutdown()
        assert engine.client._proc.process.exitcode == 0  # stopped by Shutdown, not killed

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["inproc", "sync-process"])
def test_sync_clients(tokenizer, kind):
    if kind == "inproc":
        client = InprocClient.start(make_config(), FakeExecutor(make_config(), len(tokenizer)))
    else:
        client = SyncMPClient(make_config(), spec(tokenizer))
    try:
        assert client.kv_cache_info.max_model_len == 128
        client.add_request(EngineCoreRequest("a", [10, 11, 12], greedy(5)))
        client.add_request(EngineCoreRequest("b", [20, 21], greedy(50)))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        finished: dict[str, str] = {}
        while "a" not in finished:
            for output in client.get_output().outputs:
                tokens[output.req_id] += output.new_token_ids
                if output.finished:
                    finished[output.req_id] = output.finish_reason
        client.abort_requests(["b"])
        assert tokens["a"] == [10, 11, 12, 10, 11] and finished == {"a": "length"}
        assert client.call_utility("has_unfinished_requests") in (True, False)
    finally:
        client.shutdown()


def test_startup_error_is_reported(tokenizer):
    async def main():
        with pytest.raises(EngineStartupError, match="no attribute 'NoSuchExecutor'"):
            await AsyncEngine.start(make_config(), tokenizer,
                                    executor_spec=ExecutorSpec(f"{FakeExecutor.__module__}:"
                                                               "NoSuchExecutor"))

    asyncio.run(main())


def test_dead_core_fails_requests(tokenizer):
    async def main():
        engine = await AsyncEngine.start(make_config(), tokenizer,
                                         executor_spec=spec(tokenizer, step_delay_s=0.02))
        try:
            # Killed mid-request: after its first output, with 99 steps of 20 ms left.
            stream = engine.generate([10, 11], greedy(100), "d")
            await stream.__anext__()
            os.kill(engine.client.pid, signal.SIGKILL)

            async def rest():
                return [output async for output in stream]

            with pytest.raises(EngineRequestError, match="exited unexpectedly"):
                # Noticed within ~0.1 s; the deadline only guards against a hang.
                await asyncio.wait_for(rest(), DEADLINE_S)
            assert not engine.is_running
            with pytest.raises(EngineDeadError):
                await collect(engine, [10], greedy(), "after")
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_core_exits_when_frontend_dies(tokenizer_dir, tmp_path):
    """Kill -9 the frontend process: its core process must exit on its own."""
    script = tmp_path / "frontend.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys, time
        sys.path[:0] = {sys.path!r}
        from engine.config import EngineConfig, ModelConfig
        from engine.frontend.core_client import AsyncMPClient
        from engine.executor.abstract import ExecutorSpec

        async def main():
            client = await AsyncMPClient.start(
                EngineConfig(ModelConfig(model="fake", max_model_len=64)),
                ExecutorSpec({FAKE!r}, {{"vocab_size": 300}}))
            print(client.pid, flush=True)
            await asyncio.sleep(60)

        if __name__ == "__main__":
            asyncio.run(main())
    """))
    frontend = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                text=True)
    try:
        core_pid = int(frontend.stdout.readline())
        os.kill(frontend.pid, signal.SIGKILL)
        frontend.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S  # it exits within about a second
        while time.monotonic() < deadline:
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                break
            # Reap it if it became our child (it is re-parented to init otherwise).
            time.sleep(0.1)
        else:
            os.kill(core_pid, signal.SIGKILL)
            pytest.fail("the core process outlived its frontend")
    finally:
        if frontend.poll() is None:
            frontend.kill()
